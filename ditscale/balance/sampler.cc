#include "ditscale/balance/sampler.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {
namespace {

// splitmix64 finaliser: a cheap, well-mixed step for the fingerprint.
uint64_t Mix(uint64_t h, uint64_t v) {
  uint64_t x = h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2));
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// CheckRange for any integer type (int, int64_t) without overload ambiguity.
void CheckInt(std::string_view name, long long v, long long lo, long long hi) {
  CheckRange(name, v, lo, hi);
}

// User-input refusals (a state, an epoch): a plain message, no source location.
template <typename... Args>
[[noreturn]] void Refuse(const Args&... args) {
  throw Error(internal::StrCat(args...));
}
template <typename... Args>
void Check(bool ok, const Args&... args) {
  if (!ok) Refuse(args...);
}

// "the plan of epoch e has no step: ..." with the counts that explain it.
std::string NoStepMessage(const Plan& plan, int64_t epoch) {
  std::string m = "the plan of epoch " + std::to_string(epoch) +
                  " has no step: " + std::to_string(plan.ids.size()) + " samples for world_size " +
                  std::to_string(plan.world_size);
  if (plan.dropped_samples > 0) {
    m += ", all " + std::to_string(plan.dropped_samples) +
         " dropped by the tail policy (too few to fill one step on every rank): use fewer "
         "ranks, tail 'keep' or 'pad', or more samples";
  }
  return m;
}

}  // namespace

std::optional<std::string> SamplerConfigError(const SamplerConfig& c, int rank, int world_size) {
  using LL = long long;
  if (auto e = RangeError("world_size", LL{world_size}, 1, kMaxWorldSize)) return e;
  if (auto e = RangeError("rank", LL{rank}, 0, LL{world_size} - 1)) return e;
  if (auto e = RangeError("epoch", LL{c.plan.epoch}, 0, kMaxEpoch)) return e;
  if (auto e = RangeError("m_mem_tokens", LL{c.plan.m_mem_tokens}, 0, kMaxMMemTokens)) return e;
  if (auto e = RangeError("gpu_mem_gib", c.gpu_mem_gib, kMinGpuMemGib, kMaxGpuMemGib)) return e;
  if (auto e = RangeError("mem_safety", c.mem_safety, 0, kMaxMemSafety)) return e;
  if (auto e = RangeError("m_comp", c.plan.m_comp, 0, kMaxMComp)) return e;
  if (auto e = RangeError("rank_budget_s", c.plan.rank_budget_s, 0, kMaxRankBudgetS)) return e;
  if (!c.plan.sp_degrees.empty()) {
    if (auto e = SpDegreesError(c.plan.sp_degrees, world_size, "sp_degrees")) return e;
    if (c.plan.policy != Policy::kBalanced) {
      return std::string("sp_degrees: needs policy 'balanced' (got '") + PolicyName(c.plan.policy) +
             "'): only the balanced policy plans sequence-parallel "
             "groups";
    }
  }
  return std::nullopt;
}

uint64_t PlanFingerprint(const Plan& plan) {
  uint64_t h = Mix(0x6469747363616c65ULL, static_cast<uint64_t>(plan.world_size));
  h = Mix(h, plan.seed);
  h = Mix(h, static_cast<uint64_t>(plan.epoch));
  h = Mix(h, plan.ids.size());
  for (int64_t id : plan.ids) h = Mix(h, static_cast<uint64_t>(id));
  h = Mix(h, plan.micro_batches.size());
  for (const MicroBatch& mb : plan.micro_batches) {
    h = Mix(h, static_cast<uint64_t>(mb.begin));
    h = Mix(h, static_cast<uint64_t>(mb.end));
  }
  h = Mix(h, plan.work.size());
  for (int64_t w : plan.work) h = Mix(h, static_cast<uint64_t>(w));
  for (int64_t o : plan.rank_offsets) h = Mix(h, static_cast<uint64_t>(o));
  if (!plan.sp_degrees.empty()) {  // absent: the fingerprint of a plan without degrees as before
    h = Mix(h, plan.sp_degrees.size());
    for (int d : plan.sp_degrees) h = Mix(h, static_cast<uint64_t>(d));
    for (const MicroBatch& mb : plan.micro_batches) h = Mix(h, static_cast<uint64_t>(mb.sp_degree));
  }
  return h == 0 ? 1 : h;
}

