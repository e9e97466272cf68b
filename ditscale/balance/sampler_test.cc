#include "ditscale/balance/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

// A hand-made planner with the structure the real ones produce: ids shuffled by (seed, epoch),
// cut into micro-batches of 1..4 ids, each step gives every rank 1..3 micro-batches; the tail
// that cannot give every rank one micro-batch is dropped, padded or kept.
Plan ToyPlan(int64_t n, uint64_t seed, int world_size, int64_t epoch, TailPolicy tail) {
  Plan plan;
  plan.world_size = world_size;
  plan.seed = seed;
  plan.epoch = epoch;
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(epoch) * 7919 + 1);
  plan.ids.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) plan.ids[i] = i;
  std::shuffle(plan.ids.begin(), plan.ids.end(), rng);
  for (int64_t b = 0; b < n;) {
    const int64_t e = std::min<int64_t>(n, b + 1 + static_cast<int64_t>(rng() % 4));
    plan.micro_batches.push_back({b, e, static_cast<int32_t>(e - b), 0.1 * (e - b)});
    b = e;
  }
  const int64_t num_mb = static_cast<int64_t>(plan.micro_batches.size());
  plan.rank_offsets.push_back(0);
  int64_t next = 0;
  while (next < num_mb) {
    const int64_t left = num_mb - next;
    if (left < world_size && tail == TailPolicy::kDrop) {
      for (int64_t i = next; i < num_mb; ++i) {
        plan.dropped_samples += plan.micro_batches[i].end - plan.micro_batches[i].begin;
      }
      break;
    }
    std::vector<int64_t> count(world_size);
    int64_t total = 0;
    for (int r = 0; r < world_size; ++r) total += count[r] = 1 + static_cast<int64_t>(rng() % 3);
    if (total > left) {  // the last step: spread what is left
      std::fill(count.begin(), count.end(), 0);
      for (int64_t i = 0; i < left; ++i) ++count[i % world_size];
    }
    for (int r = 0; r < world_size; ++r) {
      for (int64_t i = 0; i < count[r]; ++i) plan.work.push_back(next++);
      if (count[r] == 0 && tail == TailPolicy::kPad) {
        plan.work.push_back(0);
        ++plan.padded_micro_batches;
      }
      plan.rank_offsets.push_back(static_cast<int64_t>(plan.work.size()));
    }
  }
  return plan;
}

EpochPlanner ToyPlanner(int64_t n, uint64_t seed, int world_size, TailPolicy tail) {
  return [=](int64_t epoch) -> Result<Plan> { return ToyPlan(n, seed, world_size, epoch, tail); };
}

BalancedBatchSampler MakeToy(int64_t n, uint64_t seed, int world_size, int rank,
                             TailPolicy tail = TailPolicy::kDrop, int64_t epoch = 0) {
  return BalancedBatchSampler::Create(ToyPlanner(n, seed, world_size, tail), rank, world_size,
                                      epoch)
      .ValueOrThrow();
}

using Batches = std::vector<std::vector<int64_t>>;

Batches DrainMicroBatches(BalancedBatchSampler& s) {
  Batches out;
  while (auto mb = s.NextMicroBatch()) out.emplace_back(mb->ids.begin(), mb->ids.end());
  return out;
}

// Fresh random sizes for every run; the seed is printed on failure.
uint64_t FreshSeed() {
  static std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) | rd();
}

TEST(Sampler, EveryIdExactlyOnceAcrossRanks) {
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  for (TailPolicy tail : {TailPolicy::kDrop, TailPolicy::kKeep}) {
    for (int ws : {1, 2, 3, 8}) {
      // kDrop needs one micro-batch (1..4 ids) for every rank: at least 4 * ws ids, else the
      // plan has no step (a failure of Create, tested elsewhere).
      const int64_t least = tail == TailPolicy::kDrop ? 4 * ws : 1;
      const int64_t n = least + static_cast<int64_t>(rng() % 500);
      std::vector<int> seen(static_cast<size_t>(n), 0);
      int64_t dropped = -1;
      int64_t steps = -1;
      for (int r = 0; r < ws; ++r) {
        BalancedBatchSampler s = MakeToy(n, seed, ws, r, tail);
        if (r == 0) steps = s.NumSteps();
        EXPECT_EQ(s.NumSteps(), steps) << "seed " << seed;
        dropped = s.DroppedSamples();
        int64_t mbs = 0;
        for (const auto& mb : DrainMicroBatches(s)) {
          ++mbs;
          for (int64_t id : mb) {
            ASSERT_TRUE(id >= 0 && id < n);
            ++seen[id];
          }
        }
        EXPECT_EQ(mbs, s.NumMicroBatches());
        EXPECT_EQ(s.RemainingMicroBatches(), 0);
      }
      int64_t once = 0;
      for (int c : seen) {
        ASSERT_LE(c, 1) << "an id appeared twice; seed " << seed << " ws " << ws;
        once += c;
      }
      EXPECT_EQ(once + dropped, n) << "seed " << seed << " ws " << ws;
      if (tail == TailPolicy::kKeep) {
        EXPECT_EQ(dropped, 0);
      }
    }
  }
}

