// Bucketing policies and the global plan: what every data-parallel rank trains on at every step.
//
//   equal-token:  B(S) = max(1, floor(M_mem / S))
//   adaptive:     B(S) = max(1, min(floor(M_mem / S), floor(M_comp / S^p)))   (AdaptiveLoad)
//                 M_comp, when not given, minimises the simulated epoch time.
//   balanced:     micro-batches formed under both constraints; at each global step micro-batches
//                 are assigned to ranks (LPT / Karmarkar-Karp on predicted cost, several per rank
//                 with gradient accumulation) so every rank's predicted cost is nearly equal; the
//                 per-rank budget of a step defaults to the cost of one adaptive batch at M_comp.
//
// A plan is a pure function of (manifest, model, cost model, options incl. seed and epoch):
// every rank computes the same plan without communication.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

enum class Policy { kEqualToken, kAdaptive, kBalanced };
const char* PolicyName(Policy p);
Result<Policy> ParsePolicy(const std::string& name);

// What happens to samples that do not fill a last global step.
enum class TailPolicy {
  kDrop,  // dropped (counted in Plan::dropped_samples), default
  kPad,   // ranks without work repeat the smallest micro-batch of the epoch (reported)
  kKeep,  // a last partial step where some ranks get nothing
};

struct PlanOptions {
  Policy policy = Policy::kBalanced;
  int world_size = 1;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t m_mem_tokens = 0;       // memory constraint; required (> 0)
  double m_comp = 0;              // compute constraint; 0: chosen automatically (adaptive)
  double rank_budget_s = 0;       // balanced: per-rank predicted cost per step; 0: default
  TailPolicy tail = TailPolicy::kDrop;
};

// One micro-batch: samples of one shape, ids[begin, end) of Plan::ids.
struct MicroBatch {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t shape = 0;          // index into ShapedManifest::shapes
  double predicted_cost_s = 0;
};

struct Plan {
  Policy policy = Policy::kBalanced;
  int world_size = 1;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t m_mem_tokens = 0;
  double m_comp = 0;               // the M_comp used (chosen or given)
  double p = 2;                    // exponent used
  double rank_budget_s = 0;        // balanced: the budget used
  std::vector<int64_t> ids;        // sample ids grouped by micro-batch
  std::vector<MicroBatch> micro_batches;
  // Steps x ranks: the micro-batches of (step k, rank r) are
  //   micro_batches[work[rank_offsets[k * world_size + r] .. rank_offsets[k * world_size + r + 1])]
  std::vector<int64_t> work;
  std::vector<int64_t> rank_offsets;   // size num_steps * world_size + 1
  int64_t dropped_samples = 0;
  int64_t padded_micro_batches = 0;
  std::vector<int64_t> batch_size_of_shape;  // per shape: B chosen by the policy

  int64_t num_steps() const {
    return world_size > 0 ? (static_cast<int64_t>(rank_offsets.size()) - 1) / world_size : 0;
  }
};

Result<Plan> MakePlan(const ShapedManifest& shaped, const CostModel& cost,
                      const PlanOptions& options);

}  // namespace ditscale::balance
