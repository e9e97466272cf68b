// BalancedBatchSampler: the distributed, deterministic, resumable sampler over a global Plan.
//
// Every data-parallel rank builds its own sampler from the same inputs (manifest, model, cost
// model, PlanOptions with seed and epoch) and computes the same global plan (planner.h) with no
// communication; the sampler then walks the plan's cells (step k, this rank) in order.
//
// What one epoch yields on rank r:
//   steps:         k = 0 .. num_steps()-1; the same count on every rank.
//   micro-batches: the cell (k, r) holds c(k, r) >= 0 micro-batches, each a list of sample ids of
//                  one training shape. With gradient accumulation (policy balanced) c(k, r) may
//                  be > 1 and may differ between ranks, so NumMicroBatches() may differ between
//                  ranks while NumSteps() never does. The training loop calls optimizer.step()
//                  after the micro-batch flagged last_of_step (DDP: no_sync on the others).
//                  equal-token and adaptive plans give exactly one micro-batch per cell.
// Exactly once: the union over ranks of all ids of one epoch is every planned sample, each once;
//   the samples the tail policy dropped (TailPolicy::kDrop) are counted in DroppedSamples(); with
//   kPad some ranks repeat a micro-batch in the last step (PaddedMicroBatches()); with kKeep the
//   last step may leave some cells empty (c(k, r) == 0: in micro-batch iteration that rank has
//   nothing in step k, in step iteration it gets an empty step).
// Determinism: the plan is a pure function of (inputs, seed, epoch). SetEpoch(e) re-plans.
// Resume: the cursor is (epoch, step, micro_batch): the next micro-batch to yield is number
//   `micro_batch` of cell (step, rank). State() / LoadState() save and restore it; a sampler
//   built from the same inputs that loads a state yields exactly what the saved one would have
//   yielded next. The state carries the rank, world size, seed and a fingerprint of the plan;
//   LoadState refuses a state saved on another manifest, model, cost model, plan options, seed
//   or world size, and a state without a fingerprint. A mid-step state (micro_batch > 0) is
//   refused on any rank but its own (it counts that rank's micro-batches); a state at a step
//   boundary (micro_batch == 0) means the same on every rank, so rank 0 may save one state for
//   all ranks.
// Empty epochs: a plan with no step (every sample dropped by the tail policy, or no sample) is
//   a failure of Create / FromShaped / FromConfig and an Error of SetEpoch / LoadState, never a
//   sampler that silently yields nothing.
#pragma once

#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/fit.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

// Computes the global plan of one epoch. Must be a pure function of `epoch` (and whatever it
// captured): every rank calls it independently and must get the same plan.
using EpochPlanner = std::function<Result<Plan>(int64_t epoch)>;

// Ranges of the sampler's numeric inputs (SamplerConfig, rank, world size, SamplerState),
// checked by FromConfig / LoadState and, with the same numbers, by the Python binding; the
// planner's limits are those of planner.h, the rest the same as `ditscale plan`'s options:
//   world_size      [1, kMaxWorldSize]           rank          [0, world_size - 1]
//   seed            [0, 2^64 - 1]                epoch         [0, kMaxEpoch]
//   m_mem_tokens    [0, kMaxMMemTokens] (0: from the memory model)
//   gpu_mem_gib     [kMinGpuMemGib, kMaxGpuMemGib]
//   mem_safety      [0, kMaxMemSafety] (share of GPU memory kept free)
//   m_comp          [0, kMaxMComp] (0: chosen by the planner)
//   rank_budget_s   [0, kMaxRankBudgetS] (0: the planner's default)
//   sp_degrees      empty (off), or the rules of `ditscale plan --sp-degrees` (SpDegreesError:
//                   distinct powers of two in [1, kMaxSpDegree] dividing world_size), policy
//                   balanced only
// Above kDroppedWarnFraction of an epoch's samples dropped the Python sampler warns.
inline constexpr int64_t kMaxEpoch = INT64_MAX;
inline constexpr double kMinGpuMemGib = 0.001;
inline constexpr double kMaxGpuMemGib = 1048576;  // 1 PiB
inline constexpr double kMaxMemSafety = 0.99;

// The resumable position of a sampler. Every field is checked by LoadState.
struct SamplerState {
  int64_t epoch = 0;              // [0, kMaxEpoch]; another epoch than the sampler's is re-planned
  int64_t step = 0;               // global step within the epoch, 0 .. num_steps (num_steps: done)
  int64_t micro_batch = 0;        // next micro-batch of `rank` within `step`, 0 .. c(step, rank)
  uint64_t seed = 0;              // the plan's seed; must match on load
  int world_size = 0;             // must match on load
  int rank = 0;                   // the rank that saved it; must match on load when micro_batch > 0
  uint64_t plan_fingerprint = 0;  // PlanFingerprint of the epoch's plan; must match (0: refused)
};

