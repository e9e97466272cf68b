// The planner's fast paths against their one-thread, one-draw-at-a-time definitions:
// PrefetchedShuffle is Shuffle (prng.h), SortAndShuffle on two threads is the counting sort plus
// one Shuffle per bucket in order, and MakePlan's ids (sorted on a second thread) are those ids.
#include "ditscale/balance/internal/buckets.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/planner.h"

namespace ditscale::balance::internal {
namespace {

TEST(Buckets, PrefetchedShuffleIsShuffle) {
  for (int64_t n : {0, 1, 2, 31, 32, 33, 34, 100, 4097, 300000}) {
    std::vector<int64_t> a(n), b(n);
    std::iota(a.begin(), a.end(), 0);
    b = a;
    SplitMix64 ra(StreamKey(3, 1, kBucketShuffle, n)), rb(StreamKey(3, 1, kBucketShuffle, n));
    Shuffle(a.data(), n, ra);
    PrefetchedShuffle(b.data(), n, rb);
    ASSERT_EQ(a, b) << "n = " << n;
    EXPECT_EQ(ra.Next(), rb.Next()) << "n = " << n << ": the streams must end in the same state";
  }
}

// Skewed bucket sizes (one bucket of most samples, many small and some empty ones).
ShapedManifest SkewedShapes(int64_t n) {
  ShapedManifest s;
  for (int k = 0; k < 40; ++k) s.shapes.push_back(TrainShape{1, 256, 256, 256 + 16 * k});
  std::mt19937_64 rng(5);
  s.count.assign(s.shapes.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t shape = rng() % 3 == 0 ? 7 : static_cast<int32_t>(rng() % 20) * 2;
    s.shape_of.push_back(shape);
    s.ids.push_back(3 * i + 1);
    ++s.count[shape];
  }
  return s;
}

Buckets Reference(const ShapedManifest& s, uint64_t seed, int64_t epoch) {
  Buckets b;
  b.begin.assign(s.shapes.size() + 1, 0);
  for (size_t k = 0; k < s.shapes.size(); ++k) {
    b.begin[k + 1] = b.begin[k] + s.count[k];
    for (size_t i = 0; i < s.shape_of.size(); ++i) {
      if (s.shape_of[i] == static_cast<int32_t>(k)) b.ids.push_back(s.ids[i]);
    }
    SplitMix64 rng(StreamKey(seed, epoch, kBucketShuffle, k));
    Shuffle(b.ids.data() + b.begin[k], s.count[k], rng);
  }
  return b;
}

TEST(Buckets, TwoThreadSortAndShuffleIsOnePass) {
  for (int64_t n : {int64_t{1000}, int64_t{1} << 18}) {  // below and above the 2^17 threshold
    const ShapedManifest s = SkewedShapes(n);
    const Buckets want = Reference(s, 9, 4);
    const Buckets got = SortAndShuffle(s, 9, 4);
    EXPECT_EQ(got.begin, want.begin) << "n = " << n;
    EXPECT_EQ(got.ids, want.ids) << "n = " << n;
  }
}

TEST(Buckets, DenseIdsAreTheRowNumbers) {
  for (int64_t n : {int64_t{1000}, int64_t{1} << 18}) {
    ShapedManifest stored = SkewedShapes(n);
    for (int64_t i = 0; i < n; ++i) stored.ids[i] = i;
    ShapedManifest dense = stored;
    dense.ids.clear();
    dense.ids_dense = true;
    const Buckets want = SortAndShuffle(stored, 9, 4);
    const Buckets got = SortAndShuffle(dense, 9, 4);
    EXPECT_EQ(got.begin, want.begin) << "n = " << n;
    EXPECT_EQ(got.ids, want.ids) << "n = " << n;
  }
}

TEST(Buckets, MakePlanIdsAreTheShuffledBuckets) {
  const ShapedManifest s = SkewedShapes(int64_t{1} << 18);
  CostModel cost;
  cost.kind = CostModel::Kind::kPower;
  cost.a = 0.01;
  cost.b = 1e-6;
  cost.p = 1.5;
  for (Policy policy : {Policy::kEqualToken, Policy::kBalanced}) {
    PlanOptions o;
    o.policy = policy;
    o.world_size = 8;
    o.seed = 9;
    o.epoch = 4;
    o.m_mem_tokens = 1 << 14;
    auto plan = MakePlan(s, cost, o);
    ASSERT_TRUE(plan.ok()) << plan.failure().ToString();
    EXPECT_EQ(plan->ids, Reference(s, 9, 4).ids) << PolicyName(policy);
    // Every micro-batch lies inside its shape's bucket.
    const Buckets b = Reference(s, 9, 4);
    for (const MicroBatch& mb : plan->micro_batches) {
      ASSERT_GE(mb.begin, b.begin[mb.shape]);
      ASSERT_LE(mb.end, b.begin[mb.shape + 1]);
    }
  }
}

}  // namespace
}  // namespace ditscale::balance::internal
