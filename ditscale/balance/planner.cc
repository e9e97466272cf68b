#include "ditscale/balance/planner.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <thread>

#include "ditscale/balance/internal/balanced.h"
#include "ditscale/balance/internal/balanced_sp.h"
#include "ditscale/balance/internal/buckets.h"
#include "ditscale/balance/internal/prefault.h"
#include "ditscale/balance/internal/prng.h"
#include "ditscale/core/error.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {
namespace {

using internal::SplitMix64;
using internal::StreamKey;

// Plans of this many samples on sort and shuffle their ids on a second thread.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

using internal::BalanceContext;
using internal::Chunk;
using internal::EmitStep;
using internal::ReservedMicroBatches;

std::vector<int64_t> ShapeCounts(const ShapedManifest& shaped) {
  if (shaped.count.size() == shaped.shapes.size()) return shaped.count;
  std::vector<int64_t> count(shaped.shapes.size(), 0);
  for (int32_t s : shaped.shape_of) ++count[s];
  return count;
}

// Equal-token / adaptive: step k gives micro-batch k * W + r to rank r.
void BuildOnePerRank(Plan& plan) {
  const int64_t w = plan.world_size;
  const int64_t n = static_cast<int64_t>(plan.micro_batches.size());
  plan.work.reserve(n);
  plan.rank_offsets.reserve((n + w - 1) / w * w + 1);
  for (int64_t i = 0; i < n; ++i) {
    plan.work.push_back(i);
    plan.rank_offsets.push_back(i + 1);
  }
  // Ranks without a micro-batch in the last step.
  while ((static_cast<int64_t>(plan.rank_offsets.size()) - 1) % w != 0) {
    plan.rank_offsets.push_back(n);
  }
}

// The last step is the tail when some rank has no micro-batch in it.
void ApplyTail(TailPolicy tail, Plan& plan) {
  const int64_t w = plan.world_size;
  const int64_t steps = plan.num_steps();
  if (steps == 0 || tail == TailPolicy::kKeep) return;
  const int64_t first = (steps - 1) * w;
  bool has_empty = false;
  for (int64_t r = 0; r < w; ++r) {
    if (plan.rank_offsets[first + r + 1] == plan.rank_offsets[first + r]) has_empty = true;
  }
  if (!has_empty) return;
  const int64_t wb = plan.rank_offsets[first], we = plan.rank_offsets[first + w];
  if (tail == TailPolicy::kDrop) {
    int64_t min_mb = static_cast<int64_t>(plan.micro_batches.size());
    for (int64_t i = wb; i < we; ++i) min_mb = std::min(min_mb, plan.work[i]);
    // Every micro-batch from min_mb on is in the tail, listed once per rank of its group.
    for (size_t m = min_mb; m < plan.micro_batches.size(); ++m) {
      plan.dropped_samples += plan.micro_batches[m].end - plan.micro_batches[m].begin;
    }
    // The tail's micro-batches are the last ones created.
    plan.micro_batches.resize(min_mb);
    plan.work.resize(wb);
    plan.rank_offsets.resize(first + 1);
    return;
  }
  // kPad: empty ranks repeat the cheapest micro-batch of the epoch on one rank (lowest index on
  // ties).
  int64_t pad = -1;
  for (int64_t m = 0; m < static_cast<int64_t>(plan.micro_batches.size()); ++m) {
    if (plan.micro_batches[m].sp_degree != 1) continue;
    if (pad < 0 ||
        plan.micro_batches[m].predicted_cost_s < plan.micro_batches[pad].predicted_cost_s) {
      pad = m;
    }
  }
  if (pad < 0) return;  // no one-rank micro-batch to repeat: the step stays partial (as 'keep')
  std::vector<std::vector<int64_t>> lists(w);
  for (int64_t r = 0; r < w; ++r) {
    for (int64_t i = plan.rank_offsets[first + r]; i < plan.rank_offsets[first + r + 1]; ++i) {
      lists[r].push_back(plan.work[i]);
    }
    if (lists[r].empty()) {
      lists[r].push_back(pad);
      ++plan.padded_micro_batches;
    }
  }
  plan.work.resize(wb);
  plan.rank_offsets.resize(first + 1);
  EmitStep(lists, plan);
}

}  // namespace

