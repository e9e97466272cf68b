// ChooseMComp: the automatic compute constraint of the adaptive policy (see planner.h).
#include <algorithm>
#include <cmath>

#include "ditscale/balance/internal/buckets.h"
#include "ditscale/balance/internal/prng.h"
#include "ditscale/balance/planner.h"

namespace ditscale::balance {
namespace {

constexpr double kSearchSamples = 200000;  // histogram scaled down to about this many samples
constexpr int kGridPoints = 40;
constexpr size_t kMaxRefine = 48;

struct ShapeCount {
  int64_t seq_len;
  int64_t count;
};

// Simulated epoch time of the adaptive policy at m_comp on a (scaled) shape histogram.
double AdaptiveEpochTime(const std::vector<ShapeCount>& hist, const CostModel& cost, int64_t m_mem,
                         double m_comp, double p, int world_size, uint64_t seed, int64_t epoch,
                         std::vector<double>& items) {
  items.clear();
  for (const ShapeCount& h : hist) {
    const int64_t b = DualConstraintBatch(h.seq_len, m_mem, m_comp, p);
    const int64_t full = h.count / b, rest = h.count % b;
    const double c_full = cost.StepTime(b, h.seq_len);
    items.insert(items.end(), full, c_full);
    if (rest > 0) items.push_back(cost.StepTime(rest, h.seq_len));
  }
  internal::SplitMix64 rng(internal::StreamKey(seed, epoch, internal::kMCompSearch));
  internal::Shuffle(items.data(), static_cast<int64_t>(items.size()), rng);
  double total = 0;
  for (size_t i = 0; i < items.size(); i += world_size) {
    const size_t e = std::min(items.size(), i + static_cast<size_t>(world_size));
    total += *std::max_element(items.begin() + i, items.begin() + e);
  }
  return total;
}

}  // namespace

MCompSearch ChooseMComp(const ShapedManifest& shaped, const CostModel& cost,
                        const PlanOptions& options, double p) {
  MCompSearch out;
  std::vector<int64_t> count = shaped.count;
  if (count.size() != shaped.shapes.size()) {
    count.assign(shaped.shapes.size(), 0);
    for (int32_t s : shaped.shape_of) ++count[s];
  }
  int64_t n = 0;
  for (int64_t c : count) n += c;
  if (n == 0 || options.m_mem_tokens < 1 || options.world_size < 1) return out;
  const double f = std::min(1.0, kSearchSamples / static_cast<double>(n));
  std::vector<ShapeCount> hist;
  double lo = INFINITY, hi = 0;
  for (size_t s = 0; s < count.size(); ++s) {
    if (count[s] == 0) continue;
    const int64_t len = std::max<int64_t>(1, shaped.shapes[s].seq_len);
    const int64_t scaled = std::llround(static_cast<double>(count[s]) * f);
    if (scaled > 0) hist.push_back({len, scaled});
    const double sp = std::pow(static_cast<double>(len), p);
    lo = std::min(lo, sp);
    hi = std::max(hi, static_cast<double>(EqualTokenBatch(len, options.m_mem_tokens)) * sp);
  }
  if (hist.empty()) hist.push_back({std::max<int64_t>(1, shaped.shapes[0].seq_len), 1});
  std::vector<double> items;
  auto eval = [&](double m) {
    out.candidates.push_back(m);
    out.epoch_time_s.push_back(AdaptiveEpochTime(hist, cost, options.m_mem_tokens, m, p,
                                                 options.world_size, options.seed, options.epoch,
                                                 items));
  };
  std::vector<double> grid;
  if (hi <= lo) {
    grid.push_back(hi);
  } else {
    for (int i = 0; i < kGridPoints; ++i) {
      grid.push_back(lo * std::pow(hi / lo, static_cast<double>(i) / (kGridPoints - 1)));
    }
  }
  for (double m : grid) eval(m);
  size_t best = 0;
  for (size_t i = 1; i < grid.size(); ++i) {
    if (out.epoch_time_s[i] < out.epoch_time_s[best]) best = i;
  }
  // Refine on the breakpoints k * S^p (where some B changes) around the best grid point.
  if (grid.size() > 1) {
    const double r_lo = grid[best == 0 ? 0 : best - 1];
    const double r_hi = grid[std::min(best + 1, grid.size() - 1)];
    std::vector<double> breaks;
    for (const ShapeCount& h : hist) {
      const double sp = std::pow(static_cast<double>(h.seq_len), p);
      const double k0 = std::max(1.0, std::ceil(r_lo / sp));
      const double k1 =
          std::min(std::floor(r_hi / sp),
                   static_cast<double>(EqualTokenBatch(h.seq_len, options.m_mem_tokens)));
      for (double k = k0; k <= k1 && breaks.size() < 100000; k += 1) breaks.push_back(k * sp);
    }
    std::sort(breaks.begin(), breaks.end());
    breaks.erase(std::unique(breaks.begin(), breaks.end()), breaks.end());
    if (breaks.size() > kMaxRefine) {
      std::vector<double> picked;
      for (size_t i = 0; i < kMaxRefine; ++i) {
        picked.push_back(breaks[i * (breaks.size() - 1) / (kMaxRefine - 1)]);
      }
      breaks = std::move(picked);
    }
    for (double m : breaks) eval(m);
  }
  size_t arg = 0;
  for (size_t i = 1; i < out.candidates.size(); ++i) {
    if (out.epoch_time_s[i] < out.epoch_time_s[arg]) arg = i;
  }
  out.m_comp = out.candidates[arg];
  return out;
}

}  // namespace ditscale::balance
