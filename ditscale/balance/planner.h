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

// Limits of PlanOptions, checked by MakePlan before anything is allocated (the CLI and the
// Python sampler check the same ranges at their edge):
//   world_size    [1, kMaxWorldSize]; under TailPolicy::kDrop also at most the number of samples
//   m_mem_tokens  [1, kMaxMMemTokens]
//   m_comp        [0, kMaxMComp] (0: automatic)
//   rank_budget_s [0, kMaxRankBudgetS] s (0: default); a budget > 0 below MinRankBudget is an
//                 error (it used to be raised silently)
//   epoch         [0, INT64_MAX]; seed: any uint64
// Memory of a plan is O(samples + steps * world_size) (rank offsets per step and rank); ranks
// beyond the micro-batch count get nothing in a step.
inline constexpr int kMaxWorldSize = 1 << 20;
inline constexpr int64_t kMaxMMemTokens = int64_t{1} << 50;
inline constexpr double kMaxMComp = 1e300;
inline constexpr double kMaxRankBudgetS = 1e9;
// A plan that drops more than this fraction of the epoch's samples (Plan::dropped_fraction) is
// reported with a warning by the CLI (`ditscale plan`); a plan without any step is an error.
inline constexpr double kDroppedWarnFraction = 0.10;

enum class Policy { kEqualToken, kAdaptive, kBalanced };
const char* PolicyName(Policy p);
Result<Policy> ParsePolicy(const std::string& name);

// What happens to samples that do not fill a last global step.
enum class TailPolicy {
  kDrop,  // dropped (counted in Plan::dropped_samples), default
  kPad,   // ranks without work repeat the smallest micro-batch of the epoch (reported); with
          // sequence-parallel degrees the smallest one-rank micro-batch (none: the step stays
          // partial, as under kKeep)
  kKeep,  // a last partial step where some ranks get nothing
};

struct PlanOptions {
  Policy policy = Policy::kBalanced;
  int world_size = 1;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t m_mem_tokens = 0;  // memory constraint; required (> 0)
  double m_comp = 0;         // compute constraint; 0: chosen automatically (adaptive)
  double rank_budget_s = 0;  // balanced: per-rank predicted cost per step; 0: default
  TailPolicy tail = TailPolicy::kDrop;
  // Cost accounting of gradient accumulation: a rank's cost in a step is always
  //   a + sum_i (cost.a_mb + B_i * Work(S_i))   (cost_model.h),
  // a once per step and rank, a_mb per micro-batch pass. true: plan with
  // OverheadPerMicroBatch(cost) instead (a_mb := a + a_mb, a := 0; conservative). Kept for old
  // callers: a cost model with a fitted a_mb is the accurate way to charge micro-batches.
  bool overhead_per_micro_batch = false;
  // Sequence parallelism per micro-batch (balanced only; sp_cost.h, planner_sp.cc). Empty: every
  // micro-batch on one rank, samples over M_mem run alone at B = 1 (the plan of before).
  // Otherwise the allowed degrees: sorted, distinct powers of two in [1, kMaxSpDegree], each at
  // most world_size and dividing it. {1}: the plan of before with the samples over M_mem dropped
  // (counted in Plan::samples_unfit): the same plan when there are none.
  std::vector<int> sp_degrees;
  // comm(d, S) per sample, s, [shape * kSpDegreeSlots + SpSlot(d)] (UlyssesCommPerSample);
  // required (finite, >= 0) when sp_degrees is not empty.
  std::vector<double> sp_comm_per_sample_s;
};

const char* TailPolicyName(TailPolicy t);
Result<TailPolicy> ParseTailPolicy(const std::string& name);

// One micro-batch: samples of one shape, ids[begin, end) of Plan::ids.
struct MicroBatch {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t shape = 0;            // index into ShapedManifest::shapes
  double predicted_cost_s = 0;  // per rank: a + its micro-batch cost
  // Ranks training it together: 1, or d of an aligned group (ranks g*d .. g*d+d-1; every rank of
  // the group lists it in the step). Last, so that {begin, end, shape, cost} still reads as before.
  int16_t sp_degree = 1;
};

