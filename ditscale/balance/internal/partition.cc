#include "ditscale/balance/internal/partition.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "ditscale/core/error.h"

namespace ditscale::balance::internal {

std::vector<double> BinLoads(const std::vector<double>& weights, int32_t bins,
                             const std::vector<int32_t>& bin_of, const std::vector<double>& base) {
  std::vector<double> load(bins, 0.0);
  if (!base.empty()) load = base;
  for (size_t i = 0; i < weights.size(); ++i) load[bin_of[i]] += weights[i];
  return load;
}

std::vector<int32_t> LptAssign(const std::vector<double>& weights, int32_t bins,
                               const std::vector<double>& base) {
  DS_CHECK(bins >= 1, "bins = ", bins);
  DS_CHECK(base.empty() || static_cast<int32_t>(base.size()) == bins, "base size ", base.size());
  std::vector<int32_t> order(weights.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t x, int32_t y) { return weights[x] > weights[y]; });
  std::vector<double> load(bins, 0.0);
  if (!base.empty()) load = base;
  std::vector<int32_t> bin_of(weights.size(), 0);
  for (int32_t i : order) {
    int32_t best = 0;
    for (int32_t b = 1; b < bins; ++b) {
      if (load[b] < load[best]) best = b;
    }
    bin_of[i] = best;
    load[best] += weights[i];
  }
  return bin_of;
}

double ImproveBySwaps(const std::vector<double>& weights, int32_t bins,
                      std::vector<int32_t>& bin_of, const std::vector<double>& base,
                      int max_rounds) {
  std::vector<double> load = BinLoads(weights, bins, bin_of, base);
  const int64_t n = static_cast<int64_t>(weights.size());
  std::vector<int64_t> in_hi, in_lo;
  for (int round = 0; round < max_rounds; ++round) {
    int32_t hi = 0, lo = 0;
    for (int32_t b = 1; b < bins; ++b) {
      if (load[b] > load[hi]) hi = b;
      if (load[b] < load[lo]) lo = b;
    }
    const double gap = load[hi] - load[lo];
    if (gap <= 0) break;
    // Best single move hi -> lo: moving w lowers the pair's max iff 0 < w < gap.
    // Best swap (x in hi, y in lo): moving d = w_x - w_y with 0 < d < gap. Aim for d = gap / 2.
    in_hi.clear();
    in_lo.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (bin_of[i] == hi) in_hi.push_back(i);
      if (bin_of[i] == lo) in_lo.push_back(i);
    }
    double best_d = 0;
    int64_t best_x = -1, best_y = -1;
    for (int64_t x : in_hi) {
      const double w = weights[x];
      if (w > 0 && w < gap && std::abs(gap / 2 - w) < std::abs(gap / 2 - best_d)) {
        best_d = w, best_x = x, best_y = -1;
      }
      for (int64_t y : in_lo) {
        const double d = w - weights[y];
        if (d > 0 && d < gap && std::abs(gap / 2 - d) < std::abs(gap / 2 - best_d)) {
          best_d = d, best_x = x, best_y = y;
        }
      }
    }
    if (best_x < 0 || best_d <= 1e-15 * load[hi]) break;
    bin_of[best_x] = lo;
    if (best_y >= 0) bin_of[best_y] = hi;
    load[hi] -= best_d;
    load[lo] += best_d;
  }
  return *std::max_element(load.begin(), load.end());
}

}  // namespace ditscale::balance::internal