const char* PolicyName(Policy p) {
  switch (p) {
    case Policy::kEqualToken:
      return "equal-token";
    case Policy::kAdaptive:
      return "adaptive";
    case Policy::kBalanced:
      return "balanced";
  }
  return "?";
}

Result<Policy> ParsePolicy(const std::string& name) {
  if (name == "equal-token") return Policy::kEqualToken;
  if (name == "adaptive") return Policy::kAdaptive;
  if (name == "balanced") return Policy::kBalanced;
  return Failure::InvalidArgument("unknown policy '" + name +
                                  "' (expected equal-token, adaptive or balanced)");
}

const char* TailPolicyName(TailPolicy t) {
  switch (t) {
    case TailPolicy::kDrop:
      return "drop";
    case TailPolicy::kPad:
      return "pad";
    case TailPolicy::kKeep:
      return "keep";
  }
  return "?";
}

Result<TailPolicy> ParseTailPolicy(const std::string& name) {
  if (name == "drop") return TailPolicy::kDrop;
  if (name == "pad") return TailPolicy::kPad;
  if (name == "keep") return TailPolicy::kKeep;
  return Failure::InvalidArgument("unknown tail policy '" + name +
                                  "' (expected drop, pad or keep)");
}

int64_t EqualTokenBatch(int64_t seq_len, int64_t m_mem_tokens) {
  if (seq_len <= 0) return std::max<int64_t>(1, m_mem_tokens);
  return std::max<int64_t>(1, m_mem_tokens / seq_len);
}

int64_t DualConstraintBatch(int64_t seq_len, int64_t m_mem_tokens, double m_comp, double p) {
  const int64_t b_mem = EqualTokenBatch(seq_len, m_mem_tokens);
  if (m_comp <= 0 || seq_len <= 0) return b_mem;
  const double b_comp = std::floor(m_comp / std::pow(static_cast<double>(seq_len), p));
  if (b_comp >= static_cast<double>(b_mem)) return b_mem;
  return std::max<int64_t>(1, static_cast<int64_t>(b_comp));
}

int64_t RepresentativeSeqLen(const ShapedManifest& shaped) {
  const std::vector<int64_t> count = ShapeCounts(shaped);
  std::vector<int32_t> order(shaped.shapes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    return shaped.shapes[x].seq_len < shaped.shapes[y].seq_len;
  });
  double total = 0;
  for (size_t s = 0; s < count.size(); ++s) {
    total += static_cast<double>(count[s]) * static_cast<double>(shaped.shapes[s].seq_len);
  }
  if (total <= 0) return 0;
  double acc = 0;
  for (int32_t s : order) {
    acc += static_cast<double>(count[s]) * static_cast<double>(shaped.shapes[s].seq_len);
    if (acc >= total / 2) return shaped.shapes[s].seq_len;
  }
  return shaped.shapes[order.back()].seq_len;
}

double PlanExponent(const ShapedManifest& shaped, const CostModel& cost) {
  if (cost.kind == CostModel::Kind::kPower) return cost.p;
  const int64_t s = std::max<int64_t>(1, RepresentativeSeqLen(shaped));
  return cost.Exponent(s);
}

double DefaultRankBudget(const ShapedManifest& shaped, const CostModel& cost, double m_comp,
                         double p) {
  const int64_t s = std::max<int64_t>(1, RepresentativeSeqLen(shaped));
  return cost.a + cost.a_mb + m_comp * cost.Work(s) / std::pow(static_cast<double>(s), p);
}