void CheckPlanStructure(const Plan& plan, int world_size) {
  DS_CHECK(plan.world_size == world_size, "plan is for world_size ", plan.world_size,
           ", sampler for ", world_size);
  DS_CHECK(!plan.rank_offsets.empty(), "plan.rank_offsets is empty (needs num_steps*world+1)");
  const int64_t cells = static_cast<int64_t>(plan.rank_offsets.size()) - 1;
  DS_CHECK(cells % world_size == 0, "plan.rank_offsets has ", cells + 1,
           " entries, not a multiple of world_size ", world_size, " plus one");
  DS_CHECK(plan.rank_offsets.front() == 0, "plan.rank_offsets[0] is ", plan.rank_offsets.front());
  DS_CHECK(plan.rank_offsets.back() == static_cast<int64_t>(plan.work.size()),
           "plan.rank_offsets ends at ", plan.rank_offsets.back(), " but plan.work has ",
           plan.work.size(), " entries");
  for (size_t i = 1; i < plan.rank_offsets.size(); ++i) {
    DS_CHECK(plan.rank_offsets[i] >= plan.rank_offsets[i - 1],
             "plan.rank_offsets decreases at cell ", i - 1);
  }
  const int64_t num_mb = static_cast<int64_t>(plan.micro_batches.size());
  for (size_t i = 0; i < plan.work.size(); ++i) {
    DS_CHECK(plan.work[i] >= 0 && plan.work[i] < num_mb, "plan.work[", i, "] = ", plan.work[i],
             " is not a micro-batch index (", num_mb, " micro-batches)");
  }
  const int64_t num_ids = static_cast<int64_t>(plan.ids.size());
  for (size_t i = 0; i < plan.micro_batches.size(); ++i) {
    const MicroBatch& mb = plan.micro_batches[i];
    DS_CHECK(mb.begin >= 0 && mb.begin < mb.end && mb.end <= num_ids, "plan.micro_batches[", i,
             "] = [", mb.begin, ", ", mb.end, ") is not a non-empty range of plan.ids (", num_ids,
             " ids)");
  }
}

BalancedBatchSampler::BalancedBatchSampler(EpochPlanner planner, int rank, int world_size)
    : planner_(std::move(planner)), rank_(rank), world_size_(world_size) {}

Result<BalancedBatchSampler> BalancedBatchSampler::Create(EpochPlanner planner, int rank,
                                                          int world_size, int64_t epoch) {
  CheckInt("world_size", world_size, 1, kMaxWorldSize);
  CheckInt("rank", rank, 0, world_size - 1);
  CheckInt("epoch", epoch, 0, kMaxEpoch);
  DS_CHECK(planner != nullptr, "planner is empty");
  BalancedBatchSampler s(std::move(planner), rank, world_size);
  Result<Plan> plan = s.PlanEpoch(epoch);
  if (!plan.ok()) return plan.failure();
  s.Adopt(std::move(plan).value(), epoch);
  return s;
}

Result<BalancedBatchSampler> BalancedBatchSampler::FromShaped(ShapedManifest shaped, CostModel cost,
                                                              PlanOptions options, int rank,
                                                              int world_size) {
  options.world_size = world_size;
  const int64_t first_epoch = options.epoch;
  auto shared = std::make_shared<const ShapedManifest>(std::move(shaped));
  EpochPlanner planner = [shared, cost, options](int64_t e) {
    PlanOptions o = options;
    o.epoch = e;
    return MakePlan(*shared, cost, o);
  };
  Result<BalancedBatchSampler> s = Create(std::move(planner), rank, world_size, first_epoch);
  if (!s.ok()) return s.failure();
  s->shaped_ = std::move(shared);
  s->cost_ = std::move(cost);
  return s;
}

