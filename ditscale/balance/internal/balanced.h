// The balanced policy's step builder (the order of work: planner.h, MakePlan, step 4): each step
// cuts the next world_size * (budget - a) seconds of work from the shuffled micro-batch stream,
// assigns its samples to ranks by LPT, fills every rank's gap from a lookahead window and swaps
// micro-batches of a step still uneven by > 1%. Shared by planner.cc (MakePlan) only.
#pragma once

#include <cstdint>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/shapes.h"

namespace ditscale::balance::internal {

// Samples ids[begin, end) of the plan, all of shape `shape`: a micro-batch before balancing.
struct Chunk {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t shape = 0;
};

struct BalanceContext {
  const ShapedManifest* shaped;
  const CostModel* cost;
  std::vector<double> work_of_shape;  // Work(S) per shape, s
  double step_overhead = 0;           // a, s, once per (step, rank) with work
  double mb_overhead = 0;             // a_mb, s, per micro-batch
  double budget = 0;                  // effective per-rank budget, s
  int64_t lookahead = 0;              // chunks beyond the cut that may fill gaps
  // cost->StepTime(count, seq_len of `shape`): the same sum, with Work(S) taken from the table.
  double StepTime(int64_t count, int32_t shape) const {
    return cost->a + (cost->a_mb + static_cast<double>(count) * work_of_shape[shape]);
  }
};

// Micro-batches reserved for a balanced plan of `chunks` chunks: the cut, the LPT and the gap
// filling split chunks (10M samples at 16 ranks: 1.92 micro-batches a chunk). Beyond the
// reservation the arrays grow (a copy and fresh pages of everything so far); a reservation that
// is not used is address space only.
inline size_t ReservedMicroBatches(int64_t chunks) { return static_cast<size_t>(2 * chunks + 16); }

// Writes the per-rank micro-batch lists of one step into plan.work / plan.rank_offsets.
void EmitStep(const std::vector<std::vector<int64_t>>& lists, Plan& plan);

// Appends the balanced steps of the shuffled `chunks` to plan (micro_batches, work,
// rank_offsets; rank_offsets already holds its leading 0).
void BuildBalanced(const std::vector<Chunk>& chunks, const BalanceContext& ctx, Plan& plan);

}  // namespace ditscale::balance::internal