struct Plan {
  Policy policy = Policy::kBalanced;
  int world_size = 1;
  uint64_t seed = 0;
  int64_t epoch = 0;
  int64_t m_mem_tokens = 0;
  double m_comp = 0;         // the M_comp used (chosen or given)
  double p = 2;              // exponent used
  double rank_budget_s = 0;  // balanced: the budget used
  // Sample ids, grouped by shape and shuffled within each shape bucket; every micro-batch is a
  // contiguous slice. Ids of a dropped tail stay here but no work entry references them.
  std::vector<int64_t> ids;
  std::vector<MicroBatch> micro_batches;
  // Steps x ranks: the micro-batches of (step k, rank r) are
  //   micro_batches[work[rank_offsets[k * world_size + r] .. rank_offsets[k * world_size + r + 1])]
  std::vector<int64_t> work;
  std::vector<int64_t> rank_offsets;  // size num_steps * world_size + 1
  int64_t dropped_samples = 0;
  int64_t padded_micro_batches = 0;
  std::vector<int64_t> batch_size_of_shape;  // per shape: B chosen by the policy (balanced: max B)
  int64_t samples_over_m_mem = 0;  // samples whose single-sample S exceeds M_mem (run at B = 1)
  bool overhead_per_micro_batch = false;

  bool rank_budget_raised = false;  // balanced, default budget: raised to MinRankBudget

  // Sequence parallelism (PlanOptions::sp_degrees; empty: not used). A rank's micro-batches in
  // a step are ordered by degree (descending), then index: the ranks of a group reach each of
  // their shared micro-batches together, so a rank's time is the sum of its costs.
  std::vector<int> sp_degrees;
  std::vector<double> sp_comm_per_sample_s;  // copied from the options
  std::vector<int> sp_min_degree_of_shape;   // smallest fitting degree; 0: fits at none
  int64_t samples_unfit = 0;  // dropped (in dropped_samples too): over M_mem at every degree

  // Dropped samples / all samples of the epoch (0 for an empty plan).
  double dropped_fraction() const {
    return ids.empty() ? 0.0
                       : static_cast<double>(dropped_samples) / static_cast<double>(ids.size());
  }
  int64_t num_steps() const {
    return world_size > 0 ? (static_cast<int64_t>(rank_offsets.size()) - 1) / world_size : 0;
  }
};

// Builds the plan. Failures: an option outside its range (above), an empty manifest, a
// manifest whose shape_of/ids disagree, a cost model that predicts no positive work, and a plan
// without any step (more ranks than micro-batches under the tail policy 'drop': the message
// names the world size, the samples, the micro-batches and the tail policy).
//
// Order of work, all seeded by (seed, epoch) with splitmix64 (internal/prng.h):
//  1. samples are counting-sorted by shape and shuffled within each shape bucket;
//  2. each bucket is cut into micro-batches of B(S) (the last one of a bucket may be smaller);
//  3. the micro-batch order is shuffled;
//  4. equal-token / adaptive: step k gives micro-batch k * world_size + r to rank r;
//     balanced: each step cuts the next world_size * (budget - a) seconds of work (a_mb per
//     micro-batch included)
//     from the shuffled micro-batch order, splitting the micro-batch that crosses the cut, and
//     assigns its samples to ranks by LPT (most expensive sample first, to the least-loaded
//     rank; ties rotate with the step); the samples of one micro-batch that land on one rank
//     form one contiguous micro-batch (so B never exceeds the dual-constraint B). Then every
//     rank below the step's level (its largest load) is filled up to it with work pulled
//     forward from a lookahead window of the next 8 * world_size + 32 micro-batches (split to
//     fit); what does not fit stays in order for the next step's cut. A step still uneven by
//     > 1% is improved by pairwise swaps (internal/partition.h). The budget is the mean
//     per-rank cost of the cut; a rank exceeds it by less than one sample's cost.
//     Every stage of balancing (cut, LPT split, top-up, swaps) charges cost.a_mb for each
//     micro-batch it creates: a split or a top-up happens only where the receiving rank has room
//     for a_mb plus at least one sample, so with a_mb > 0 steps are made of fewer micro-batches;
//     with a_mb = 0 the plan is the same as before a_mb existed.
//  5. a last step in which some rank has no micro-batch is the tail: dropped / padded / kept.
// Balanced budget: rank_budget_s if > 0 (an error when below MinRankBudget), else
// DefaultRankBudget raised to at least MinRankBudget so every sample fits a rank
// (Plan::rank_budget_s is the value used, Plan::rank_budget_raised says it was raised).
Result<Plan> MakePlan(const ShapedManifest& shaped, const CostModel& cost,
                      const PlanOptions& options);