Result<BalancedBatchSampler> BalancedBatchSampler::FromConfig(const SamplerConfig& config, int rank,
                                                              int world_size) {
  if (auto e = SamplerConfigError(config, rank, world_size)) return Failure::InvalidArgument(*e);
  Result<Manifest> manifest = config.manifest
                                  ? Result<Manifest>(*config.manifest)
                                  : ReadManifest(config.manifest_path, config.manifest_options);
  if (!manifest.ok()) return manifest.failure();
  Result<ModelPreset> model = ResolveModel(config.model);
  if (!model.ok()) return model.failure();

  SamplerInputs in;
  in.manifest_source = manifest->source;
  in.rows_total = manifest->rows_total;
  in.rows_skipped = manifest->rows_skipped;
  in.skipped_examples = manifest->skipped_examples;
  in.num_samples = static_cast<int64_t>(manifest->ids.size());
  in.model = model->name;

  MemoryModel memory = AnalyticalMemory(*model);
  if (!config.cost_path.empty() && !config.bench_path.empty()) {
    return Failure::InvalidArgument("give at most one of cost and bench", "bench");
  }
  if (!config.bench_path.empty()) {
    Result<BenchTable> table = ReadBenchCsv(config.bench_path);
    if (!table.ok()) return table.failure();
    Result<FitResult> fit = FitBench(*table);
    if (!fit.ok()) return fit.failure();
    in.cost = fit->best().model;
    if (fit->memory) memory = fit->memory->model;
  } else if (config.cost_path.empty()) {
    in.cost = AnalyticalCost(*model);
  } else {
    MemoryModel loaded;
    Result<CostModel> cost = LoadCostModel(config.cost_path, &loaded);
    if (!cost.ok()) return cost.failure();
    in.cost = *cost;
    if (loaded.m1 > 0) memory = loaded;  // the file's memory model when it has one
  }

  PlanOptions options = config.plan;
  if (options.m_mem_tokens <= 0) {
    const double bytes = config.gpu_mem_gib * 1024.0 * 1024.0 * 1024.0;
    options.m_mem_tokens = memory.MaxTokens(bytes, config.mem_safety);
    if (options.m_mem_tokens <= 0) {
      return Failure::Infeasible("model " + model->name + " does not fit in " +
                                     FormatNumber(config.gpu_mem_gib) +
                                     " GiB (memory model m0 = " + std::to_string(memory.m0) +
                                     " bytes): give m_mem_tokens or a larger gpu_mem_gib",
                                 "gpu_mem_gib");
    }
    in.memory = memory;
  }
  in.m_mem_tokens = options.m_mem_tokens;

  ShapedManifest shaped = ShapeManifest(*manifest, *model);
  in.num_shapes = static_cast<int64_t>(shaped.shapes.size());
  if (!options.sp_degrees.empty()) {
    std::sort(options.sp_degrees.begin(), options.sp_degrees.end());
    Result<std::vector<double>> comm =
        UlyssesCommPerSample(*model, shaped.shapes, options.sp_degrees, config.sp_topology);
    if (!comm.ok()) return comm.failure();
    options.sp_comm_per_sample_s = std::move(comm).value();
  }
  Result<BalancedBatchSampler> s =
      FromShaped(std::move(shaped), in.cost, options, rank, world_size);
  if (!s.ok()) return s.failure();
  s->inputs_ = std::move(in);
  return s;
}

