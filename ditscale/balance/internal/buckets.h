// Shared internals of the planner: shape buckets and rank-cost accounting.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/internal/prng.h"
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
// (seed, epoch, shape index). O(N), one allocation of N ids. From 2^17 samples on the buckets
// are shuffled on two threads (each bucket by one thread; the same ids).
Buckets SortAndShuffle(const ShapedManifest& shaped, uint64_t seed, int64_t epoch);

// Shuffle(first, n, rng) (prng.h) exactly: the same draws in the same order and the same swaps,
// the partner of each swap drawn kAhead swaps early and its cache line prefetched, so that the
// random accesses of an array larger than the caches overlap instead of waiting for memory one
// by one.
template <typename T>
void PrefetchedShuffle(T* first, int64_t n, SplitMix64& rng) {
  constexpr int64_t kAhead = 16;  // a power of two
  const int64_t steps = n - 1;    // step k swaps first[n - 1 - k] with a draw in [0, n - 1 - k]
  if (steps < 2 * kAhead) {
    Shuffle(first, n, rng);
    return;
  }
  int64_t partner[kAhead];
  auto draw = [&](int64_t k) {
    const int64_t j = static_cast<int64_t>(rng.Below(static_cast<uint64_t>(n - 1 - k) + 1));
    __builtin_prefetch(first + j, 1);
    return j;
  };
  for (int64_t k = 0; k < kAhead; ++k) partner[k] = draw(k);
  for (int64_t k = 0; k < steps; ++k) {
    const int64_t j = partner[k & (kAhead - 1)];
    if (k + kAhead < steps) partner[k & (kAhead - 1)] = draw(k + kAhead);
    std::swap(first[n - 1 - k], first[j]);
  }
}

}  // namespace ditscale::balance::internal