double MinRankBudget(const ShapedManifest& shaped, const CostModel& cost) {
  const std::vector<int64_t> count = ShapeCounts(shaped);
  double max_unit = 0;
  for (size_t s = 0; s < shaped.shapes.size(); ++s) {
    if (count[s] > 0) {
      max_unit = std::max(max_unit, cost.a + cost.a_mb + cost.Work(shaped.shapes[s].seq_len));
    }
  }
  return max_unit;
}

namespace {

// The ranges of PlanOptions (planner.h).
std::optional<Failure> CheckOptions(const PlanOptions& options) {
  using LL = long long;
  std::optional<std::string> e =
      RangeError("world size", static_cast<LL>(options.world_size), 1, kMaxWorldSize);
  if (!e) {
    e = RangeError("M_mem (tokens per batch)", static_cast<LL>(options.m_mem_tokens), 1,
                   kMaxMMemTokens);
  }
  if (!e) e = RangeError("M_comp (0: automatic)", options.m_comp, 0.0, kMaxMComp);
  if (!e) {
    e = RangeError("rank budget (s, 0: default)", options.rank_budget_s, 0.0, kMaxRankBudgetS);
  }
  if (!e) {
    e = RangeError("epoch", static_cast<LL>(options.epoch), 0, std::numeric_limits<int64_t>::max());
  }
  if (e) return Failure::InvalidArgument(*e);
  return std::nullopt;
}

// The manifest's ids and shape indices agree; *bucket_begin: bucket s holds ids
// [bucket_begin[s], bucket_begin[s + 1]) of the plan (internal/buckets.h).
std::optional<Failure> CheckShaped(const ShapedManifest& shaped,
                                   std::vector<int64_t>* bucket_begin) {
  if (shaped.ids_dense && !shaped.ids.empty()) {
    return Failure::InvalidArgument("shaped manifest: ids_dense but ids has " +
                                    std::to_string(shaped.ids.size()) + " entries");
  }
  if (!shaped.ids_dense && shaped.shape_of.size() != shaped.ids.size()) {
    return Failure::InvalidArgument("shaped manifest: shape_of has " +
                                    std::to_string(shaped.shape_of.size()) +
                                    " entries but ids has " + std::to_string(shaped.ids.size()));
  }
  const int32_t num_shapes = static_cast<int32_t>(shaped.shapes.size());
  bucket_begin->assign(num_shapes + 1, 0);
  for (int32_t s : shaped.shape_of) {
    if (s < 0 || s >= num_shapes) {
      return Failure::InvalidArgument("shaped manifest: shape index " + std::to_string(s) +
                                      " out of range [0, " + std::to_string(num_shapes) + ")");
    }
    ++(*bucket_begin)[s + 1];
  }
  for (int32_t s = 0; s < num_shapes; ++s) (*bucket_begin)[s + 1] += (*bucket_begin)[s];
  return std::nullopt;
}

// The cost model's overheads, and a manifest that can make at least one step.
std::optional<Failure> CheckCostAndSize(const ShapedManifest& shaped, const CostModel& cost,
                                        const PlanOptions& options) {
  if (!(cost.a >= 0) || !std::isfinite(cost.a)) {
    return Failure::InvalidArgument("cost model: overhead a must be finite and >= 0, got " +
                                    std::to_string(cost.a));
  }
  if (!(cost.a_mb >= 0) || !std::isfinite(cost.a_mb)) {
    return Failure::InvalidArgument(
        "cost model: per-micro-batch overhead a_mb must be finite and >= 0, got " +
        std::to_string(cost.a_mb));
  }
  const int64_t num_samples = static_cast<int64_t>(shaped.shape_of.size());
  if (num_samples == 0) {
    return Failure::InvalidArgument("the manifest has no samples: there is nothing to plan");
  }
  if (options.tail == TailPolicy::kDrop && options.world_size > num_samples) {
    return Failure::Infeasible(
        "world size " + std::to_string(options.world_size) + " exceeds the " +
        std::to_string(num_samples) +
        " samples: under tail policy 'drop' no step can give every rank a micro-batch "
        "(use fewer ranks, or tail policy 'pad' or 'keep')");
  }
  return std::nullopt;
}

// Work(S) of every shape; a failure when a shape with samples has no positive, finite work.
Result<std::vector<double>> WorkOfShapes(const ShapedManifest& shaped, const CostModel& cost,
                                         const std::vector<int64_t>& count) {
  std::vector<double> work_of_shape(shaped.shapes.size(), 0.0);
  for (size_t s = 0; s < shaped.shapes.size(); ++s) {
    work_of_shape[s] = cost.Work(shaped.shapes[s].seq_len);
    if (count[s] > 0 && !(work_of_shape[s] > 0 && std::isfinite(work_of_shape[s]))) {
      return Failure::InvalidArgument(
          "cost model (" + cost.source + ") predicts work " + std::to_string(work_of_shape[s]) +
          " s for S = " + std::to_string(shaped.shapes[s].seq_len) + " tokens; it must be > 0");
    }
  }
  return work_of_shape;
}

// The plan's settings: options, exponent p, M_comp (chosen when 0) and B per shape.
Plan StartPlan(const ShapedManifest& shaped, const CostModel& cost, const PlanOptions& options,
               const std::vector<int64_t>& count) {
  Plan plan;
  plan.policy = options.policy;
  plan.world_size = options.world_size;
  plan.seed = options.seed;
  plan.epoch = options.epoch;
  plan.m_mem_tokens = options.m_mem_tokens;
  plan.overhead_per_micro_batch = options.overhead_per_micro_batch;
  plan.p = PlanExponent(shaped, cost);
  if (options.policy != Policy::kEqualToken) {
    plan.m_comp =
        options.m_comp > 0 ? options.m_comp : ChooseMComp(shaped, cost, options, plan.p).m_comp;
  }
  plan.batch_size_of_shape.resize(shaped.shapes.size());
  for (size_t s = 0; s < shaped.shapes.size(); ++s) {
    const int64_t len = shaped.shapes[s].seq_len;
    plan.batch_size_of_shape[s] =
        options.policy == Policy::kEqualToken
            ? EqualTokenBatch(len, options.m_mem_tokens)
            : DualConstraintBatch(len, options.m_mem_tokens, plan.m_comp, plan.p);
    if (len > options.m_mem_tokens) plan.samples_over_m_mem += count[s];
  }
  return plan;
}

bool UseHelperThreads(int64_t num_samples) {
  return num_samples >= kParallelSamples && std::thread::hardware_concurrency() >= 2;
}

// The shuffled ids are only needed in the finished plan: from kParallelSamples samples on they
// are sorted and shuffled on a second thread (the returned one) while the micro-batches and steps
// are built from the bucket bounds alone; below that, here. Errors land in *error.
std::jthread SortIds(const ShapedManifest& shaped, const PlanOptions& options,
                     internal::Buckets* buckets, std::exception_ptr* error) {
  auto sort_ids = [&shaped, &options, buckets, error] {
    try {
      *buckets = internal::SortAndShuffle(shaped, options.seed, options.epoch);
    } catch (...) {
      *error = std::current_exception();
    }
  };
  if (UseHelperThreads(static_cast<int64_t>(shaped.shape_of.size()))) {
    return std::jthread(sort_ids);
  }
  sort_ids();
  return {};
}

// Reserves the chunks of B(S) samples per shape. Every chunk becomes at least one micro-batch
// with one entry in work: for large plans those pages are mapped on the returned helper thread
// while this one fills them (internal/prefault.h); join it before the arrays are freed.
std::jthread ReserveChunks(const std::vector<int64_t>& count, const PlanOptions& options,
                           int64_t num_samples, std::vector<Chunk>* chunks, Plan* plan) {
  int64_t n = 0;
  for (size_t s = 0; s < count.size(); ++s) {
    const int64_t b = plan->batch_size_of_shape[s];  // 0: no fitting degree (planner_sp.cc)
    if (b > 0) n += (count[s] + b - 1) / b;
  }
  chunks->reserve(n);
  if (!UseHelperThreads(num_samples)) return {};
  const size_t mbs = options.policy == Policy::kBalanced ? ReservedMicroBatches(n) : n;
  plan->micro_batches.reserve(mbs);
  plan->work.reserve(mbs);
  return std::jthread([c = chunks->data(), mb = plan->micro_batches.data(),
                       work = plan->work.data(), n = static_cast<size_t>(n)] {
    internal::PrefaultForWrite(c, n * sizeof(Chunk));
    internal::PrefaultForWrite(mb, n * sizeof(MicroBatch));
    internal::PrefaultForWrite(work, n * sizeof(int64_t));
  });
}

// Cuts each bucket into chunks of B(S) samples (the last one of a bucket may be smaller) and
// shuffles their order by (seed, epoch).
void CutChunks(const std::vector<int64_t>& bucket_begin, const std::vector<int64_t>& batch_size,
               const PlanOptions& options, std::vector<Chunk>* chunks) {
  for (size_t s = 0; s + 1 < bucket_begin.size(); ++s) {
    const int64_t b = batch_size[s];
    if (b == 0) continue;  // fits at no sequence-parallel degree: dropped (planner_sp.cc)
    for (int64_t i = bucket_begin[s]; i < bucket_begin[s + 1]; i += b) {
      chunks->push_back(Chunk{i, std::min(i + b, bucket_begin[s + 1]), static_cast<int32_t>(s)});
    }
  }
  SplitMix64 rng(StreamKey(options.seed, options.epoch, internal::kMicroBatchOrder));
  internal::PrefetchedShuffle(chunks->data(), static_cast<int64_t>(chunks->size()), rng);
}

// Balanced: the budget (given, or the default raised to MinRankBudget), then the steps.
std::optional<Failure> BuildBalancedPlan(const ShapedManifest& shaped, const CostModel& cost,
                                         const PlanOptions& options,
                                         std::vector<double> work_of_shape,
                                         const std::vector<Chunk>& chunks, Plan& plan) {
  const double max_unit = MinRankBudget(shaped, cost, options);  // {1}: fitting samples
  if (options.rank_budget_s > 0 && options.rank_budget_s < max_unit) {
    return Failure::InvalidArgument(
        "rank budget " + FormatNumber(options.rank_budget_s) +
        " s is below the cost of the most expensive sample, " + FormatNumber(max_unit) +
        " s (a + a_mb + Work(S)): every sample must fit one rank's step; give a budget >= " +
        FormatNumber(max_unit) + " s, or 0 for the default");
  }
  BalanceContext ctx;
  ctx.shaped = &shaped;
  ctx.cost = &cost;
  ctx.work_of_shape = std::move(work_of_shape);
  ctx.step_overhead = cost.a;
  ctx.mb_overhead = cost.a_mb;
  const double requested = options.rank_budget_s > 0
                               ? options.rank_budget_s
                               : DefaultRankBudget(shaped, cost, plan.m_comp, plan.p);
  ctx.budget = std::max(requested, max_unit);
  plan.rank_budget_raised = requested < max_unit;
  ctx.lookahead = 8 * static_cast<int64_t>(options.world_size) + 32;
  plan.rank_budget_s = ctx.budget;
  internal::BuildBalanced(chunks, ctx, plan);
  return std::nullopt;
}

// Equal-token / adaptive: one micro-batch per chunk, one per rank and step.
void BuildOnePerRankPlan(const ShapedManifest& shaped, const CostModel& cost,
                         const std::vector<Chunk>& chunks, Plan& plan) {
  plan.micro_batches.reserve(chunks.size());
  for (const Chunk& c : chunks) {
    plan.micro_batches.push_back(MicroBatch{
        c.begin, c.end, c.shape, cost.StepTime(c.end - c.begin, shaped.shapes[c.shape].seq_len)});
  }
  BuildOnePerRank(plan);
}

// The tail policy, then a plan without any step is a failure that says why.
Result<Plan> FinishPlan(const PlanOptions& options, int64_t num_samples, Plan plan) {
  const int64_t micro_batches = static_cast<int64_t>(plan.micro_batches.size());
  ApplyTail(options.tail, plan);
  if (plan.num_steps() == 0) {
    return Failure::Infeasible(
        "the plan has no step: " + std::to_string(num_samples) + " samples make " +
        std::to_string(micro_batches) + " micro-batches under policy '" +
        PolicyName(options.policy) + "', fewer than world size " +
        std::to_string(options.world_size) + " needs for one step, and tail policy '" +
        TailPolicyName(options.tail) +
        "' drops a last step in which some rank has none (use fewer ranks, or tail policy "
        "'pad' or 'keep')");
  }
  return plan;
}

}  // namespace