// One micro-batch of this rank, a view into the sampler's current plan (valid until the next
// SetEpoch / LoadState / destruction of the sampler).
struct MicroBatchRef {
  std::span<const int64_t> ids;       // sample ids (0-based manifest row numbers), all one shape
  int64_t step = 0;                   // global step it belongs to
  int32_t index_in_step = 0;          // 0 .. micro_batches_in_step-1
  int32_t micro_batches_in_step = 0;  // c(step, rank)
  bool last_of_step = false;          // index_in_step == micro_batches_in_step - 1
  int32_t shape = 0;                  // index into ShapedManifest::shapes
  double predicted_cost_s = 0;        // the planner's predicted cost of this micro-batch
  // Ranks training it together (MicroBatch::sp_degree): 1, or d > 1 for the aligned group
  // (rank / d) * d .. + d - 1, every rank of which lists it in the same place of its order.
  int32_t sp_degree = 1;
};

// What a sampler built from files resolved on the way (for reports and the Python binding).
struct SamplerInputs {
  std::string manifest_source;                // manifest file
  int64_t rows_total = 0;                     // data rows read
  int64_t rows_skipped = 0;                   // bad rows skipped (skip_bad_rows)
  std::vector<std::string> skipped_examples;  // first skip reasons, "file:line: ..."
  int64_t num_samples = 0;                    // good rows = samples planned before the tail policy
  std::string model;                          // preset name
  CostModel cost;                             // cost model used
  MemoryModel memory;                         // memory model used (m1 == 0 when M_mem was given)
  int64_t m_mem_tokens = 0;                   // memory constraint used (given or from memory + GPU)
  int64_t num_shapes = 0;                     // distinct training shapes
};

// Everything a sampler needs that comes from files and flags (the Python binding's arguments).
struct SamplerConfig {
  std::string manifest_path;
  // A manifest already read (the Python sampler's pyarrow.Table / datasets.Dataset, read by the
  // Parquet reader's Arrow-stream entry): used instead of reading manifest_path when set.
  std::shared_ptr<const Manifest> manifest;
  ManifestOptions manifest_options;   // skip_bad_rows, format
  std::string model = "wan2.1-1.3b";  // preset name or JSON model file (ResolveModel)
  std::string cost_path;              // cost JSON (LoadCostModel); "": analytical H200 default
  // Benchmark CSV (fit.h) to fit the cost model (and the memory model when it has
  // peak_mem_bytes) from; at most one of cost_path and bench_path.
  std::string bench_path;
  // M_mem when plan.m_mem_tokens == 0: MemoryModel::MaxTokens(gpu_mem_gib * 2^30, mem_safety).
  double gpu_mem_gib = 141.0;
  double mem_safety = 0.1;  // share of GPU memory kept free
  // policy, seed, epoch, m_mem_tokens, m_comp, tail, sp_degrees, ... With sp_degrees, FromConfig
  // fills sp_comm_per_sample_s as `ditscale plan --sp-degrees` does (UlyssesCommPerSample on
  // sp_topology, an sp preset or JSON file).
  PlanOptions plan;
  std::string sp_topology = kDefaultSpTopology;
};

// The first out-of-range number of (config, rank, world_size), as RangeError words it
// ("mem_safety: -0.5 is out of range [0, 0.99]"), or nullopt. Names are the Python
// argument names.
std::optional<std::string> SamplerConfigError(const SamplerConfig& config, int rank,
                                              int world_size);

// A 64-bit hash of everything that defines what a plan yields (ids, micro-batch bounds, cells,
// world size, seed, epoch; with sequence-parallel degrees also the allowed degrees and each
// micro-batch's: without them the hash is that of before). Equal plans have equal
// fingerprints; never 0.
uint64_t PlanFingerprint(const Plan& plan);

// Checks the structure of a plan for `world_size` ranks (cells in range, micro-batch bounds in
// range and ordered). Throws ditscale::Error naming the broken field; planners' bugs, not user
// input, so a check, not a Result.
void CheckPlanStructure(const Plan& plan, int world_size);

class BalancedBatchSampler {
 public:
  // The general form: plans come from `planner`. rank in [0, world_size). Fails if the first
  // plan fails; throws Error on bad rank/world size or a malformed plan.
  static Result<BalancedBatchSampler> Create(EpochPlanner planner, int rank, int world_size,
                                             int64_t epoch = 0);
  // Plans `shaped` with MakePlan(shaped, cost, options); options.world_size is set to
  // world_size, options.epoch is the first epoch.
  static Result<BalancedBatchSampler> FromShaped(ShapedManifest shaped, CostModel cost,
                                                 PlanOptions options, int rank, int world_size);
  // Checks the config's numbers (SamplerConfigError), reads the manifest, resolves the model,
  // cost and memory models and M_mem, then FromShaped. Failures name the file, line and column
  // (bad manifest row, bad cost JSON, unknown model) or the out-of-range argument.
  static Result<BalancedBatchSampler> FromConfig(const SamplerConfig& config, int rank,
                                                 int world_size);