TEST(Sampler, FlatFlagsMatchStepIteration) {
  const uint64_t seed = FreshSeed();
  const int ws = 4;
  for (int r = 0; r < ws; ++r) {
    BalancedBatchSampler flat = MakeToy(300, seed, ws, r, TailPolicy::kKeep);
    BalancedBatchSampler steps = MakeToy(300, seed, ws, r, TailPolicy::kKeep);
    std::vector<MicroBatchRef> step;
    int64_t k = 0;
    while (steps.NextStep(&step)) {
      EXPECT_EQ(static_cast<int64_t>(step.size()), steps.MicroBatchesInCell(k, r));
      for (size_t i = 0; i < step.size(); ++i) {
        auto mb = flat.NextMicroBatch();
        ASSERT_TRUE(mb.has_value());
        EXPECT_EQ(mb->step, k);
        EXPECT_EQ(mb->index_in_step, static_cast<int32_t>(i));
        EXPECT_EQ(mb->last_of_step, i + 1 == step.size());
        EXPECT_TRUE(
            std::equal(mb->ids.begin(), mb->ids.end(), step[i].ids.begin(), step[i].ids.end()));
      }
      ++k;
    }
    EXPECT_EQ(k, steps.NumSteps()) << "seed " << seed;
    EXPECT_FALSE(flat.NextMicroBatch().has_value());
    EXPECT_EQ(steps.RemainingSteps(), 0);
  }
}

TEST(Sampler, DeterministicPerSeedAndEpoch) {
  const uint64_t seed = FreshSeed();
  BalancedBatchSampler a = MakeToy(400, seed, 3, 1);
  BalancedBatchSampler b = MakeToy(400, seed, 3, 1);
  const Batches first = DrainMicroBatches(a);
  EXPECT_EQ(first, DrainMicroBatches(b));
  EXPECT_EQ(a.State().plan_fingerprint, b.State().plan_fingerprint);
  // Another epoch gives another order; coming back gives the first one again.
  a.SetEpoch(1);
  const Batches second = DrainMicroBatches(a);
  EXPECT_NE(first, second);
  a.SetEpoch(0);
  EXPECT_EQ(first, DrainMicroBatches(a));
  // SetEpoch on the current epoch keeps the cursor; Reset rewinds.
  a.SetEpoch(0);
  EXPECT_EQ(a.RemainingMicroBatches(), 0);
  a.Reset();
  EXPECT_EQ(a.RemainingMicroBatches(), a.NumMicroBatches());
  // Another seed gives another plan.
  BalancedBatchSampler c = MakeToy(400, seed + 1, 3, 1);
  EXPECT_NE(first, DrainMicroBatches(c));
}

TEST(Sampler, ResumeMidEpochRepeatsAndLosesNothing) {
  const uint64_t seed = FreshSeed();
  std::mt19937_64 rng(seed);
  const int ws = 3;
  for (int trial = 0; trial < 30; ++trial) {
    const int r = static_cast<int>(rng() % ws);
    const int64_t epoch = static_cast<int64_t>(rng() % 3);
    BalancedBatchSampler full = MakeToy(250, seed, ws, r, TailPolicy::kDrop, epoch);
    const Batches expected = DrainMicroBatches(full);

    BalancedBatchSampler first = MakeToy(250, seed, ws, r, TailPolicy::kDrop, epoch);
    const int64_t k = static_cast<int64_t>(rng() % (expected.size() + 1));
    Batches got;
    for (int64_t i = 0; i < k; ++i) {
      auto mb = first.NextMicroBatch();
      got.emplace_back(mb->ids.begin(), mb->ids.end());
    }
    const SamplerState state = first.State();
    // A fresh sampler, on another epoch at first, loads the state and continues.
    BalancedBatchSampler second = MakeToy(250, seed, ws, r, TailPolicy::kDrop, epoch + 5);
    second.LoadState(state);
    EXPECT_EQ(second.epoch(), epoch);
    EXPECT_EQ(second.RemainingMicroBatches(), static_cast<int64_t>(expected.size()) - k);
    for (auto& mb : DrainMicroBatches(second)) got.push_back(std::move(mb));
    ASSERT_EQ(got, expected) << "seed " << seed << " trial " << trial << " k " << k;
  }
}