// ---- Pieces of the policies, exposed for tests, the CLI and the sampler. ----

// equal-token: max(1, floor(m_mem / S)).
int64_t EqualTokenBatch(int64_t seq_len, int64_t m_mem_tokens);
// The dual constraint: max(1, min(floor(m_mem / S), floor(m_comp / S^p))).
int64_t DualConstraintBatch(int64_t seq_len, int64_t m_mem_tokens, double m_comp, double p);

// The representative sequence length S*: the token-weighted median of S (half of the corpus's
// tokens are in samples with seq_len <= S*). 0 for an empty manifest.
int64_t RepresentativeSeqLen(const ShapedManifest& shaped);
// The exponent p of the compute constraint: cost.p for the power model; for the quadratic model
// cost.Exponent(S*) at the representative S* (the local slope of log Work vs log S there).
double PlanExponent(const ShapedManifest& shaped, const CostModel& cost);
// Default per-rank budget of a balanced step: the predicted cost of one adaptive batch that
// exactly meets the compute constraint, a + a_mb + m_comp * Work(S*) / S*^p (= a + a_mb + b *
// m_comp for the power model).
double DefaultRankBudget(const ShapedManifest& shaped, const CostModel& cost, double m_comp,
                         double p);

// The smallest per-rank budget of a balanced step: the cost of the most expensive single
// sample, a + a_mb + max_S Work(S) over the shapes with samples (0 for an empty manifest).
double MinRankBudget(const ShapedManifest& shaped, const CostModel& cost);
// The same for `options` (planner_sp.cc): MinRankBudget without sequence-parallel degrees; with
// them the costliest sample's per-rank cost at its smallest fitting degree (samples fitting at no
// degree left out). Options as MakePlan takes them (sp_comm_per_sample_s sized; not checked).
double MinRankBudget(const ShapedManifest& shaped, const CostModel& cost,
                     const PlanOptions& options);

// M_comp minimising the simulated epoch time of the adaptive policy (steps of one micro-batch
// per rank, step time = max over ranks). Candidates: 40 log-spaced values between min_S S^p
// (all B = 1) and max_S floor(m_mem/S) * S^p (adaptive == equal-token), then the breakpoints
// k * S^p of every shape inside the best candidate's neighbourhood (at most 48). Each candidate
// is simulated on the shape histogram (scaled down to ~200k samples for large manifests) with
// micro-batch order shuffled by (seed, epoch). Deterministic. Returns 0 for an empty manifest.
struct MCompSearch {
  double m_comp = 0;
  std::vector<double> candidates;    // evaluated M_comp values, in evaluation order
  std::vector<double> epoch_time_s;  // simulated epoch time of each candidate (scaled histogram)
};
MCompSearch ChooseMComp(const ShapedManifest& shaped, const CostModel& cost,
                        const PlanOptions& options, double p);

}  // namespace ditscale::balance