Result<Plan> BalancedBatchSampler::PlanEpoch(int64_t epoch) const {
  Result<Plan> plan = planner_(epoch);
  if (!plan.ok()) return plan.failure();
  CheckPlanStructure(*plan, world_size_);
  if (plan->num_steps() == 0) return Failure::Infeasible(NoStepMessage(*plan, epoch));
  return plan;
}

void BalancedBatchSampler::Adopt(Plan plan, int64_t epoch) {
  plan_ = std::move(plan);
  epoch_ = epoch;
  fingerprint_ = PlanFingerprint(plan_);
  rank_micro_batches_ = 0;
  for (int64_t k = 0; k < NumSteps(); ++k) rank_micro_batches_ += MicroBatchesInCell(k, rank_);
  Reset();
}

void BalancedBatchSampler::SetEpoch(int64_t e) {
  CheckInt("epoch", e, 0, kMaxEpoch);
  if (e == epoch_) return;  // keeps the cursor, e.g. one set by LoadState
  Result<Plan> plan = PlanEpoch(e);
  if (!plan.ok()) Refuse("planning epoch ", e, " failed: ", plan.failure().ToString());
  Adopt(std::move(plan).value(), e);
}

void BalancedBatchSampler::Reset() {
  step_ = 0;
  micro_batch_ = 0;
  consumed_ = 0;
}

int64_t BalancedBatchSampler::RemainingMicroBatches() const {
  return rank_micro_batches_ - consumed_;
}

int64_t BalancedBatchSampler::RemainingSteps() const {
  const SamplerState s = State();
  return NumSteps() - s.step;
}

int64_t BalancedBatchSampler::MicroBatchesInCell(int64_t step, int rank) const {
  DS_CHECK(step >= 0 && step < NumSteps(), "step ", step, " out of [0, ", NumSteps(), ")");
  DS_CHECK(rank >= 0 && rank < world_size_, "rank ", rank, " out of [0, ", world_size_, ")");
  return CellBegin(step, rank + 1) - CellBegin(step, rank);
}

MicroBatchRef BalancedBatchSampler::MakeRef(int64_t step, int rank, int64_t index) const {
  const int64_t begin = CellBegin(step, rank);
  const int64_t count = CellBegin(step, rank + 1) - begin;
  const MicroBatch& mb = plan_.micro_batches[static_cast<size_t>(plan_.work[begin + index])];
  MicroBatchRef ref;
  ref.ids =
      std::span<const int64_t>(plan_.ids.data() + mb.begin, static_cast<size_t>(mb.end - mb.begin));
  ref.step = step;
  ref.index_in_step = static_cast<int32_t>(index);
  ref.micro_batches_in_step = static_cast<int32_t>(count);
  ref.last_of_step = index + 1 == count;
  ref.shape = mb.shape;
  ref.predicted_cost_s = mb.predicted_cost_s;
  ref.sp_degree = mb.sp_degree;
  return ref;
}

std::vector<MicroBatchRef> BalancedBatchSampler::Cell(int64_t step, int rank) const {
  const int64_t count = MicroBatchesInCell(step, rank);
  std::vector<MicroBatchRef> out;
  out.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out.push_back(MakeRef(step, rank, i));
  return out;
}

std::optional<MicroBatchRef> BalancedBatchSampler::NextMicroBatch() {
  while (step_ < NumSteps() && micro_batch_ >= MicroBatchesInCell(step_, rank_)) {
    ++step_;
    micro_batch_ = 0;
  }
  if (step_ >= NumSteps()) return std::nullopt;
  MicroBatchRef ref = MakeRef(step_, rank_, micro_batch_);
  ++micro_batch_;
  ++consumed_;
  return ref;
}

