#include "ditscale/balance/internal/buckets.h"

#include "ditscale/balance/internal/prng.h"

namespace ditscale::balance::internal {

Buckets SortAndShuffle(const ShapedManifest& shaped, uint64_t seed, int64_t epoch) {
  const int64_t num_shapes = static_cast<int64_t>(shaped.shapes.size());
  const int64_t n = static_cast<int64_t>(shaped.shape_of.size());
  Buckets b;
  b.begin.assign(num_shapes + 1, 0);
  for (int64_t i = 0; i < n; ++i) ++b.begin[shaped.shape_of[i] + 1];
  for (int64_t s = 0; s < num_shapes; ++s) b.begin[s + 1] += b.begin[s];
  std::vector<int64_t> pos(b.begin.begin(), b.begin.end() - 1);
  b.ids.resize(n);
  const int32_t* shape_of = shaped.shape_of.data();
  const int64_t* ids = shaped.ids.data();
  for (int64_t i = 0; i < n; ++i) b.ids[pos[shape_of[i]]++] = ids[i];
  for (int64_t s = 0; s < num_shapes; ++s) {
    SplitMix64 rng(StreamKey(seed, epoch, kBucketShuffle, static_cast<uint64_t>(s)));
    Shuffle(b.ids.data() + b.begin[s], b.begin[s + 1] - b.begin[s], rng);
  }
  return b;
}

}  // namespace ditscale::balance::internal