TEST(Sampler, ResumeByStepsAcrossRanks) {
  const uint64_t seed = FreshSeed();
  const int ws = 4;
  BalancedBatchSampler probe = MakeToy(333, seed, ws, 0);
  const int64_t k = probe.NumSteps() / 2;
  // Rank 0 saves after k whole steps; every rank loads that one state.
  std::vector<MicroBatchRef> step;
  for (int64_t i = 0; i < k; ++i) ASSERT_TRUE(probe.NextStep(&step));
  const SamplerState state = probe.State();
  EXPECT_EQ(state.step, k);
  EXPECT_EQ(state.micro_batch, 0);
  std::multiset<int64_t> ids;
  for (int r = 0; r < ws; ++r) {
    BalancedBatchSampler before = MakeToy(333, seed, ws, r);
    for (int64_t i = 0; i < k; ++i) {
      ASSERT_TRUE(before.NextStep(&step));
      for (const auto& mb : step) ids.insert(mb.ids.begin(), mb.ids.end());
    }
    BalancedBatchSampler after = MakeToy(333, seed, ws, r);
    after.LoadState(state);
    EXPECT_EQ(after.RemainingSteps(), after.NumSteps() - k);
    while (after.NextStep(&step)) {
      for (const auto& mb : step) ids.insert(mb.ids.begin(), mb.ids.end());
    }
  }
  EXPECT_EQ(static_cast<int64_t>(ids.size()) + probe.DroppedSamples(), 333);
  EXPECT_EQ(std::set<int64_t>(ids.begin(), ids.end()).size(), ids.size()) << "seed " << seed;
}

TEST(Sampler, StateAtStepEndIsNormalised) {
  BalancedBatchSampler s = MakeToy(100, 5, 2, 0);
  const int64_t c0 = s.MicroBatchesInCell(0, 0);
  for (int64_t i = 0; i < c0; ++i) (void)s.NextMicroBatch();
  const SamplerState st = s.State();
  EXPECT_EQ(st.step, 1);
  EXPECT_EQ(st.micro_batch, 0);
  EXPECT_EQ(s.RemainingSteps(), s.NumSteps() - 1);
}

TEST(Sampler, LoadStateRejectsForeignStates) {
  BalancedBatchSampler s = MakeToy(200, 11, 2, 0);
  SamplerState good = s.State();
  auto expect_error = [&](SamplerState st, const std::string& word) {
    try {
      s.LoadState(st);
      FAIL() << "LoadState accepted a bad " << word;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
      // A refused state is the user's input, not a bug: no source location in the message.
      EXPECT_EQ(std::string(e.what()).find("sampler.cc:"), std::string::npos) << e.what();
    }
  };
  SamplerState st = good;
  st.world_size = 3;
  expect_error(st, "world_size");
  st = good;
  st.seed = 12;
  expect_error(st, "seed");
  st = good;
  st.plan_fingerprint ^= 1;
  expect_error(st, "fingerprint");
  st = good;
  st.step = s.NumSteps() + 1;
  expect_error(st, "state.step");
  st = good;
  st.micro_batch = s.MicroBatchesInCell(0, 0) + 1;
  expect_error(st, "state.micro_batch");
  // A plan of another manifest (other n) has another fingerprint.
  BalancedBatchSampler other = MakeToy(201, 11, 2, 0);
  expect_error(other.State(), "fingerprint");
  // The end of the epoch is a valid state.
  st = good;
  st.step = s.NumSteps();
  s.LoadState(st);
  EXPECT_FALSE(s.NextMicroBatch().has_value());
}

TEST(Sampler, RangeForEqualsNext) {
  BalancedBatchSampler a = MakeToy(150, 3, 2, 1);
  BalancedBatchSampler b = MakeToy(150, 3, 2, 1);
  Batches via_range;
  for (const MicroBatchRef& mb : a.MicroBatches())
    via_range.emplace_back(mb.ids.begin(), mb.ids.end());
  EXPECT_EQ(via_range, DrainMicroBatches(b));
}