  BalancedBatchSampler(BalancedBatchSampler&&) = default;
  BalancedBatchSampler& operator=(BalancedBatchSampler&&) = default;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int64_t epoch() const { return epoch_; }
  const Plan& plan() const { return plan_; }
  // Filled by FromConfig only.
  const std::optional<SamplerInputs>& inputs() const { return inputs_; }
  // The manifest and cost model the plans come from (FromShaped / FromConfig; null / nullopt
  // for Create), e.g. for Simulate(plan(), *shaped(), *cost()).
  const std::shared_ptr<const ShapedManifest>& shaped() const { return shaped_; }
  const std::optional<CostModel>& cost() const { return cost_; }

  // Re-plans for epoch e in [0, kMaxEpoch] and rewinds to its first step. On the current epoch
  // it does nothing, not even rewind (so SetEpoch may follow LoadState in a resumed training
  // loop); Reset() rewinds. Throws Error with the planner's failure or for a plan with no step;
  // the sampler is then unchanged.
  void SetEpoch(int64_t e);
  // Rewinds to the first step of the current epoch.
  void Reset();

  // Steps in the epoch: equal on every rank.
  int64_t NumSteps() const { return plan_.num_steps(); }
  // Micro-batches of this rank in the epoch (sum over steps of c(k, rank)); may differ between
  // ranks under the balanced policy.
  int64_t NumMicroBatches() const { return rank_micro_batches_; }
  // Micro-batches still to come on this rank / steps not yet started or finished.
  int64_t RemainingMicroBatches() const;
  int64_t RemainingSteps() const;
  int64_t DroppedSamples() const { return plan_.dropped_samples; }
  int64_t PaddedMicroBatches() const { return plan_.padded_micro_batches; }

  // c(step, rank) for any rank.
  int64_t MicroBatchesInCell(int64_t step, int rank) const;
  // The micro-batches of cell (step, rank), without moving the cursor.
  std::vector<MicroBatchRef> Cell(int64_t step, int rank) const;

  // Flat iteration: the next micro-batch of this rank, or nullopt at the end of the epoch.
  // Empty cells are passed over.
  std::optional<MicroBatchRef> NextMicroBatch();
  // Step iteration: the rest of the current step (all of it unless NextMicroBatch stopped
  // mid-step), possibly empty; false at the end of the epoch.
  bool NextStep(std::vector<MicroBatchRef>* micro_batches);

  // Range-for over the remaining micro-batches (consumes them, like NextMicroBatch):
  //   for (const MicroBatchRef& mb : sampler.MicroBatches()) { ... }
  class MicroBatchRange;
  MicroBatchRange MicroBatches();

  // The cursor, normalised so that a finished step reads as (step + 1, 0).
  SamplerState State() const;
  // Restores a cursor: checks every field's range, the world size, the rank (when
  // micro_batch > 0), re-plans state.epoch if needed, checks the seed and the plan fingerprint,
  // and that (step, micro_batch) lies in this rank's epoch. Throws Error naming the field
  // ("state.rank: ..."); the sampler is then unchanged.
  void LoadState(const SamplerState& state);

 private:
  BalancedBatchSampler(EpochPlanner planner, int rank, int world_size);
  // The checked plan of `epoch` (planner failure or no step: a Failure), not yet adopted.
  Result<Plan> PlanEpoch(int64_t epoch) const;
  // Makes `plan` the current one and rewinds.
  void Adopt(Plan plan, int64_t epoch);
  MicroBatchRef MakeRef(int64_t step, int rank, int64_t index) const;
  int64_t CellBegin(int64_t step, int rank) const {
    return plan_.rank_offsets[static_cast<size_t>(step * world_size_ + rank)];
  }

  EpochPlanner planner_;
  int rank_ = 0;
  int world_size_ = 1;
  int64_t epoch_ = 0;
  Plan plan_;
  uint64_t fingerprint_ = 0;
  int64_t rank_micro_batches_ = 0;
  int64_t step_ = 0;  // cursor
  int64_t micro_batch_ = 0;
  int64_t consumed_ = 0;  // micro-batches of this rank before the cursor
  std::optional<SamplerInputs> inputs_;
  std::shared_ptr<const ShapedManifest> shaped_;
  std::optional<CostModel> cost_;
};

class BalancedBatchSampler::MicroBatchRange {
 public:
  class iterator {
   public:
    using value_type = MicroBatchRef;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    explicit iterator(BalancedBatchSampler* s) : sampler_(s) { ++*this; }
    const MicroBatchRef& operator*() const { return *current_; }
    const MicroBatchRef* operator->() const { return &*current_; }
    iterator& operator++() {
      current_ = sampler_->NextMicroBatch();
      return *this;
    }
    void operator++(int) { ++*this; }
    bool operator==(std::default_sentinel_t) const { return !current_.has_value(); }

   private:
    BalancedBatchSampler* sampler_ = nullptr;
    std::optional<MicroBatchRef> current_;
  };
  explicit MicroBatchRange(BalancedBatchSampler* s) : sampler_(s) {}
  iterator begin() { return iterator(sampler_); }
  std::default_sentinel_t end() { return {}; }

 private:
  BalancedBatchSampler* sampler_;
};

inline BalancedBatchSampler::MicroBatchRange BalancedBatchSampler::MicroBatches() {
  return MicroBatchRange(this);
}

}  // namespace ditscale::balance
