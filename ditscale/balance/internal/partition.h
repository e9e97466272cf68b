// Multiway number partitioning of weighted items onto k bins (ranks), minimising the largest bin.
//   LptAssign:      Longest Processing Time first (Graham): items by decreasing weight, each to the
//                   currently lightest bin; max load <= (4/3 - 1/(3k)) * optimum.
//   ImproveBySwaps: local search on an assignment: moves an item from the heaviest bin to the
//                   lightest, or swaps a pair between them, while that lowers the larger of the
//                   two.
// Deterministic: ties are broken by item index, then bin index.
#pragma once

#include <cstdint>
#include <vector>

namespace ditscale::balance::internal {

// weights: item weights (>= 0); bins: k >= 1; base: optional per-bin starting load (size k or
// empty). Returns bin index of each item.
std::vector<int32_t> LptAssign(const std::vector<double>& weights, int32_t bins,
                               const std::vector<double>& base = {});

// Improves `bin_of` (size weights.size(), values in [0, bins)) in place; at most max_rounds
// improving moves. Returns the final maximum bin load (including base).
double ImproveBySwaps(const std::vector<double>& weights, int32_t bins,
                      std::vector<int32_t>& bin_of, const std::vector<double>& base = {},
                      int max_rounds = 64);

// Bin loads of an assignment: base[b] + sum of weights assigned to b.
std::vector<double> BinLoads(const std::vector<double>& weights, int32_t bins,
                             const std::vector<int32_t>& bin_of,
                             const std::vector<double>& base = {});

}  // namespace ditscale::balance::internal
