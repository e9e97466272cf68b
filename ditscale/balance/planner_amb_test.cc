// The per-micro-batch overhead a_mb (cost_model.h) in the planner and the simulator: a rank's step
// costs a + sum_i (a_mb + B_i * Work(S_i)). On the bundled manifest the balanced policy planned
// with a_mb > 0 makes fewer micro-batches per step than when planned blind to it, and is not
// slower when both plans are simulated under the a_mb model. The old overhead_per_micro_batch
// flag is the cost model with a_mb := a + a_mb, a := 0.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"

namespace ditscale::balance {
namespace {

double MicroBatchesPerStep(const SimResult& s) {
  return s.num_steps > 0 ? static_cast<double>(s.micro_batches) / s.num_steps : 0;
}
// Passes per trained sample: the step size differs between the plans (the default budget
// includes a_mb), so the count per sample is the like-for-like measure of micro-batch size.
double MicroBatchesPerSample(const SimResult& s) {
  return s.samples > 0 ? static_cast<double>(s.micro_batches) / s.samples : 0;
}

TEST(CostModelAmb, StepTimesAndOverheadPerMicroBatch) {
  CostModel c;
  c.kind = CostModel::Kind::kPower;
  c.a = 0.2, c.a_mb = 0.05, c.b = 1e-3, c.p = 1;
  EXPECT_DOUBLE_EQ(c.MicroBatchTime(4, 100), 0.05 + 0.4);
  EXPECT_DOUBLE_EQ(c.StepTime(4, 100), 0.2 + 0.05 + 0.4);
  EXPECT_DOUBLE_EQ(c.AccumStepTime(3, 4, 100), 0.2 + 3 * (0.05 + 0.4));
  const CostModel m = OverheadPerMicroBatch(c);
  EXPECT_EQ(m.a, 0);
  EXPECT_DOUBLE_EQ(m.a_mb, 0.25);
  EXPECT_DOUBLE_EQ(m.StepTime(4, 100), c.StepTime(4, 100));  // one pass: the same time
  EXPECT_DOUBLE_EQ(OverheadPerMicroBatch(m).a_mb, m.a_mb);   // idempotent
}

class BundledManifest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* root = std::getenv("DITSCALE_SOURCE_DIR");
    if (root == nullptr) GTEST_SKIP() << "DITSCALE_SOURCE_DIR not set";
    auto m = ReadManifest(std::string(root) + "/examples/manifests/mixed_2k.csv");
    ASSERT_TRUE(m.ok()) << m.failure().ToString();
    model_ = GetModelPreset("wan2.1-1.3b").value();
    shaped_ = ShapeManifest(*m, model_);
  }
  ModelPreset model_;
  ShapedManifest shaped_;
};

TEST_F(BundledManifest, BalancedPaysAmbWithFewerMicroBatchesAndIsNotSlower) {
  // The analytical H200 cost with a = 0.05 s per step; a_mb as a fraction of a typical
  // micro-batch's work (on 2 H200s balanced paid ~9% per token for its 1.8 passes per step).
  const CostModel blind = AnalyticalCost(model_);
  for (int world : {2, 8}) {
    PlanOptions o;
    o.policy = Policy::kBalanced;
    o.world_size = world;
    o.m_mem_tokens = 302400;
    o.seed = 3;
    const Plan p0 = MakePlan(shaped_, blind, o).value();
    for (double frac : {0.05, 0.1}) {
      // a_mb as a fraction of the per-rank budget of a step (about one full micro-batch).
      const double a_mb = frac * p0.rank_budget_s;
      SCOPED_TRACE("world " + std::to_string(world) + " a_mb " + std::to_string(a_mb));
      CostModel aware = blind;
      aware.a_mb = a_mb;
      const Plan p1 = MakePlan(shaped_, aware, o).value();
      // Both simulated under the a_mb model: what the GPUs would do.
      const SimResult s0 = Simulate(p0, shaped_, aware);
      const SimResult s1 = Simulate(p1, shaped_, aware);
      std::printf(
          "world %d a_mb %.3f: blind %.3f mb/step %.4f mb/sample %.1f tok/s/GPU %.1f s | aware "
          "%.3f mb/step %.4f mb/sample %.1f tok/s/GPU %.1f s cv %.4f\n",
          world, a_mb, MicroBatchesPerStep(s0), MicroBatchesPerSample(s0), s0.tokens_per_s_per_gpu,
          s0.epoch_time_s, MicroBatchesPerStep(s1), MicroBatchesPerSample(s1),
          s1.tokens_per_s_per_gpu, s1.epoch_time_s, s1.compute_cv);
      EXPECT_LT(MicroBatchesPerSample(s1), MicroBatchesPerSample(s0));
      EXPECT_GE(s1.tokens_per_s_per_gpu, s0.tokens_per_s_per_gpu * (1 - 1e-9));
      // The plan's own prediction of a step includes a_mb per pass: ranks stay balanced.
      EXPECT_LE(s1.compute_cv, 0.05);
    }
  }
}

TEST_F(BundledManifest, OldOverheadFlagIsAmbEqualsA) {
  const CostModel cost = AnalyticalCost(model_);
  PlanOptions o;
  o.world_size = 8;
  o.m_mem_tokens = 302400;
  o.seed = 1;
  for (Policy pol : {Policy::kAdaptive, Policy::kBalanced}) {
    o.policy = pol;
    o.overhead_per_micro_batch = true;
    const Plan flag = MakePlan(shaped_, cost, o).value();
    o.overhead_per_micro_batch = false;
    const CostModel mapped = OverheadPerMicroBatch(cost);
    EXPECT_EQ(mapped.a, 0);
    EXPECT_EQ(mapped.a_mb, cost.a);
    const Plan amb = MakePlan(shaped_, mapped, o).value();
    EXPECT_EQ(flag.work, amb.work);
    EXPECT_EQ(flag.rank_offsets, amb.rank_offsets);
    EXPECT_EQ(flag.ids, amb.ids);
    EXPECT_EQ(flag.rank_budget_s, amb.rank_budget_s);
    SimOptions so;
    so.overhead_per_micro_batch = true;
    const SimResult a = Simulate(flag, shaped_, cost, so);
    const SimResult b = Simulate(amb, shaped_, mapped);
    EXPECT_EQ(a.rank_cost_s, b.rank_cost_s);
    EXPECT_EQ(a.epoch_time_s, b.epoch_time_s);
  }
}

TEST_F(BundledManifest, AmbZeroKeepsThePlan) {
  // a_mb = 0 explicitly is the model before a_mb existed: the simulated time of every step is
  // a + sum B * Work(S), and a cost file's a_mb round-trips.
  CostModel cost = AnalyticalCost(model_);
  PlanOptions o;
  o.world_size = 8;
  o.m_mem_tokens = 302400;
  const Plan p = MakePlan(shaped_, cost, o).value();
  const SimResult s = Simulate(p, shaped_, cost);
  for (int64_t k = 0; k < s.num_steps; ++k) {
    for (int r = 0; r < 8; ++r) {
      double want = 0;
      for (int64_t i = p.rank_offsets[k * 8 + r]; i < p.rank_offsets[k * 8 + r + 1]; ++i) {
        const MicroBatch& mb = p.micro_batches[p.work[i]];
        want += (mb.end - mb.begin) * cost.Work(shaped_.shapes[mb.shape].seq_len);
      }
      if (want > 0) want += cost.a;
      EXPECT_NEAR(s.rank_cost_s[k * 8 + r], want, 1e-12 * want);
    }
  }
}

}  // namespace
}  // namespace ditscale::balance