TEST(Sampler, KeepTailGivesEmptyCellsAndPadRepeats) {
  // 4 ranks, 5 micro-batches of one id each: step 0 can take all 4 ranks only if each takes 1.
  auto planner = [](int64_t epoch) -> Result<Plan> {
    Plan p;
    p.world_size = 4;
    p.epoch = epoch;
    p.ids = {0, 1, 2, 3, 4};
    for (int i = 0; i < 5; ++i) p.micro_batches.push_back({i, i + 1, 0, 1.0});
    p.work = {0, 1, 2, 3, 4};
    p.rank_offsets = {0, 1, 2, 3, 4, 5, 5, 5, 5};  // step 1: only rank 0 has work
    return p;
  };
  for (int r = 0; r < 4; ++r) {
    BalancedBatchSampler s = BalancedBatchSampler::Create(planner, r, 4).ValueOrThrow();
    EXPECT_EQ(s.NumSteps(), 2);
    EXPECT_EQ(s.NumMicroBatches(), r == 0 ? 2 : 1);
    std::vector<MicroBatchRef> step;
    ASSERT_TRUE(s.NextStep(&step));
    EXPECT_EQ(step.size(), 1u);
    ASSERT_TRUE(s.NextStep(&step));
    EXPECT_EQ(step.size(), r == 0 ? 1u : 0u);
    EXPECT_FALSE(s.NextStep(&step));
    s.Reset();
    EXPECT_EQ(static_cast<int64_t>(DrainMicroBatches(s).size()), s.NumMicroBatches());
  }
  // Pad: ranks without work in the last step repeat a micro-batch; the toy reports them.
  BalancedBatchSampler pad = MakeToy(7, 1, 8, 7, TailPolicy::kPad);
  EXPECT_GT(pad.PaddedMicroBatches(), 0);
  EXPECT_EQ(pad.NumMicroBatches(), 1);
}

TEST(Sampler, PlannerFailureIsReturned) {
  auto planner = [](int64_t) -> Result<Plan> {
    return Failure::InvalidArgument("m_mem_tokens must be > 0", "m_mem_tokens");
  };
  Result<BalancedBatchSampler> s = BalancedBatchSampler::Create(planner, 0, 2);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.failure().ToString().find("m_mem_tokens"), std::string::npos);
}

TEST(Sampler, SetEpochFailureThrows) {
  auto planner = [](int64_t epoch) -> Result<Plan> {
    if (epoch > 0) return Failure::Infeasible("no plan for later epochs");
    return ToyPlan(10, 0, 1, epoch, TailPolicy::kDrop);
  };
  BalancedBatchSampler s = BalancedBatchSampler::Create(planner, 0, 1).ValueOrThrow();
  EXPECT_THROW(s.SetEpoch(1), Error);
}

TEST(Sampler, BadRankAndMalformedPlansAreChecked) {
  EXPECT_THROW((void)BalancedBatchSampler::Create(ToyPlanner(10, 0, 2, TailPolicy::kDrop), 2, 2),
               Error);
  EXPECT_THROW((void)BalancedBatchSampler::Create(ToyPlanner(10, 0, 2, TailPolicy::kDrop), -1, 2),
               Error);
  // The planner's plan is for 2 ranks, the sampler for 3.
  EXPECT_THROW((void)BalancedBatchSampler::Create(ToyPlanner(10, 0, 2, TailPolicy::kDrop), 0, 3),
               Error);
  Plan good = ToyPlan(50, 4, 2, 0, TailPolicy::kDrop);
  EXPECT_NO_THROW(CheckPlanStructure(good, 2));
  Plan bad = good;
  bad.work[0] = static_cast<int64_t>(bad.micro_batches.size());
  EXPECT_THROW(CheckPlanStructure(bad, 2), Error);
  bad = good;
  bad.rank_offsets.pop_back();
  EXPECT_THROW(CheckPlanStructure(bad, 2), Error);
  bad = good;
  bad.micro_batches[0].end = bad.micro_batches[0].begin;
  EXPECT_THROW(CheckPlanStructure(bad, 2), Error);
  bad = good;
  bad.micro_batches.back().end = static_cast<int64_t>(bad.ids.size()) + 1;
  EXPECT_THROW(CheckPlanStructure(bad, 2), Error);
  bad = good;
  std::swap(bad.rank_offsets[1], bad.rank_offsets[2]);
  if (bad.rank_offsets[1] != bad.rank_offsets[2]) {
    EXPECT_THROW(CheckPlanStructure(bad, 2), Error);
  }
}

// The message of the Error that f throws ("" when it does not throw).
template <typename F>
std::string ErrorOf(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool Has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(SamplerState, OutOfRangeFieldsAreRefusedByName) {
  BalancedBatchSampler s = MakeToy(200, 11, 2, 0);
  const SamplerState good = s.State();
  EXPECT_EQ(good.rank, 0);
  EXPECT_EQ(good.world_size, 2);
  SamplerState st = good;
  st.epoch = -1;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }),
                  "state.epoch: -1 is out of range [0, 9223372036854775807]"));
  st = good;
  st.world_size = 0;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }), "state.world_size: 0 is out of range [1, "));
  st = good;
  st.rank = 2;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }), "state.rank: 2 is out of range [0, 1]"));
  st = good;
  st.step = -1;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }), "state.step: -1 is out of range [0, "));
  st = good;
  st.micro_batch = -3;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }), "state.micro_batch: -3 is out of range"));
}

