// Sequence-parallel degrees per micro-batch: the cost term, the degree list, the degree choice,
// group alignment, exactly-once, determinism and the plan without degrees.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/internal/sp_test_util.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/balance/sp_cost.h"

namespace ditscale::balance {
namespace {

CostModel QuadCost() { return internal::QuadraticTestCost(); }

// Shapes of the given lengths with the given counts; ids 0, 3, 6, ... in a shuffled shape order.
ShapedManifest Shaped(const std::vector<int64_t>& lens, const std::vector<int64_t>& counts,
                      uint64_t seed) {
  return internal::ShapedTestManifest(lens, counts, seed, 3);
}

// comm(d, S) = k * S * (d - 1) / d per sample (a stand-in table; the CLI simulates it).
std::vector<double> CommTable(const ShapedManifest& m, double k) {
  std::vector<double> t(m.shapes.size() * kSpDegreeSlots, 0.0);
  for (size_t s = 0; s < m.shapes.size(); ++s) {
    for (int slot = 1; slot < kSpDegreeSlots; ++slot) {
      const double d = 1 << slot;
      t[s * kSpDegreeSlots + slot] = k * static_cast<double>(m.shapes[s].seq_len) * (d - 1) / d;
    }
  }
  return t;
}

PlanOptions SpOptions(const ShapedManifest& m, int w, std::vector<int> degrees, double k = 1e-7) {
  PlanOptions o;
  o.world_size = w;
  o.m_mem_tokens = 20000;
  o.sp_degrees = std::move(degrees);
  o.sp_comm_per_sample_s = CommTable(m, k);
  o.tail = TailPolicy::kKeep;
  return o;
}

// Checks groups, order and memory of every step; returns id -> times trained.
std::map<int64_t, int> CheckSpPlan(const ShapedManifest& m, const Plan& plan,
                                   const PlanOptions& o) {
  const int64_t w = o.world_size;
  std::map<int64_t, int> times;
  for (int64_t k = 0; k < plan.num_steps(); ++k) {
    std::map<int64_t, std::set<int64_t>> ranks_of;  // micro-batch -> ranks listing it
    for (int64_t r = 0; r < w; ++r) {
      int prev_d = 1 << 30;
      int64_t prev = -1;
      for (int64_t i = plan.rank_offsets[k * w + r]; i < plan.rank_offsets[k * w + r + 1]; ++i) {
        const int64_t mb_idx = plan.work[i];
        const MicroBatch& mb = plan.micro_batches[mb_idx];
        EXPECT_TRUE(mb.sp_degree < prev_d || (mb.sp_degree == prev_d && mb_idx > prev));
        prev_d = mb.sp_degree, prev = mb_idx;
        ranks_of[mb_idx].insert(r);
        const int64_t len = m.shapes[mb.shape].seq_len;
        EXPECT_LE((mb.end - mb.begin) * len, mb.sp_degree * o.m_mem_tokens);
      }
    }
    for (const auto& [mb_idx, ranks] : ranks_of) {
      const MicroBatch& mb = plan.micro_batches[mb_idx];
      const int64_t d = mb.sp_degree;
      EXPECT_EQ(static_cast<int64_t>(ranks.size()), d) << "micro-batch " << mb_idx;
      EXPECT_EQ(*ranks.begin() % d, 0) << "group not aligned";
      EXPECT_EQ(*ranks.rbegin(), *ranks.begin() + d - 1);
      EXPECT_GE(d, plan.sp_min_degree_of_shape[mb.shape]);
      for (int64_t j = mb.begin; j < mb.end; ++j) ++times[plan.ids[j]];
    }
  }
  return times;
}

TEST(SpCost, MicroBatchTermAndEfficiency) {
  CostModel c = QuadCost();
  c.sp_efficiency = {1, 0.9, 0.8, 0.5};
  const double work = c.Work(30000);
  EXPECT_DOUBLE_EQ(c.SpMicroBatchTime(3, 30000, 1, 0), c.MicroBatchTime(3, 30000));
  EXPECT_DOUBLE_EQ(c.SpMicroBatchTime(3, 30000, 4, 0.25), c.a_mb + 3 * work / (4 * 0.8) + 0.75);
  MemoryModel mem{1e9, 100};
  const CostModel back = *ParseCostModel(CostModelToJson(c, &mem), "x.json");
  EXPECT_EQ(back.sp_efficiency, c.sp_efficiency);
  EXPECT_EQ(CostModelToJson(QuadCost()).find("sp_efficiency"), std::string::npos);
  auto bad = ParseCostModel(R"({"kind": "power", "a": 0, "b": 1, "p": 2,
                                "sp_efficiency": {"4": 1.5}})",
                            "c.json");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.failure().ToString().find("sp_efficiency.4: 1.5 is out of range"),
            std::string::npos);
  EXPECT_FALSE(ParseCostModel(R"({"kind": "power", "a": 0, "b": 1, "p": 2,
                                  "sp_efficiency": {"3": 0.5}})",
                              "c.json")
                   .ok());
}

