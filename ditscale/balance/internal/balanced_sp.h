// The balanced policy's steps with a sequence-parallel degree per micro-batch (PlanOptions::
// sp_degrees; costs: sp_cost.h; docs/balance.md, "Sequence parallelism per micro-batch"). Each
// step:
//  1. cuts the next world_size * (budget - a) rank-seconds of work (every chunk at its smallest
//     fitting degree d_min, costing d * its per-rank cost) from the shuffled chunk stream,
//     splitting the chunk that crosses the cut;
//  2. assigns it by LPT to aligned groups (ranks g*d .. g*d+d-1): largest degree first, then
//     the most expensive per rank, each to the group whose busiest rank is least loaded (ties
//     rotate with the step), split where it would lift the group above the step's mean load;
//  3. raises the degree (to the next allowed one) of a micro-batch on the slowest rank while that
//     lowers the step's slowest rank (re-assigning the step each time; at most kMaxRaiseTrials
//     trials per step);
//  4. tops every group below the step's level up from a lookahead window: each chunk at its
//     d_min, or at a larger degree where a gap of more ranks holds it.
// Every rank's list is ordered by (degree descending, micro-batch index). Used by planner_sp.cc.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/internal/balanced.h"
#include "ditscale/balance/planner.h"
#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

inline constexpr int kMaxRaiseTrials = 32;

struct SpContext {
  const CostModel* cost = nullptr;
  std::vector<int> degrees;               // allowed, ascending
  std::vector<int> min_degree_of_shape;   // d_min per shape (0: no chunk has that shape)
  std::vector<double> work_of_shape;      // Work(S), s
  std::vector<double> comm_per_sample_s;  // [shape * kSpDegreeSlots + SpSlot(d)]
  double step_overhead = 0;               // a, s
  double mb_overhead = 0;                 // a_mb, s
  double budget = 0;                      // per-rank budget of a step, s
  int64_t lookahead = 0;                  // chunks beyond the cut that may fill gaps

  // Per-rank cost of one more sample of `shape` on d ranks: Work(S) / (d eff(d)) + comm(d, S).
  double Unit(int32_t shape, int d) const;
  // The next allowed degree above d, 0 when none (or above world_size w).
  int NextDegree(int d, int w) const;
};

// Appends the steps of the shuffled `chunks` to plan (micro_batches, work, rank_offsets; the
// latter already holds its leading 0).
void BuildBalancedSp(const std::vector<Chunk>& chunks, const SpContext& ctx, Plan& plan);

}  // namespace ditscale::balance::internal

// ---- The planner's side (planner_sp.cc): options, batch sizes, budget. ----
namespace ditscale::balance::internal {

// PlanOptions::sp_degrees and sp_comm_per_sample_s (planner.h) against the manifest's shapes.
std::optional<Failure> CheckSpOptions(const ShapedManifest& shaped, const PlanOptions& options);

// Per shape: d_min (Plan::sp_min_degree_of_shape; 0: over M_mem at every degree) and
// B = DualConstraintBatch(S, d_min * M_mem, d_min * M_comp, p) (0 where d_min is 0);
// Plan::samples_unfit counts the samples that fit at no degree.
void SetSpBatchSizes(const ShapedManifest& shaped, const PlanOptions& options,
                     const std::vector<int64_t>& count, Plan& plan);

// The smallest per-rank budget: max over the shapes with fitting samples of one sample's
// per-rank cost at its smallest fitting degree, a + a_mb + Work(S) / (d_min eff(d_min)) +
// comm(d_min, S) (MinRankBudget at d_min: the steps hold every sample at d_min; a raise then
// only shortens a step).
double SpMinRankBudget(const ShapedManifest& shaped, const SpContext& ctx,
                       const std::vector<int64_t>& count);

// The budget (given, or the default raised to SpMinRankBudget), then the steps.
std::optional<Failure> BuildSpPlan(const ShapedManifest& shaped, const CostModel& cost,
                                   const PlanOptions& options, std::vector<double> work_of_shape,
                                   const std::vector<int64_t>& count,
                                   const std::vector<Chunk>& chunks, Plan& plan);

}  // namespace ditscale::balance::internal