TEST(SamplerState, MissingFingerprintIsRefused) {
  BalancedBatchSampler s = MakeToy(200, 11, 2, 0);
  SamplerState st = s.State();
  st.plan_fingerprint = 0;
  const std::string e = ErrorOf([&] { s.LoadState(st); });
  EXPECT_TRUE(Has(e, "state.plan_fingerprint: 0 is not a plan fingerprint")) << e;
}

TEST(SamplerState, AnotherRanksMidStepStateIsRefusedItsStepBoundaryStateLoads) {
  // A balanced-like toy: cells hold 1..3 micro-batches, so mid-step positions differ by rank.
  BalancedBatchSampler r0 = MakeToy(300, 4, 2, 0);
  BalancedBatchSampler r1 = MakeToy(300, 4, 2, 1);
  int64_t k = 0;
  while (r1.MicroBatchesInCell(k, 1) < 2) ++k;  // a step where rank 1 has >= 2 micro-batches
  SamplerState mid = r1.State();
  mid.step = k;
  mid.micro_batch = 1;
  r1.LoadState(mid);  // its own state loads
  const std::string e = ErrorOf([&] { r0.LoadState(mid); });
  EXPECT_TRUE(Has(e, "state.rank: the state was saved on rank 1 in the middle of step")) << e;
  EXPECT_TRUE(Has(e, "this sampler is rank 0")) << e;
  // At a step boundary a state means the same on every rank.
  SamplerState boundary = mid;
  boundary.micro_batch = 0;
  r0.LoadState(boundary);
  EXPECT_EQ(r0.State().step, k);
  EXPECT_EQ(r0.State().rank, 0);
}

TEST(SamplerState, RefusedStateLeavesTheSamplerUnchanged) {
  BalancedBatchSampler s = MakeToy(200, 11, 2, 0);
  (void)s.NextMicroBatch();
  const SamplerState before = s.State();
  BalancedBatchSampler e1 = MakeToy(200, 11, 2, 0, TailPolicy::kDrop, 1);
  SamplerState st = e1.State();  // epoch 1, but its fingerprint is broken
  st.plan_fingerprint ^= 1;
  EXPECT_TRUE(Has(ErrorOf([&] { s.LoadState(st); }), "state.plan_fingerprint"));
  EXPECT_EQ(s.epoch(), 0);
  EXPECT_EQ(s.State().plan_fingerprint, before.plan_fingerprint);
  EXPECT_EQ(s.State().step, before.step);
  EXPECT_EQ(s.State().micro_batch, before.micro_batch);
  s.LoadState(e1.State());  // the good one re-plans epoch 1
  EXPECT_EQ(s.epoch(), 1);
}

TEST(Sampler, PlanWithoutStepIsAFailureNotAnEmptyEpoch) {
  // 3 ids for 8 ranks, tail drop: every sample is dropped.
  Result<BalancedBatchSampler> s =
      BalancedBatchSampler::Create(ToyPlanner(3, 0, 8, TailPolicy::kDrop), 0, 8);
  ASSERT_FALSE(s.ok());
  const std::string m = s.failure().ToString();
  EXPECT_TRUE(Has(m, "the plan of epoch 0 has no step: 3 samples for world_size 8")) << m;
  EXPECT_TRUE(Has(m, "all 3 dropped by the tail policy")) << m;
  // Epoch 1 of a planner that empties later epochs: SetEpoch throws and keeps epoch 0.
  auto planner = [](int64_t epoch) -> Result<Plan> {
    return ToyPlan(epoch == 0 ? 50 : 1, 0, 2, epoch, TailPolicy::kDrop);
  };
  BalancedBatchSampler t = BalancedBatchSampler::Create(planner, 0, 2).ValueOrThrow();
  const int64_t steps = t.NumSteps();
  EXPECT_TRUE(Has(ErrorOf([&] { t.SetEpoch(1); }), "the plan of epoch 1 has no step"));
  EXPECT_EQ(t.epoch(), 0);
  EXPECT_EQ(t.NumSteps(), steps);
  EXPECT_TRUE(Has(ErrorOf([&] { t.SetEpoch(-1); }), "epoch: -1 is out of range"));
}

