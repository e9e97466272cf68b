#include "ditscale/balance/simulate.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

namespace ditscale::balance {
namespace {

// Two shapes (S = 100, 200) under t = 1 + 0.01 * B * S: Work(100) = 1 s, Work(200) = 2 s.
struct Fixture {
  ShapedManifest shaped;
  CostModel cost;
  Plan plan;
  Fixture() {
    shaped.shapes = {TrainShape{1, 16, 16, 100}, TrainShape{1, 16, 32, 200}};
    cost.kind = CostModel::Kind::kPower;
    cost.a = 1, cost.b = 0.01, cost.p = 1;
    plan.world_size = 2;
    plan.ids = {0, 1, 2, 3, 4, 5, 6};
    // mb0: shape0 x2, mb1: shape1 x1, mb2: shape0 x1, mb3: shape1 x2.
    plan.micro_batches = {{0, 2, 0, 3}, {2, 3, 1, 3}, {3, 4, 0, 2}, {4, 6, 1, 5}};
    // step 0: rank 0 {mb0}, rank 1 {mb1, mb2}; step 1: rank 0 {mb3}, rank 1 {}.
    plan.work = {0, 1, 2, 3};
    plan.rank_offsets = {0, 1, 3, 4, 4};
  }
};

TEST(Simulate, HandComputedMetricsOverheadOncePerStep) {
  Fixture f;
  SimResult r = Simulate(f.plan, f.shaped, f.cost);
  ASSERT_EQ(r.num_steps, 2);
  EXPECT_EQ(r.rank_cost_s, (std::vector<double>{3, 4, 5, 0}));
  EXPECT_DOUBLE_EQ(r.epoch_time_s, 9);
  EXPECT_DOUBLE_EQ(r.lower_bound_s, 6);
  EXPECT_DOUBLE_EQ(r.bubble_fraction, 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(r.compute_cv, (1.0 / 7.0 + 1.0) / 2);
  EXPECT_EQ(r.tokens, 900);
  EXPECT_EQ(r.samples, 6);
  EXPECT_EQ(r.micro_batches, 4);
  EXPECT_DOUBLE_EQ(r.tokens_per_s_per_gpu, 50);
  EXPECT_DOUBLE_EQ(r.step_time_cv, 0.5 / 4.5);
  EXPECT_DOUBLE_EQ(r.mean_samples_per_step, 3);
}

TEST(Simulate, OverheadPerMicroBatchAndPaddedRepeats) {
  Fixture f;
  SimOptions o;
  o.overhead_per_micro_batch = true;
  SimResult r = Simulate(f.plan, f.shaped, f.cost, o);
  EXPECT_EQ(r.rank_cost_s, (std::vector<double>{3, 5, 5, 0}));
  EXPECT_DOUBLE_EQ(r.epoch_time_s, 10);
  EXPECT_DOUBLE_EQ(r.lower_bound_s, 6.5);
  // Rank 1 of step 1 repeats mb2 (a pad): it costs time but trains no new tokens.
  f.plan.work.push_back(2);
  f.plan.rank_offsets.back() = 5;
  f.plan.padded_micro_batches = 1;
  SimResult p = Simulate(f.plan, f.shaped, f.cost);
  EXPECT_EQ(p.rank_cost_s, (std::vector<double>{3, 4, 5, 2}));
  EXPECT_EQ(p.tokens, 900);
  EXPECT_EQ(p.micro_batches, 5);
  EXPECT_EQ(p.padded_micro_batches, 1);
  EXPECT_DOUBLE_EQ(p.tokens_per_s_per_gpu, 50);
}

TEST(Simulate, NoiseIsSeededAndMeanPreserving) {
  // A perfectly balanced plan: 4000 steps x 4 ranks, one identical micro-batch each.
  ShapedManifest shaped;
  shaped.shapes = {TrainShape{1, 16, 16, 100}};
  CostModel cost;
  cost.kind = CostModel::Kind::kPower;
  cost.a = 0, cost.b = 0.01, cost.p = 1;
  Plan plan;
  plan.world_size = 4;
  const int64_t n = 16000;
  plan.rank_offsets.push_back(0);
  for (int64_t i = 0; i < n; ++i) {
    plan.ids.push_back(i);
    plan.micro_batches.push_back({i, i + 1, 0, 1});
    plan.work.push_back(i);
    plan.rank_offsets.push_back(i + 1);
  }
  SimResult clean = Simulate(plan, shaped, cost);
  EXPECT_DOUBLE_EQ(clean.compute_cv, 0);
  EXPECT_DOUBLE_EQ(clean.bubble_fraction, 0);
  SimOptions o;
  o.noise_sigma = 0.1;
  o.noise_seed = std::random_device{}();
  SimResult a = Simulate(plan, shaped, cost, o);
  SimResult b = Simulate(plan, shaped, cost, o);
  EXPECT_EQ(a.rank_cost_s, b.rank_cost_s);
  // Mean of the lognormal factor is 1: total work within ~4 standard errors (0.1 / sqrt(n)).
  EXPECT_NEAR(a.lower_bound_s / clean.lower_bound_s, 1.0, 4 * 0.1 / std::sqrt(n));
  // CV of 4 draws of a lognormal(0.1): E[std/mean] ~ 0.1 * sqrt(3/4) * c4 ~ 0.08.
  EXPECT_GT(a.compute_cv, 0.06);
  EXPECT_LT(a.compute_cv, 0.10);
  EXPECT_GT(a.bubble_fraction, 0);
  o.noise_seed ^= 1;
  EXPECT_NE(Simulate(plan, shaped, cost, o).rank_cost_s, a.rank_cost_s);
}

// At the largest sigma the epoch still shows the noise's mean (the sum of 16000 factors within
// 5 standard errors, sqrt(e^{sigma^2} - 1) / sqrt(n) each), the epoch is at least its lower bound
// and the ranks differ; above it the simulation is refused (a sigma of 10 used to report CV 0
// and an epoch of the fixed overheads alone: simulate.h).
TEST(Simulate, LargestNoiseKeepsTheMean) {
  ShapedManifest shaped;
  shaped.shapes = {TrainShape{1, 16, 16, 100}};
  CostModel cost;
  cost.kind = CostModel::Kind::kPower;
  cost.a = 0.05, cost.b = 0.01, cost.p = 1;
  Plan plan;
  plan.world_size = 4;
  const int64_t n = 16000;
  plan.rank_offsets.push_back(0);
  for (int64_t i = 0; i < n; ++i) {
    plan.ids.push_back(i);
    plan.micro_batches.push_back({i, i + 1, 0, 1});
    plan.work.push_back(i);
    plan.rank_offsets.push_back(i + 1);
  }
  const SimResult clean = Simulate(plan, shaped, cost);
  SimOptions o;
  o.noise_sigma = kMaxNoiseSigma;
  o.noise_seed = std::random_device{}();
  const SimResult a = Simulate(plan, shaped, cost, o);
  const double se = std::sqrt(std::expm1(kMaxNoiseSigma * kMaxNoiseSigma) / n);
  const double work = 1.0;  // b * S = 0.01 * 100 per micro-batch, beside a = 0.05 per rank
  const double fixed = cost.a / (cost.a + work);
  EXPECT_NEAR((a.lower_bound_s / clean.lower_bound_s - fixed) / (1 - fixed), 1.0, 5 * se);
  EXPECT_GE(a.epoch_time_s, a.lower_bound_s);
  EXPECT_GT(a.compute_cv, 0.3);
  o.noise_sigma = std::nextafter(kMaxNoiseSigma, 2.0);
  EXPECT_THROW(Simulate(plan, shaped, cost, o), Error);
  o.noise_sigma = 10;
  EXPECT_THROW(Simulate(plan, shaped, cost, o), Error);
}

TEST(Simulate, RejectsAPlanOfAnotherManifest) {
  Fixture f;
  f.plan.micro_batches[3].shape = 7;
  EXPECT_THROW(Simulate(f.plan, f.shaped, f.cost), Error);
}

}  // namespace
}  // namespace ditscale::balance