// Check -> settings -> chunks -> steps -> tail (the order of work: planner.h).
Result<Plan> MakePlan(const ShapedManifest& shaped, const CostModel& cost_in,
                      const PlanOptions& options) {
  const CostModel cost =
      options.overhead_per_micro_batch ? OverheadPerMicroBatch(cost_in) : cost_in;
  std::vector<int64_t> bucket_begin;
  if (auto f = CheckOptions(options)) return *f;
  if (auto f = CheckShaped(shaped, &bucket_begin)) return *f;
  if (auto f = CheckCostAndSize(shaped, cost, options)) return *f;
  if (auto f = internal::CheckSpOptions(shaped, options)) return *f;
  const bool sp = !options.sp_degrees.empty();
  const std::vector<int64_t> count = ShapeCounts(shaped);
  Result<std::vector<double>> work_of_shape = WorkOfShapes(shaped, cost, count);
  if (!work_of_shape.ok()) return work_of_shape.failure();
  const int64_t num_samples = static_cast<int64_t>(shaped.shape_of.size());

  Plan plan = StartPlan(shaped, cost, options, count);
  if (sp) internal::SetSpBatchSizes(shaped, options, count, plan);
  internal::Buckets buckets;
  std::exception_ptr buckets_error;
  std::jthread ids_worker = SortIds(shaped, options, &buckets, &buckets_error);
  std::vector<Chunk> chunks;
  // Declared after chunks and plan: joined before their arrays are freed.
  std::jthread prefault = ReserveChunks(count, options, num_samples, &chunks, &plan);
  CutChunks(bucket_begin, plan.batch_size_of_shape, options, &chunks);
  plan.rank_offsets.push_back(0);
  if (sp && options.sp_degrees != std::vector<int>{1}) {
    if (auto f = internal::BuildSpPlan(shaped, cost, options, std::move(work_of_shape).value(),
                                       count, chunks, plan)) {
      return *f;
    }
  } else if (options.policy == Policy::kBalanced) {
    if (auto f = BuildBalancedPlan(shaped, cost, options, std::move(work_of_shape).value(), chunks,
                                   plan)) {
      return *f;
    }
  } else {
    BuildOnePerRankPlan(shaped, cost, chunks, plan);
  }
  if (prefault.joinable()) prefault.join();
  if (ids_worker.joinable()) ids_worker.join();
  if (buckets_error) std::rethrow_exception(buckets_error);
  DS_CHECK(buckets.begin == bucket_begin, "bucket bounds differ from the shape counts");
  plan.ids = std::move(buckets.ids);
  return FinishPlan(options, num_samples, std::move(plan));
}

}  // namespace ditscale::balance