TEST(Sampler, CreateChecksRankAndWorldSizeRanges) {
  auto planner = ToyPlanner(10, 0, 2, TailPolicy::kDrop);
  EXPECT_TRUE(Has(ErrorOf([&] { (void)BalancedBatchSampler::Create(planner, 2, 2); }),
                  "rank: 2 is out of range [0, 1]"));
  EXPECT_TRUE(Has(ErrorOf([&] { (void)BalancedBatchSampler::Create(planner, 0, 0); }),
                  "world_size: 0 is out of range [1, "));
  EXPECT_TRUE(Has(ErrorOf([&] { (void)BalancedBatchSampler::Create(planner, 0, 2, -1); }),
                  "epoch: -1 is out of range"));
}

// ---- With the real pipeline: manifest text -> shapes -> MakePlan. ----

// A mixed corpus as CSV text: images and videos of several sizes, captions with commas/quotes.
std::string MixedCsv(int64_t n, std::mt19937_64& rng) {
  static const int kRes[][2] = {{256, 256}, {480, 832}, {720, 1280}, {1024, 768}, {360, 640}};
  std::ostringstream os;
  os << "path,caption,num_frames,height,width,fps\n";
  for (int64_t i = 0; i < n; ++i) {
    const auto& r = kRes[rng() % 5];
    const bool image = rng() % 3 == 0;
    const int frames = image ? 1 : 17 + static_cast<int>(rng() % 200);
    os << "clip_" << i << ".mp4,\"a \"\"quoted\"\", caption, " << i << "\"," << frames << ","
       << r[0] << "," << r[1] << "," << (image ? "" : (rng() % 2 ? "24" : "30")) << "\n";
  }
  return os.str();
}

struct Corpus {
  ShapedManifest shaped;
  CostModel cost;
  int64_t m_mem = 0;
};

Corpus MakeCorpus(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Manifest m = ParseManifest(MixedCsv(n, rng), "mixed.csv").ValueOrThrow();
  ModelPreset model = GetModelPreset("wan2.1-1.3b").ValueOrThrow();
  Corpus c;
  c.shaped = ShapeManifest(m, model);
  c.cost = AnalyticalCost(model);
  c.m_mem = 4 * c.shaped.shapes.back().seq_len;  // B > 1 even for the longest shape
  return c;
}

TEST(SamplerWithPlanner, EveryPolicyExactlyOnceSameShapeMicroBatches) {
  const uint64_t seed = FreshSeed();
  const Corpus c = MakeCorpus(2000, seed);
  std::map<int64_t, int32_t> shape_of_id;
  for (size_t i = 0; i < c.shaped.ids.size(); ++i)
    shape_of_id[c.shaped.ids[i]] = c.shaped.shape_of[i];
  for (Policy policy : {Policy::kEqualToken, Policy::kAdaptive, Policy::kBalanced}) {
    for (int ws : {1, 3, 8}) {
      PlanOptions o;
      o.policy = policy;
      o.seed = seed;
      o.epoch = 2;
      o.m_mem_tokens = c.m_mem;
      std::vector<int> seen(2000, 0);
      int64_t steps = -1, dropped = 0;
      for (int r = 0; r < ws; ++r) {
        BalancedBatchSampler s =
            BalancedBatchSampler::FromShaped(c.shaped, c.cost, o, r, ws).ValueOrThrow();
        ASSERT_EQ(s.epoch(), 2);
        if (r == 0) steps = s.NumSteps();
        ASSERT_EQ(s.NumSteps(), steps) << PolicyName(policy) << " ws " << ws;
        dropped = s.DroppedSamples();
        while (auto mb = s.NextMicroBatch()) {
          ASSERT_FALSE(mb->ids.empty());
          for (int64_t id : mb->ids) {
            ++seen[id];
            ASSERT_EQ(shape_of_id.at(id), mb->shape) << "micro-batch mixes shapes";
          }
          int64_t tokens =
              static_cast<int64_t>(mb->ids.size()) * c.shaped.shapes[mb->shape].seq_len;
          EXPECT_TRUE(tokens <= c.m_mem || mb->ids.size() == 1) << tokens << " > M_mem";
        }
      }
      int64_t total = 0;
      for (int x : seen) {
        ASSERT_LE(x, 1) << PolicyName(policy) << " ws " << ws << " seed " << seed;
        total += x;
      }
      EXPECT_EQ(total + dropped, 2000) << PolicyName(policy) << " ws " << ws << " seed " << seed;
    }
  }
}