bool BalancedBatchSampler::NextStep(std::vector<MicroBatchRef>* micro_batches) {
  micro_batches->clear();
  // A step left finished by NextMicroBatch counts as done.
  if (step_ < NumSteps() && micro_batch_ > 0 && micro_batch_ >= MicroBatchesInCell(step_, rank_)) {
    ++step_;
    micro_batch_ = 0;
  }
  if (step_ >= NumSteps()) return false;
  const int64_t count = MicroBatchesInCell(step_, rank_);
  for (int64_t i = micro_batch_; i < count; ++i) micro_batches->push_back(MakeRef(step_, rank_, i));
  consumed_ += count - micro_batch_;
  ++step_;
  micro_batch_ = 0;
  return true;
}

SamplerState BalancedBatchSampler::State() const {
  SamplerState s;
  s.epoch = epoch_;
  s.step = step_;
  s.micro_batch = micro_batch_;
  if (s.step < NumSteps() && s.micro_batch > 0 &&
      s.micro_batch >= MicroBatchesInCell(s.step, rank_)) {
    ++s.step;
    s.micro_batch = 0;
  }
  s.seed = plan_.seed;
  s.world_size = world_size_;
  s.rank = rank_;
  s.plan_fingerprint = fingerprint_;
  return s;
}

void BalancedBatchSampler::LoadState(const SamplerState& state) {
  CheckInt("state.epoch", state.epoch, 0, kMaxEpoch);
  CheckInt("state.world_size", state.world_size, 1, kMaxWorldSize);
  CheckInt("state.rank", state.rank, 0, state.world_size - 1);
  Check(state.world_size == world_size_, "state.world_size: the state is for world_size ",
        state.world_size, ", this sampler has world_size ", world_size_);
  Check(state.plan_fingerprint != 0,
        "state.plan_fingerprint: 0 is not a plan fingerprint (a state without one cannot be "
        "checked against this sampler's plan)");
  Check(state.rank == rank_ || state.micro_batch == 0, "state.rank: the state was saved on rank ",
        state.rank, " in the middle of step ", state.step, " (micro_batch ", state.micro_batch,
        ") and counts that rank's micro-batches; this sampler is rank ", rank_,
        ": load each rank's own state, or one saved at a step boundary "
        "(state_dict(consumed_steps=k))");
  // Plan the state's epoch aside, so that a refused state leaves the sampler as it was.
  std::optional<Plan> other;
  const Plan* plan = &plan_;
  uint64_t fingerprint = fingerprint_;
  if (state.epoch != epoch_) {
    Result<Plan> p = PlanEpoch(state.epoch);
    if (!p.ok())
      Refuse("state.epoch: planning epoch ", state.epoch, " failed: ", p.failure().ToString());
    other = std::move(p).value();
    plan = &*other;
    fingerprint = PlanFingerprint(*plan);
  }
  Check(state.seed == plan->seed, "state.seed: ", state.seed, " differs from the sampler's seed ",
        plan->seed);
  Check(state.plan_fingerprint == fingerprint, "state.plan_fingerprint: ", state.plan_fingerprint,
        " differs from this sampler's plan of epoch ", state.epoch, " (", fingerprint,
        "): the state was saved on another manifest, model, cost model or plan options (sp_degrees "
        "included)");
  const int64_t num_steps = plan->num_steps();
  CheckInt("state.step", state.step, 0, num_steps);
  auto cell_size = [&](int64_t k) {
    const size_t c = static_cast<size_t>(k * world_size_ + rank_);
    return plan->rank_offsets[c + 1] - plan->rank_offsets[c];
  };
  const int64_t cell = state.step < num_steps ? cell_size(state.step) : 0;
  if (auto e = RangeError("state.micro_batch", static_cast<long long>(state.micro_batch), 0,
                          static_cast<long long>(cell))) {
    Refuse(*e, " (micro-batches of step ", state.step, " on rank ", rank_, ")");
  }
  if (other) Adopt(std::move(*other), state.epoch);
  step_ = state.step;
  micro_batch_ = state.micro_batch;
  consumed_ = micro_batch_;
  for (int64_t k = 0; k < step_; ++k) consumed_ += MicroBatchesInCell(k, rank_);
}

}  // namespace ditscale::balance