TEST(SpCost, DegreeListRanges) {
  EXPECT_EQ(*ParseSpDegrees("8,1,2,4", 16), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(*ParseSpDegrees("1", 1), (std::vector<int>{1}));
  for (const char* bad : {"3", "16", "0", "-2", "1,1", "", "1,", "a", "2x"}) {
    EXPECT_FALSE(ParseSpDegrees(bad, 16).ok()) << bad;
  }
  auto over = ParseSpDegrees("1,4", 2);
  ASSERT_FALSE(over.ok());
  EXPECT_NE(over.failure().ToString().find("--sp-degrees: 4 must be at most the world size 2"),
            std::string::npos);
  EXPECT_TRUE(ParseSpDegrees("4", 12).ok());
  EXPECT_FALSE(ParseSpDegrees("8", 12).ok());  // 12 % 8 != 0
  EXPECT_EQ(MinSpDegree(30000, 10000, {1, 2, 4, 8}), 4);
  EXPECT_EQ(MinSpDegree(90000, 10000, {1, 2, 4, 8}), 0);
}

TEST(SpCost, UlyssesCommFromTheSpSimulator) {
  const ModelPreset wan = *GetModelPreset("wan2.1-14b");
  const std::vector<TrainShape> shapes = {
      {1, 16, 16, 3600}, {1, 16, 16, 75600}, {1, 32, 32, 75600}};
  const std::vector<double> t = *UlyssesCommPerSample(wan, shapes, {1, 2, 8}, kDefaultSpTopology);
  ASSERT_EQ(t.size(), shapes.size() * kSpDegreeSlots);
  auto at = [&](size_t s, int d) { return t[s * kSpDegreeSlots + SpSlot(d)]; };
  for (size_t s = 0; s < shapes.size(); ++s) {
    EXPECT_EQ(at(s, 1), 0);
    EXPECT_EQ(at(s, 4), 0);  // not asked for
  }
  for (int d : {2, 8}) {
    EXPECT_GT(at(0, d), 0);
    EXPECT_GT(at(1, d), 3 * at(0, d));  // 21x the tokens (a small sample is latency-bound)
    EXPECT_EQ(at(1, d), at(2, d));      // the same S: one simulation
  }
  // 75,600 tokens on 8 NVLink4 ranks, 40 layers x 3: the all-to-alls move 4 x S x 5120 x 2 B
  // x 7/8 / 8 per rank and layer pass (~340 MB at 360 GB/s, ~1 ms): ~0.1 s, a few % of the
  // sample's ~6 s of compute per rank.
  EXPECT_GT(at(1, 8), 0.05);
  EXPECT_LT(at(1, 8), 0.5);
  EXPECT_FALSE(UlyssesCommPerSample(wan, shapes, {1, 2}, "no-such-topology").ok());
}

TEST(SpPlan, OptionsAreChecked) {
  const ShapedManifest m = Shaped({1000, 5000}, {50, 50}, 1);
  PlanOptions o = SpOptions(m, 4, {1, 8});
  EXPECT_FALSE(MakePlan(m, QuadCost(), o).ok());  // 8 > world size
  o = SpOptions(m, 4, {2, 1});
  EXPECT_FALSE(MakePlan(m, QuadCost(), o).ok());  // not ascending
  o = SpOptions(m, 4, {1, 2});
  o.sp_comm_per_sample_s.pop_back();
  EXPECT_FALSE(MakePlan(m, QuadCost(), o).ok());
  o = SpOptions(m, 4, {1, 2});
  o.policy = Policy::kAdaptive;
  EXPECT_FALSE(MakePlan(m, QuadCost(), o).ok());
}

TEST(SpPlan, ExactlyOnceGroupsAndDeterminism) {
  const ShapedManifest m =
      Shaped({256, 4096, 15000, 30000, 70000, 200000}, {400, 200, 60, 30, 12, 5}, 7);
  for (int w : {1, 2, 8, 16}) {
    for (std::vector<int> deg : {std::vector<int>{1}, {1, 2}, {1, 2, 4, 8}, {4}, {2, 8}}) {
      if (deg.back() > w) continue;
      const PlanOptions o = SpOptions(m, w, deg);
      const Plan a = *MakePlan(m, QuadCost(), o);
      const std::map<int64_t, int> times = CheckSpPlan(m, a, o);
      int64_t unfit = 0, trained = 0;
      for (size_t i = 0; i < m.shape_of.size(); ++i) {
        const bool fits = MinSpDegree(m.shapes[m.shape_of[i]].seq_len, o.m_mem_tokens, deg) > 0;
        auto it = times.find(m.ids[i]);
        if (fits) {
          ASSERT_NE(it, times.end()) << "sample " << m.ids[i] << " w=" << w;
          EXPECT_EQ(it->second, 1);
          ++trained;
        } else {
          EXPECT_EQ(it, times.end());
          ++unfit;
        }
      }
      EXPECT_EQ(a.samples_unfit, unfit);
      EXPECT_EQ(a.dropped_samples, unfit);  // tail 'keep'
      const Plan b = *MakePlan(m, QuadCost(), o);
      EXPECT_EQ(a.work, b.work);
      EXPECT_EQ(a.rank_offsets, b.rank_offsets);
      EXPECT_EQ(a.ids, b.ids);
      ASSERT_EQ(a.micro_batches.size(), b.micro_batches.size());
      for (size_t i = 0; i < a.micro_batches.size(); ++i) {
        EXPECT_EQ(a.micro_batches[i].begin, b.micro_batches[i].begin);
        EXPECT_EQ(a.micro_batches[i].sp_degree, b.micro_batches[i].sp_degree);
      }
      const SimResult s = Simulate(a, m, QuadCost());
      EXPECT_EQ(s.samples, trained);
      int64_t tokens = 0;
      for (int64_t t : s.sp_tokens) tokens += t;
      EXPECT_EQ(tokens, s.tokens);
    }
  }
}

TEST(SpPlan, DropTailCountsEachSampleOnce) {
  const ShapedManifest m = Shaped({1000, 30000, 70000}, {37, 11, 5}, 3);
  PlanOptions o = SpOptions(m, 8, {1, 2, 4, 8});
  o.tail = TailPolicy::kDrop;
  const Plan p = *MakePlan(m, QuadCost(), o);
  const std::map<int64_t, int> times = CheckSpPlan(m, p, o);
  int64_t trained = 0;
  for (const auto& [id, n] : times) trained += n;
  EXPECT_EQ(trained + p.dropped_samples, static_cast<int64_t>(m.shape_of.size()));
}

// One sample and two ranks: degree 2 halves the step when communication is cheap, and is not
// taken when it costs more than it saves.
TEST(SpPlan, LargerDegreeWhereItLowersTheSlowestRank) {
  const ShapedManifest m = Shaped({16000}, {1}, 1);
  PlanOptions o = SpOptions(m, 2, {1, 2}, 1e-7);
  Plan p = *MakePlan(m, QuadCost(), o);
  ASSERT_EQ(p.micro_batches.size(), 1u);
  EXPECT_EQ(p.micro_batches[0].sp_degree, 2);
  SimResult s = Simulate(p, m, QuadCost());
  const double w = QuadCost().Work(16000);
  EXPECT_NEAR(s.epoch_time_s, 0.05 + 0.01 + w / 2 + 16000 * 1e-7 / 2, 1e-9);
  EXPECT_GT(s.comm_fraction, 0);
  EXPECT_EQ(s.sp_micro_batches[1], 1);
  o = SpOptions(m, 2, {1, 2}, 1e-4);  // comm 0.8 s > Work / 2
  p = *MakePlan(m, QuadCost(), o);
  EXPECT_EQ(p.micro_batches[0].sp_degree, 1);
}

TEST(SpPlan, LongSamplesGetTheirSmallestFittingDegree) {
  const ShapedManifest m = Shaped({500, 50000}, {200, 8}, 5);
  const PlanOptions o = SpOptions(m, 8, {1, 2, 4, 8}, 1e-3);  // comm too dear to raise
  const Plan p = *MakePlan(m, QuadCost(), o);
  EXPECT_EQ(p.sp_min_degree_of_shape, (std::vector<int>{1, 4}));
  for (const MicroBatch& mb : p.micro_batches) {
    EXPECT_EQ(mb.sp_degree, m.shapes[mb.shape].seq_len > o.m_mem_tokens ? 4 : 1);
  }
}

TEST(SpPlan, WithoutDegreesEveryMicroBatchIsOnOneRank) {
  const ShapedManifest m = Shaped({1000, 30000}, {100, 10}, 9);
  PlanOptions o;
  o.world_size = 4;
  o.m_mem_tokens = 20000;
  const Plan p = *MakePlan(m, QuadCost(), o);
  EXPECT_TRUE(p.sp_degrees.empty());
  EXPECT_EQ(p.samples_over_m_mem, 10);  // run alone at B = 1, not dropped
  EXPECT_EQ(p.samples_unfit, 0);
  for (const MicroBatch& mb : p.micro_batches) EXPECT_EQ(mb.sp_degree, 1);
  const SimResult s = Simulate(p, m, QuadCost());
  EXPECT_EQ(s.comm_s, 0);
}

// {1}: the plan without degrees when no sample is over M_mem; those over it are dropped.
TEST(SpPlan, DegreeOneIsThePlanWithoutDegrees) {
  for (int64_t m_mem : {int64_t{40000}, int64_t{20000}}) {
    const ShapedManifest m = Shaped({1000, 4096, 15000, 30000}, {300, 100, 40, 10}, 11);
    PlanOptions o = SpOptions(m, 4, {1});
    o.m_mem_tokens = m_mem;
    o.tail = TailPolicy::kDrop;
    PlanOptions plain = o;
    plain.sp_degrees.clear();
    const Plan a = *MakePlan(m, QuadCost(), o);
    const Plan b = *MakePlan(m, QuadCost(), plain);
    if (m_mem == 40000) {
      EXPECT_EQ(a.work, b.work);
      EXPECT_EQ(a.rank_offsets, b.rank_offsets);
      EXPECT_EQ(a.rank_budget_s, b.rank_budget_s);
      ASSERT_EQ(a.micro_batches.size(), b.micro_batches.size());
      for (size_t i = 0; i < a.micro_batches.size(); ++i) {
        EXPECT_EQ(a.micro_batches[i].begin, b.micro_batches[i].begin);
        EXPECT_EQ(a.micro_batches[i].end, b.micro_batches[i].end);
        EXPECT_EQ(a.micro_batches[i].predicted_cost_s, b.micro_batches[i].predicted_cost_s);
      }
      EXPECT_EQ(a.samples_unfit, 0);
    } else {
      EXPECT_EQ(a.samples_unfit, 10);
      EXPECT_EQ(b.samples_unfit, 0);
      EXPECT_EQ(b.samples_over_m_mem, 10);  // run alone at B = 1
      for (const MicroBatch& mb : a.micro_batches) EXPECT_LE(m.shapes[mb.shape].seq_len, m_mem);
      CheckSpPlan(m, a, o);
    }
  }
}

}  // namespace
}  // namespace ditscale::balance
