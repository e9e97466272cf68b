#include "ditscale/sp/internal/fair_share.h"

#include <limits>

#include "ditscale/core/error.h"

namespace ditscale::sp::internal {

std::vector<double> MaxMinFairRatesWide(const std::vector<double>& capacity,
                                        const std::vector<FlowResources>& flows) {
  const int nr = static_cast<int>(capacity.size());
  const int nf = static_cast<int>(flows.size());
  std::vector<double> rate(nf, std::numeric_limits<double>::infinity());
  std::vector<double> left(capacity);
  std::vector<int> count(nr, 0);
  std::vector<char> frozen(nf, 0);
  int unfrozen = 0;
  for (int f = 0; f < nf; ++f) {
    bool any = false;
    for (int r : flows[f]) {
      if (r < 0) continue;
      DS_CHECK(r < nr, "flow ", f, " uses resource ", r, " of ", nr);
      ++count[r];
      any = true;
    }
    if (any) {
      ++unfrozen;
    } else {
      frozen[f] = 1;
    }
  }
  while (unfrozen > 0) {
    double share = std::numeric_limits<double>::infinity();
    for (int r = 0; r < nr; ++r) {
      if (count[r] > 0) share = std::min(share, left[r] / count[r]);
    }
    // Saturated resources: those whose share is (within rounding) the minimum.
    std::vector<char> saturated(nr, 0);
    for (int r = 0; r < nr; ++r) {
      if (count[r] > 0 && left[r] / count[r] <= share * (1 + 1e-12)) saturated[r] = 1;
    }
    for (int f = 0; f < nf; ++f) {
      if (frozen[f]) continue;
      bool hit = false;
      for (int r : flows[f]) hit |= r >= 0 && saturated[r];
      if (!hit) continue;
      frozen[f] = 1;
      --unfrozen;
      rate[f] = share;
      for (int r : flows[f]) {
        if (r < 0) continue;
        left[r] = std::max(0.0, left[r] - share);
        --count[r];
      }
    }
  }
  return rate;
}

std::vector<double> MaxMinFairRates(const std::vector<double>& capacity,
                                    const std::vector<std::array<int, 2>>& flows) {
  std::vector<FlowResources> wide;
  wide.reserve(flows.size());
  for (const auto& f : flows) wide.push_back({f[0], f[1], -1, -1, -1, -1});
  return MaxMinFairRatesWide(capacity, wide);
}

}  // namespace ditscale::sp::internal
