// Test helper (header only, for the sequence-parallel planner and sampler tests): a quadratic
// cost model and a shaped manifest of given sequence lengths and counts.
#pragma once

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/shapes.h"

namespace ditscale::balance::internal {

// Work(S) = 1e-5 S + 1e-9 S^2 s, a = 0.05 s a step, a_mb = 0.01 s a micro-batch.
inline CostModel QuadraticTestCost() {
  CostModel c;
  c.kind = CostModel::Kind::kQuadratic;
  c.a = 0.05, c.a_mb = 0.01, c.c1 = 1e-5, c.c2 = 1e-9;
  c.source = "test";
  return c;
}

// counts[i] samples of TrainShape{1, 16, 16, lens[i]}, in a shape order shuffled by `seed`;
// sample i has id i * id_stride.
inline ShapedManifest ShapedTestManifest(const std::vector<int64_t>& lens,
                                         const std::vector<int64_t>& counts, uint64_t seed,
                                         int64_t id_stride) {
  ShapedManifest m;
  for (int64_t s : lens) m.shapes.push_back(TrainShape{1, 16, 16, s});
  m.count = counts;
  for (size_t s = 0; s < counts.size(); ++s) {
    for (int64_t i = 0; i < counts[s]; ++i) m.shape_of.push_back(static_cast<int32_t>(s));
  }
  std::mt19937_64 g(seed);
  std::shuffle(m.shape_of.begin(), m.shape_of.end(), g);
  for (size_t i = 0; i < m.shape_of.size(); ++i) {
    m.ids.push_back(static_cast<int64_t>(i) * id_stride);
  }
  return m;
}

}  // namespace ditscale::balance::internal