TEST(SamplerWithPlanner, BalancedResumeEqualsUninterruptedRun) {
  const uint64_t seed = FreshSeed();
  const Corpus c = MakeCorpus(1500, seed);
  PlanOptions o;
  o.seed = seed;
  o.m_mem_tokens = c.m_mem;
  const int ws = 4;
  std::mt19937_64 rng(seed);
  for (int r = 0; r < ws; ++r) {
    BalancedBatchSampler full =
        BalancedBatchSampler::FromShaped(c.shaped, c.cost, o, r, ws).ValueOrThrow();
    full.SetEpoch(1);
    const Batches expected = DrainMicroBatches(full);
    BalancedBatchSampler a =
        BalancedBatchSampler::FromShaped(c.shaped, c.cost, o, r, ws).ValueOrThrow();
    a.SetEpoch(1);
    const int64_t k = static_cast<int64_t>(rng() % (expected.size() + 1));
    Batches got;
    for (int64_t i = 0; i < k; ++i) {
      auto mb = a.NextMicroBatch();
      got.emplace_back(mb->ids.begin(), mb->ids.end());
    }
    BalancedBatchSampler b =
        BalancedBatchSampler::FromShaped(c.shaped, c.cost, o, r, ws).ValueOrThrow();
    b.LoadState(a.State());
    for (auto& mb : DrainMicroBatches(b)) got.push_back(std::move(mb));
    EXPECT_EQ(got, expected) << "rank " << r << " k " << k << " seed " << seed;
  }
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(SamplerWithPlanner, FromConfigReadsFilesAndReportsErrorsWithLine) {
  std::mt19937_64 rng(7);
  SamplerConfig config;
  config.manifest_path = WriteTemp("sampler_good.csv", MixedCsv(300, rng));
  config.plan.seed = 3;
  BalancedBatchSampler s = BalancedBatchSampler::FromConfig(config, 1, 2).ValueOrThrow();
  ASSERT_TRUE(s.inputs().has_value());
  EXPECT_EQ(s.inputs()->rows_total, 300);
  EXPECT_EQ(s.inputs()->num_samples, 300);
  EXPECT_GT(s.inputs()->m_mem_tokens, 0);  // from the analytical memory model and 141 GiB
  EXPECT_EQ(s.inputs()->model, "wan2.1-1.3b");
  EXPECT_GT(s.NumSteps(), 0);
  BalancedBatchSampler t = BalancedBatchSampler::FromConfig(config, 0, 2).ValueOrThrow();
  EXPECT_EQ(s.State().plan_fingerprint, t.State().plan_fingerprint);  // same global plan

  // Row 3 (line 4) has a negative height.
  config.manifest_path = WriteTemp("sampler_bad.csv",
                                   "path,num_frames,height,width,fps\n"
                                   "a.mp4,49,480,832,24\n"
                                   "b.jpg,1,512,512,\n"
                                   "c.mp4,49,-480,832,24\n"
                                   "d.mp4,81,720,1280,30\n");
  Result<BalancedBatchSampler> bad = BalancedBatchSampler::FromConfig(config, 0, 1);
  ASSERT_FALSE(bad.ok());
  const std::string msg = bad.failure().ToString();
  EXPECT_NE(msg.find("sampler_bad.csv:4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("height"), std::string::npos) << msg;

  config.manifest_options.skip_bad_rows = true;
  BalancedBatchSampler skipped = BalancedBatchSampler::FromConfig(config, 0, 1).ValueOrThrow();
  EXPECT_EQ(skipped.inputs()->rows_skipped, 1);
  EXPECT_EQ(skipped.inputs()->num_samples, 3);
  std::set<int64_t> ids;
  while (auto mb = skipped.NextMicroBatch()) ids.insert(mb->ids.begin(), mb->ids.end());
  EXPECT_EQ(ids.size() + skipped.DroppedSamples(), 3u);
  EXPECT_EQ(ids.count(2), 0u);  // the bad row's id is never yielded

  config.manifest_path = ::testing::TempDir() + "no_such_manifest.csv";
  Result<BalancedBatchSampler> missing = BalancedBatchSampler::FromConfig(config, 0, 1);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.failure().ToString().find("no_such_manifest.csv"), std::string::npos);

  config.manifest_path =
      WriteTemp("sampler_ok.csv", "path,num_frames,height,width,fps\na,1,64,64,\n");
  config.model = "no-such-model";
  EXPECT_FALSE(BalancedBatchSampler::FromConfig(config, 0, 1).ok());
  config.model = "wan2.1-1.3b";
  config.gpu_mem_gib = 1.0;  // the model's weights alone do not fit
  Result<BalancedBatchSampler> tiny = BalancedBatchSampler::FromConfig(config, 0, 1);
  ASSERT_FALSE(tiny.ok());
  EXPECT_NE(tiny.failure().ToString().find("gpu_mem_gib"), std::string::npos);
}

TEST(SamplerWithPlanner, FromConfigUsesCostJsonOrFittedBench) {
  std::mt19937_64 rng(FreshSeed());
  SamplerConfig config;
  config.manifest_path = WriteTemp("sampler_cost.csv", MixedCsv(200, rng));
  // A cost JSON with a memory model: M_mem follows from it.
  CostModel cost;
  cost.a = 0.2;
  cost.b = 3e-10;
  cost.p = 1.9;
  MemoryModel mem{30e9, 2e6};
  config.cost_path = WriteTemp("sampler_cost.json", CostModelToJson(cost, &mem));
  BalancedBatchSampler s = BalancedBatchSampler::FromConfig(config, 0, 2).ValueOrThrow();
  EXPECT_EQ(s.inputs()->cost.source, "json:" + config.cost_path);
  EXPECT_DOUBLE_EQ(s.cost()->p, 1.9);
  EXPECT_EQ(s.inputs()->m_mem_tokens, mem.MaxTokens(141.0 * (1ull << 30), 0.1));
  EXPECT_EQ(s.plan().m_mem_tokens, s.inputs()->m_mem_tokens);

  // A noiseless bench of the same model: the fit recovers p and M_mem.
  std::ostringstream bench;
  bench << "batch_size,seq_len,step_time_s,peak_mem_bytes\n";
  for (int64_t b : {1, 2, 4}) {
    for (int64_t seq : {4096, 16384, 32760, 75600}) {
      bench << b << "," << seq << "," << cost.StepTime(b, seq) << ","
            << mem.m0 + mem.m1 * static_cast<double>(b * seq) << "\n";
    }
  }
  config.bench_path = WriteTemp("sampler_bench.csv", bench.str());
  EXPECT_FALSE(BalancedBatchSampler::FromConfig(config, 0, 2).ok());  // both cost and bench
  config.cost_path.clear();
  BalancedBatchSampler f = BalancedBatchSampler::FromConfig(config, 0, 2).ValueOrThrow();
  EXPECT_EQ(f.inputs()->cost.source.rfind("fit:", 0), 0u) << f.inputs()->cost.source;
  EXPECT_NEAR(f.cost()->p, 1.9, 1e-3);
  EXPECT_NEAR(static_cast<double>(f.inputs()->m_mem_tokens),
              static_cast<double>(s.inputs()->m_mem_tokens), 2.0);
  config.bench_path = WriteTemp("sampler_bench_bad.csv", "batch_size,seq_len,step_time_s\n1,x,1\n");
  Result<BalancedBatchSampler> bad = BalancedBatchSampler::FromConfig(config, 0, 2);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.failure().ToString().find("sampler_bench_bad.csv:2"), std::string::npos)
      << bad.failure().ToString();
}

TEST(SamplerWithPlanner, FromConfigRefusesOutOfRangeNumbersByName) {
  SamplerConfig config;
  config.manifest_path =
      WriteTemp("sampler_range.csv", "path,num_frames,height,width,fps\na,1,64,64,\n");
  auto error = [&](SamplerConfig c, int rank = 0, int world = 1) {
    Result<BalancedBatchSampler> r = BalancedBatchSampler::FromConfig(c, rank, world);
    return r.ok() ? std::string() : r.failure().ToString();
  };
  SamplerConfig c = config;
  c.mem_safety = -0.5;
  EXPECT_EQ(error(c), "mem_safety: -0.5 is out of range [0, 0.99]");
  c = config;
  c.gpu_mem_gib = std::numeric_limits<double>::infinity();
  EXPECT_EQ(error(c), "gpu_mem_gib: inf is out of range [0.001, 1.04858e+06]");
  c = config;
  c.plan.m_mem_tokens = -1;
  EXPECT_EQ(error(c), "m_mem_tokens: -1 is out of range [0, 1125899906842624]");
  c = config;
  c.plan.m_comp = std::nan("");
  EXPECT_EQ(error(c), "m_comp: nan is out of range [0, 1e+300]");
  c = config;
  c.plan.rank_budget_s = -1;
  EXPECT_EQ(error(c), "rank_budget_s: -1 is out of range [0, 1e+09]");
  c = config;
  c.plan.epoch = -1;
  EXPECT_EQ(error(c), "epoch: -1 is out of range [0, 9223372036854775807]");
  EXPECT_EQ(error(config, 0, 0), "world_size: 0 is out of range [1, 1048576]");
  EXPECT_EQ(error(config, 1, 1), "rank: 1 is out of range [0, 0]");
  // One sample for two ranks: the epoch would be empty (the planner's or the sampler's failure).
  const std::string empty = error(config, 0, 2);
  EXPECT_TRUE(Has(empty, "step")) << empty;
}

}  // namespace
}  // namespace ditscale::balance
