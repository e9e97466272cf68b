// The balanced plan with a sequence-parallel degree per micro-batch: options, batch sizes and
// budget (internal/balanced_sp.h builds the steps; formulas: sp_cost.h).
#include <algorithm>
#include <cmath>
#include <string>

#include "ditscale/balance/internal/balanced_sp.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/range.h"

namespace ditscale::balance::internal {

std::optional<Failure> CheckSpOptions(const ShapedManifest& shaped, const PlanOptions& options) {
  const std::vector<int>& deg = options.sp_degrees;
  if (deg.empty()) return std::nullopt;
  if (options.policy != Policy::kBalanced) {
    return Failure::InvalidArgument(std::string("sequence-parallel degrees need the balanced "
                                                "policy, not '") +
                                        PolicyName(options.policy) + "'",
                                    "sp_degrees");
  }
  for (size_t i = 0; i < deg.size(); ++i) {
    const int d = deg[i];
    if (d < 1 || d > kMaxSpDegree || (d & (d - 1)) != 0 || d > options.world_size ||
        options.world_size % d != 0 || (i > 0 && d <= deg[i - 1])) {
      return Failure::InvalidArgument(
          "sp_degrees: " + std::to_string(d) + " (entry " + std::to_string(i) +
              ") must be a power of two in [1, " + std::to_string(kMaxSpDegree) +
              "], at most the world size " + std::to_string(options.world_size) +
              " and dividing it, the list ascending without repeats",
          "sp_degrees");
    }
  }
  const size_t want = shaped.shapes.size() * kSpDegreeSlots;
  if (options.sp_comm_per_sample_s.size() != want) {
    return Failure::InvalidArgument(
        "sp_comm_per_sample_s has " + std::to_string(options.sp_comm_per_sample_s.size()) +
            " entries, expected shapes x " + std::to_string(kSpDegreeSlots) + " = " +
            std::to_string(want),
        "sp_comm_per_sample_s");
  }
  for (double c : options.sp_comm_per_sample_s) {
    if (auto e = RangeError("sp_comm_per_sample_s (s)", c, 0.0, kMaxRankBudgetS)) {
      return Failure::InvalidArgument(*e, "sp_comm_per_sample_s");
    }
  }
  return std::nullopt;
}

void SetSpBatchSizes(const ShapedManifest& shaped, const PlanOptions& options,
                     const std::vector<int64_t>& count, Plan& plan) {
  plan.sp_degrees = options.sp_degrees;
  plan.sp_comm_per_sample_s = options.sp_comm_per_sample_s;
  plan.sp_min_degree_of_shape.assign(shaped.shapes.size(), 0);
  for (size_t s = 0; s < shaped.shapes.size(); ++s) {
    const int64_t len = shaped.shapes[s].seq_len;
    const int d = MinSpDegree(len, options.m_mem_tokens, options.sp_degrees);
    plan.sp_min_degree_of_shape[s] = d;
    if (d == 0) {
      plan.batch_size_of_shape[s] = 0;
      plan.samples_unfit += count[s];
      continue;
    }
    const double m_comp = plan.m_comp > 0 ? d * plan.m_comp : 0;
    plan.batch_size_of_shape[s] =
        DualConstraintBatch(len, d * options.m_mem_tokens, m_comp, plan.p);
  }
  plan.dropped_samples += plan.samples_unfit;
}

double SpMinRankBudget(const ShapedManifest& shaped, const SpContext& ctx,
                       const std::vector<int64_t>& count) {
  double budget = 0;
  for (size_t s = 0; s < shaped.shapes.size(); ++s) {
    const int d_min = ctx.min_degree_of_shape[s];
    if (count[s] == 0 || d_min == 0) continue;
    budget = std::max(
        budget, ctx.step_overhead + ctx.mb_overhead + ctx.Unit(static_cast<int32_t>(s), d_min));
  }
  return budget;
}

std::optional<Failure> BuildSpPlan(const ShapedManifest& shaped, const CostModel& cost,
                                   const PlanOptions& options, std::vector<double> work_of_shape,
                                   const std::vector<int64_t>& count,
                                   const std::vector<Chunk>& chunks, Plan& plan) {
  SpContext ctx;
  ctx.cost = &cost;
  ctx.degrees = options.sp_degrees;
  ctx.min_degree_of_shape = plan.sp_min_degree_of_shape;
  ctx.work_of_shape = std::move(work_of_shape);
  ctx.comm_per_sample_s = options.sp_comm_per_sample_s;
  ctx.step_overhead = cost.a;
  ctx.mb_overhead = cost.a_mb;
  const double min_budget = SpMinRankBudget(shaped, ctx, count);
  if (min_budget <= 0) {
    return Failure::Infeasible(
        "no sample fits the memory budget M_mem = " + std::to_string(options.m_mem_tokens) +
        " tokens per rank at any sequence-parallel degree of the list "
        "(the largest degree times M_mem is below every sample's S)");
  }
  if (options.rank_budget_s > 0 && options.rank_budget_s < min_budget) {
    return Failure::InvalidArgument(
        "rank budget " + FormatNumber(options.rank_budget_s) +
        " s is below the per-rank cost of the most expensive sample at its smallest fitting "
        "degree, " +
        FormatNumber(min_budget) + " s; give a budget >= " + FormatNumber(min_budget) +
        " s, or 0 for the default");
  }
  const double requested = options.rank_budget_s > 0
                               ? options.rank_budget_s
                               : DefaultRankBudget(shaped, cost, plan.m_comp, plan.p);
  ctx.budget = std::max(requested, min_budget);
  plan.rank_budget_raised = requested < min_budget;
  plan.rank_budget_s = ctx.budget;
  ctx.lookahead = 8 * static_cast<int64_t>(options.world_size) + 32;
  BuildBalancedSp(chunks, ctx, plan);
  return std::nullopt;
}

}  // namespace ditscale::balance::internal

namespace ditscale::balance {

double MinRankBudget(const ShapedManifest& shaped, const CostModel& cost,
                     const PlanOptions& options) {
  if (options.sp_degrees.empty()) return MinRankBudget(shaped, cost);
  std::vector<int64_t> count = shaped.count;
  if (count.size() != shaped.shapes.size()) {
    count.assign(shaped.shapes.size(), 0);
    for (int32_t s : shaped.shape_of) ++count[s];
  }
  internal::SpContext ctx;
  ctx.cost = &cost;
  ctx.degrees = options.sp_degrees;
  ctx.comm_per_sample_s = options.sp_comm_per_sample_s;
  ctx.step_overhead = cost.a;
  ctx.mb_overhead = cost.a_mb;
  for (const TrainShape& t : shaped.shapes) {
    ctx.work_of_shape.push_back(cost.Work(t.seq_len));
    ctx.min_degree_of_shape.push_back(
        MinSpDegree(t.seq_len, options.m_mem_tokens, options.sp_degrees));
  }
  return internal::SpMinRankBudget(shaped, ctx, count);
}

}  // namespace ditscale::balance
