// Simulator of a plan: predicted per-step, per-rank compute and the load-balance metrics.
//
// Cost of rank r in step k (its micro-batches i = 1..n, n >= 1, each of B_i samples of S_i tokens):
//   cost = a + sum_i (a_mb + B_i * Work(S_i))        (cost_model.h)
// a (optimizer step, gradient all-reduce tail) is paid once per step and rank; a_mb by every
// forward/backward pass (gradient accumulation repeats it). SimOptions::overhead_per_micro_batch
// simulates OverheadPerMicroBatch(cost) instead (a_mb := a + a_mb, a := 0; conservative).
// The cost is 0 when the rank has no micro-batch. With noise sigma > 0 every micro-batch's term
// (a_mb + B_i * Work(S_i)) is multiplied by exp(sigma * z - sigma^2 / 2), z ~ N(0, 1)
// (mean-preserving lognormal), drawn from splitmix64 seeded by (noise_seed, plan epoch,
// micro-batch position), so a simulation is reproducible. sigma is at most kMaxNoiseSigma.
//
// Metrics (W ranks, K steps, c[k][r] the cost above):
//   step_time[k]        = max_r c[k][r]            (synchronous data parallelism)
//   epoch_time_s        = sum_k step_time[k]
//   lower_bound_s       = sum_{k,r} c[k][r] / W    (perfect balance of the same work)
//   compute_cv          = mean over steps of std_r(c[k][r]) / mean_r(c[k][r])  (population std)
//   step_time_cv        = std_k(step_time) / mean_k(step_time)
//   bubble_fraction     = sum_k (W * step_time[k] - sum_r c[k][r]) / (W * epoch_time_s)
//   tokens_per_s_per_gpu = tokens trained (padded repeats excluded) / epoch_time_s / W
// Sequence parallelism (Plan::sp_degrees, sp_cost.h): a micro-batch of degree d is in the list of
// each of its d ranks, each paying a_mb + B_i * (Work(S_i) / (d eff(d)) + comm(d, S_i)); it is
// counted once in tokens and samples. Ranks of a group reach it together (planner.h: lists
// ordered by degree), so the sum per rank is the rank's time.
//   comm_fraction       = sum_{k,r} B_i * comm(d, S_i) over executions / (W * epoch_time_s)
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/shapes.h"

namespace ditscale::balance {

// Largest noise sigma. The lognormal's mean is carried by ever rarer, larger draws as sigma
// grows: the sum of N terms is near its expectation only while N >> exp(sigma^2). At sigma = 10
// (exp(100) draws) every term of an epoch is ~exp(-50) of its cost, so a simulation reports the
// fixed overheads alone (CV 0, an epoch far below the noise-free one). At 1, a few dozen
// micro-batches give the mean, and one sigma is already a factor e of step-time jitter.
inline constexpr double kMaxNoiseSigma = 1.0;

struct SimOptions {
  bool overhead_per_micro_batch = false;  // see above; match PlanOptions of the plan (old flag)
  double noise_sigma = 0;  // lognormal sigma of per-micro-batch noise in [0, kMaxNoiseSigma]
  uint64_t noise_seed = 0;
  bool keep_rank_costs = true;  // fill SimResult::rank_cost_s (steps x ranks)
};

struct SimResult {
  int64_t num_steps = 0;
  int world_size = 0;
  std::vector<double> rank_cost_s;  // [step * world_size + rank], when keep_rank_costs
  std::vector<double> step_time_s;  // per step
  double epoch_time_s = 0;
  double lower_bound_s = 0;
  double compute_cv = 0;
  double step_time_cv = 0;
  double bubble_fraction = 0;
  double tokens_per_s_per_gpu = 0;
  int64_t tokens = 0;                // tokens trained (padded repeats excluded)
  int64_t samples = 0;               // samples trained (padded repeats excluded)
  int64_t micro_batches = 0;         // micro-batch executions, padded ones included
  int64_t dropped_samples = 0;       // copied from the plan
  int64_t padded_micro_batches = 0;  // copied from the plan
  double mean_samples_per_step = 0;  // the global batch in samples
  double comm_s = 0;                 // rank-seconds of sequence-parallel communication
  double comm_fraction = 0;          // comm_s / (W * epoch_time_s)
  // Per degree 1, 2, 4, 8 ([log2 d]): distinct micro-batches and their tokens (padded excluded).
  std::array<int64_t, 4> sp_micro_batches{};
  std::array<int64_t, 4> sp_tokens{};
};

// Simulates `plan` (made from `shaped`) under `cost`. Throws ditscale::Error when the plan does
// not belong to `shaped` (a micro-batch shape index out of range).
SimResult Simulate(const Plan& plan, const ShapedManifest& shaped, const CostModel& cost,
                   const SimOptions& options = {});

}  // namespace ditscale::balance
