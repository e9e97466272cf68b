// Shared internals of the planner: shape buckets and rank-cost accounting.
#pragma once

#include <cstdint>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/shapes.h"

namespace ditscale::balance::internal {

// Purposes of the PRNG streams (internal/prng.h StreamKey).
enum StreamPurpose : uint64_t {
  kBucketShuffle = 1,
  kMicroBatchOrder = 2,
  kMCompSearch = 3,
  kSimNoise = 4,
};

// Samples counting-sorted by shape: bucket s holds ids[begin[s] .. begin[s + 1]).
struct Buckets {
  std::vector<int64_t> ids;
  std::vector<int64_t> begin;  // size num_shapes + 1
};

// Counting sort of the manifest by shape, then a Fisher-Yates shuffle of each bucket seeded by
// (seed, epoch, shape index). O(N), one allocation of N ids.
Buckets SortAndShuffle(const ShapedManifest& shaped, uint64_t seed, int64_t epoch);

}  // namespace ditscale::balance::internal
