#include "ditscale/balance/internal/buckets.h"

#include <algorithm>
#include <thread>

#include "ditscale/balance/internal/prng.h"

namespace ditscale::balance::internal {
namespace {

// Manifests from this many samples on shuffle their buckets on two threads.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

}  // namespace

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
  if (shaped.ids_dense) {
    for (int64_t i = 0; i < n; ++i) b.ids[pos[shape_of[i]]++] = i;
  } else {
    const int64_t* ids = shaped.ids.data();
    for (int64_t i = 0; i < n; ++i) b.ids[pos[shape_of[i]]++] = ids[i];
  }
  // Every bucket has a stream of its own and its own ids: the buckets are shuffled on two
  // threads (the largest first, each to the part with fewer ids so far), with the same result.
  auto shuffle = [&](int64_t s) {
    SplitMix64 rng(StreamKey(seed, epoch, kBucketShuffle, static_cast<uint64_t>(s)));
    PrefetchedShuffle(b.ids.data() + b.begin[s], b.begin[s + 1] - b.begin[s], rng);
  };
  if (n < kParallelSamples || std::thread::hardware_concurrency() < 2) {
    for (int64_t s = 0; s < num_shapes; ++s) shuffle(s);
    return b;
  }
  std::vector<int64_t> order(num_shapes);
  for (int64_t s = 0; s < num_shapes; ++s) order[s] = s;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return b.begin[x + 1] - b.begin[x] > b.begin[y + 1] - b.begin[y];
  });
  std::vector<int64_t> mine, theirs;
  int64_t mine_n = 0, theirs_n = 0;
  for (int64_t s : order) {
    const int64_t size = b.begin[s + 1] - b.begin[s];
    if (mine_n <= theirs_n) {
      mine.push_back(s), mine_n += size;
    } else {
      theirs.push_back(s), theirs_n += size;
    }
  }
  {
    std::jthread worker([&] {
      for (int64_t s : theirs) shuffle(s);
    });
    for (int64_t s : mine) shuffle(s);
  }
  return b;
}

}  // namespace ditscale::balance::internal
