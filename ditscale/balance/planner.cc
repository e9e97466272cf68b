#include "ditscale/balance/planner.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <thread>

#include "ditscale/balance/internal/buckets.h"
#include "ditscale/balance/internal/fast_floor.h"
#include "ditscale/balance/internal/partition.h"
#include "ditscale/balance/internal/prefault.h"
#include "ditscale/balance/internal/prng.h"
#include "ditscale/core/error.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {
namespace {

using internal::FastFloor;
using internal::SplitMix64;
using internal::StreamKey;

// Plans of this many samples on sort and shuffle their ids on a second thread.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

struct Chunk {
  int64_t begin = 0;
  int64_t end = 0;
  int32_t shape = 0;
};

std::vector<int64_t> ShapeCounts(const ShapedManifest& shaped) {
  if (shaped.count.size() == shaped.shapes.size()) return shaped.count;
  std::vector<int64_t> count(shaped.shapes.size(), 0);
  for (int32_t s : shaped.shape_of) ++count[s];
  return count;
}

// Writes the per-rank micro-batch lists of one step into plan.work / plan.rank_offsets.
void EmitStep(const std::vector<std::vector<int64_t>>& lists, Plan& plan) {
  for (const auto& l : lists) {
    plan.work.insert(plan.work.end(), l.begin(), l.end());
    plan.rank_offsets.push_back(static_cast<int64_t>(plan.work.size()));
  }
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

// Micro-batches reserved for a balanced plan of `chunks` chunks: the cut, the LPT and the gap
// filling split chunks (10M samples at 16 ranks: 1.92 micro-batches a chunk). Beyond the
// reservation the arrays grow (a copy and fresh pages of everything so far); a reservation that
// is not used is address space only.
size_t ReservedMicroBatches(int64_t chunks) { return static_cast<size_t>(2 * chunks + 16); }

// One (rank, slice, samples) entry of a balanced step's LPT assignment.
struct Assign {
  int32_t rank;
  int32_t slice;
  int64_t count;
};

// *order = 0..sel.size()-1 sorted by descending work per sample of the slice's shape, ties in
// slice order (std::stable_sort's order): an insertion sort, the ~20 slices of a step need no
// buffer.
void SortByWorkStable(const std::vector<Chunk>& sel, const std::vector<double>& work_of_shape,
                      std::vector<int32_t>* order) {
  const int32_t m = static_cast<int32_t>(sel.size());
  order->resize(m);
  int32_t* o = order->data();
  for (int32_t i = 0; i < m; ++i) {
    const double u = work_of_shape[sel[i].shape];
    int32_t k = i;
    for (; k > 0 && work_of_shape[sel[o[k - 1]].shape] < u; --k) o[k] = o[k - 1];
    o[k] = i;
  }
}

// *sorted = `assign` ordered by (rank, slice) (every pair occurs once): counted by rank, then an
// insertion sort by slice within each rank (a rank holds a few entries). scratch: 2 * w + 1.
void SortRankMajor(const std::vector<Assign>& assign, int32_t w, std::vector<int32_t>* scratch,
                   std::vector<Assign>* sorted) {
  scratch->assign(2 * static_cast<size_t>(w) + 1, 0);
  int32_t* begin = scratch->data();  // begin[r]: rank r's first position (w + 1 entries)
  int32_t* end = begin + w + 1;      // end[r]: one past its last entry placed so far
  for (const Assign& a : assign) ++begin[a.rank + 1];
  for (int32_t r = 0; r < w; ++r) begin[r + 1] += begin[r];
  for (int32_t r = 0; r < w; ++r) end[r] = begin[r];
  sorted->resize(assign.size());
  Assign* out = sorted->data();
  for (const Assign& a : assign) {
    int32_t k = end[a.rank]++;
    for (; k > begin[a.rank] && out[k - 1].slice > a.slice; --k) out[k] = out[k - 1];
    out[k] = a;
  }
}

struct BalanceContext {
  const ShapedManifest* shaped;
  const CostModel* cost;
  std::vector<double> work_of_shape;  // Work(S) per shape
  double step_overhead = 0;           // a once per (step, rank) with work
  double mb_overhead = 0;             // a per micro-batch
  double budget = 0;                  // effective per-rank budget
  int64_t lookahead = 0;              // chunks beyond the cut that may fill gaps
  // cost->StepTime(count, seq_len of `shape`): the same sum, with Work(S) taken from the table.
  double StepTime(int64_t count, int32_t shape) const {
    return cost->a + (cost->a_mb + static_cast<double>(count) * work_of_shape[shape]);
  }
};

// Balanced (see planner.h): each step cuts the next world_size * (budget - a_step) seconds of
// work from the shuffled micro-batch stream (splitting the micro-batch that crosses the cut) and
// assigns its samples to ranks by LPT: most expensive sample first, each to the least-loaded
// rank. The samples of one micro-batch that land on one rank form one contiguous micro-batch.
// A step that is still uneven (> 1%) is improved by pairwise swaps of its micro-batches.
void BuildBalanced(const std::vector<Chunk>& chunks, const BalanceContext& ctx, Plan& plan) {
  const int32_t w = plan.world_size;
  const double slack = 1 + 1e-9;
  const double target = static_cast<double>(w) * (ctx.budget - ctx.step_overhead);
  // The stream: chunks[next..] not yet read; win holds read chunks, in order, some partly used.
  size_t next = 0;
  std::vector<Chunk> win;
  std::vector<Chunk> sel;
  std::vector<int32_t> order;
  // The step's LPT assignment, sparse: (rank, slice, samples) for every pair with samples (about
  // slices + ranks entries, never slices x ranks); slot_of[r] is rank r's entry for the slice
  // being assigned (valid while mark[r] == that slice).
  std::vector<Assign> assign, sorted;
  std::vector<int32_t> rank_start;
  std::vector<int32_t> mark(w, -1);
  std::vector<int64_t> slot_of(w, 0), pos;
  std::vector<double> load(w), weights, base(w, ctx.step_overhead), wunit;
  std::vector<size_t> cand;
  auto push = [&](const Chunk& c) {
    win.push_back(c);
    wunit.push_back(ctx.work_of_shape[c.shape] + ctx.mb_overhead);
  };
  std::vector<std::pair<double, int32_t>> heap;
  std::vector<std::vector<int64_t>> lists(w);
  std::vector<int64_t> step_mbs;
  plan.micro_batches.reserve(ReservedMicroBatches(static_cast<int64_t>(chunks.size())));
  plan.work.reserve(ReservedMicroBatches(static_cast<int64_t>(chunks.size())));
  for (int64_t step = 0;; ++step) {
    // Compact the window (drop used-up entries) only when it has grown: amortised O(1).
    if (win.size() > 2 * static_cast<size_t>(ctx.lookahead) + 64) {
      size_t live = 0;
      for (size_t j = 0; j < win.size(); ++j) {
        if (win[j].begin < win[j].end) {
          wunit[live] = wunit[j];
          win[live++] = win[j];
        }
      }
      win.resize(live);
      wunit.resize(live);
    }
    // 1. Cut the step's work from the head of the stream.
    sel.clear();
    double total = 0;
    size_t i_cut = 0;
    while (true) {
      if (i_cut >= win.size()) {
        if (next >= chunks.size()) break;
        push(chunks[next++]);
      }
      Chunk& head = win[i_cut];
      if (head.begin >= head.end) {  // used up by an earlier step's gap filling
        ++i_cut;
        continue;
      }
      const double u = ctx.work_of_shape[head.shape];
      const int64_t n = head.end - head.begin;
      if (total + static_cast<double>(n) * u + ctx.mb_overhead <= target * slack) {
        sel.push_back(head);
        total += static_cast<double>(n) * u + ctx.mb_overhead;
        head.begin = head.end;
        ++i_cut;
        continue;
      }
      const double fit = FastFloor((target - total - ctx.mb_overhead) * slack / u);
      int64_t b = fit <= 0 ? 0 : std::min<int64_t>(n, static_cast<int64_t>(fit));
      if (sel.empty() && b == 0) b = 1;  // the budget is at least one sample's cost
      // A split never leaves a micro-batch whose work is below its own overhead a_mb: such a
      // remainder is taken whole (with a_mb = 0 nothing changes).
      if (b > 0 && static_cast<double>(n - b) * u < ctx.mb_overhead) b = n;
      if (b > 0) {
        sel.push_back(Chunk{head.begin, head.begin + b, head.shape});
        head.begin += b;
        total += static_cast<double>(b) * u + ctx.mb_overhead;
        if (head.begin >= head.end) ++i_cut;
      }
      break;
    }
    if (sel.empty()) break;
    // 2. LPT over the step's samples.
    const int64_t m = static_cast<int64_t>(sel.size());
    SortByWorkStable(sel, ctx.work_of_shape, &order);
    assign.clear();
    std::fill(mark.begin(), mark.end(), -1);
    load.assign(w, 0.0);
    // Min-heap of (load, slot); slot j is rank (j + step) % w, so ties rotate between steps.
    heap.clear();
    const int32_t shift = static_cast<int32_t>(step % w);
    for (int32_t j = 0; j < w; ++j) heap.emplace_back(0.0, j);
    auto cmp = [](const std::pair<double, int32_t>& x, const std::pair<double, int32_t>& y) {
      return x.first > y.first || (x.first == y.first && x.second > y.second);
    };
    // Most expensive samples first, each slice to the least-loaded rank; a slice that would
    // lift that rank above the step's mean load is split there (the rest goes on to the next
    // least-loaded rank), so a rank gets about one split and the step stays near its mean.
    double mean = 0;
    for (const Chunk& c : sel) {
      mean += ctx.mb_overhead + static_cast<double>(c.end - c.begin) * ctx.work_of_shape[c.shape];
    }
    mean /= static_cast<double>(w);
    for (int32_t i : order) {
      const double u = ctx.work_of_shape[sel[i].shape];
      int64_t left = sel[i].end - sel[i].begin;
      while (left > 0) {
        std::pop_heap(heap.begin(), heap.end(), cmp);
        auto& [l, j] = heap.back();
        const int32_t r = j + shift < w ? j + shift : j + shift - w;  // (j + step) % w
        if (mark[r] != i) {
          mark[r] = i;
          slot_of[r] = static_cast<int64_t>(assign.size());
          assign.push_back(Assign{r, i, 0});
        }
        int64_t& c = assign[slot_of[r]].count;
        const double ovh = c == 0 ? ctx.mb_overhead : 0;
        const double cap = mean - l - ovh;
        int64_t take = 1;
        if (u <= 0 || cap + ctx.mb_overhead >= static_cast<double>(left) * u) {
          // All of it fits, or what would overflow the mean costs less than the a_mb that
          // splitting it off onto another rank adds (a_mb = 0: only when all of it fits).
          take = left;
        } else if (cap >= u) {
          take = std::min<int64_t>(left, static_cast<int64_t>(FastFloor(cap * slack / u)));
          take = std::max<int64_t>(take, 1);
        }
        l += ovh + static_cast<double>(take) * u;
        c += take;
        left -= take;
        std::push_heap(heap.begin(), heap.end(), cmp);
      }
    }
    // 3. Contiguous micro-batches per (rank, slice).
    pos.resize(m);
    for (int64_t i = 0; i < m; ++i) pos[i] = sel[i].begin;
    step_mbs.clear();
    for (int32_t r = 0; r < w; ++r) lists[r].clear();
    // Rank-major, then slice order: the order of the dense (slice x rank) loop it replaces.
    SortRankMajor(assign, w, &rank_start, &sorted);
    for (const Assign& as : sorted) {
      const int64_t c = as.count;
      const int32_t i = as.slice;
      if (c == 0) continue;
      const int64_t idx = static_cast<int64_t>(plan.micro_batches.size());
      plan.micro_batches.push_back(
          MicroBatch{pos[i], pos[i] + c, sel[i].shape, ctx.StepTime(c, sel[i].shape)});
      pos[i] += c;
      lists[as.rank].push_back(idx);
      step_mbs.push_back(idx);
    }
    for (int32_t r = 0; r < w; ++r) {
      load[r] = lists[r].empty() ? 0 : ctx.step_overhead;
      for (int64_t mb : lists[r]) {
        const MicroBatch& x = plan.micro_batches[mb];
        load[r] +=
            ctx.mb_overhead + static_cast<double>(x.end - x.begin) * ctx.work_of_shape[x.shape];
      }
    }
    // 4. Fill every rank's gap below the step's level (its largest load) with work from the
    //    lookahead window, in stream order, splitting micro-batches to fit. What does not fit
    //    stays in the stream for the next step's cut.
    while (win.size() - i_cut < static_cast<size_t>(ctx.lookahead) && next < chunks.size()) {
      push(chunks[next++]);
    }
    const double level = *std::max_element(load.begin(), load.end());
    // wunit[j]: cost of one more sample of window entry j (+inf once used up).
    // Gaps under kGapTolerance of the level are left: filling them would add many tiny
    // micro-batches (each a forward/backward call) for little balance.
    constexpr double kGapTolerance = 0.005;
    double max_gap = 0;
    for (int32_t r = 0; r < w; ++r) {
      max_gap = std::max(max_gap, level - load[r] - (lists[r].empty() ? ctx.step_overhead : 0));
    }
    // Candidates: window entries (in stream order) whose next sample fits the largest gap.
    // min_unit: the smallest wunit of the candidates, a lower bound for the rest of the step
    // (wunit only rises, to +inf): a rank whose gap * slack is below it takes nothing more, so
    // its scan of the candidates can stop (it would skip every one of them).
    cand.clear();
    double min_unit = std::numeric_limits<double>::infinity();
    if (max_gap > kGapTolerance * level) {
      for (size_t j = i_cut; j < win.size(); ++j) {
        if (wunit[j] <= max_gap * slack) {
          cand.push_back(j);
          min_unit = std::min(min_unit, wunit[j]);
        }
      }
    }
    for (int32_t r = 0; r < w && !cand.empty(); ++r) {
      double gap = level - load[r] - (lists[r].empty() ? ctx.step_overhead : 0);
      if (gap <= kGapTolerance * level) continue;
      for (size_t j : cand) {
        if (gap * slack < min_unit) break;
        if (wunit[j] > gap * slack) continue;
        Chunk& c = win[j];
        const double u = ctx.work_of_shape[c.shape];
        const int64_t b = std::min<int64_t>(
            c.end - c.begin,
            std::max<int64_t>(
                1, static_cast<int64_t>(FastFloor((gap - ctx.mb_overhead) * slack / u))));
        if (b == c.end - c.begin) wunit[j] = std::numeric_limits<double>::infinity();
        const int64_t idx = static_cast<int64_t>(plan.micro_batches.size());
        plan.micro_batches.push_back(
            MicroBatch{c.begin, c.begin + b, c.shape, ctx.StepTime(b, c.shape)});
        if (lists[r].empty()) load[r] += ctx.step_overhead;
        lists[r].push_back(idx);
        c.begin += b;
        const double add = ctx.mb_overhead + static_cast<double>(b) * u;
        gap -= add;
        load[r] += add;
      }
    }
    // 5. Pairwise swaps when still uneven.
    const double hi = *std::max_element(load.begin(), load.end());
    const double lo = *std::min_element(load.begin(), load.end());
    size_t step_count = 0;
    for (const auto& l : lists) step_count += l.size();
    if (hi > 0 && hi - lo > 0.01 * hi && step_count > static_cast<size_t>(w)) {
      weights.clear();
      std::vector<int32_t> bin_of;
      for (int32_t r = 0; r < w; ++r) {
        for (int64_t mb : lists[r]) {
          const MicroBatch& x = plan.micro_batches[mb];
          weights.push_back(ctx.mb_overhead +
                            static_cast<double>(x.end - x.begin) * ctx.work_of_shape[x.shape]);
          bin_of.push_back(r);
        }
      }
      step_mbs.clear();
      for (int32_t r = 0; r < w; ++r)
        step_mbs.insert(step_mbs.end(), lists[r].begin(), lists[r].end());
      const double new_hi = internal::ImproveBySwaps(weights, w, bin_of, base, 16);
      if (new_hi < hi * (1 - 1e-12)) {
        for (auto& l : lists) l.clear();
        for (size_t i = 0; i < step_mbs.size(); ++i) lists[bin_of[i]].push_back(step_mbs[i]);
      }
    }
    EmitStep(lists, plan);
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
    for (int64_t i = wb; i < we; ++i) {
      const MicroBatch& mb = plan.micro_batches[plan.work[i]];
      plan.dropped_samples += mb.end - mb.begin;
      min_mb = std::min(min_mb, plan.work[i]);
    }
    // The tail's micro-batches are the last ones created.
    plan.micro_batches.resize(min_mb);
    plan.work.resize(wb);
    plan.rank_offsets.resize(first + 1);
    return;
  }
  // kPad: empty ranks repeat the cheapest micro-batch of the epoch (lowest index on ties).
  int64_t pad = 0;
  for (int64_t m = 1; m < static_cast<int64_t>(plan.micro_batches.size()); ++m) {
    if (plan.micro_batches[m].predicted_cost_s < plan.micro_batches[pad].predicted_cost_s) pad = m;
  }
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

Result<Plan> MakePlan(const ShapedManifest& shaped, const CostModel& cost_in,
                      const PlanOptions& options) {
  const CostModel cost =
      options.overhead_per_micro_batch ? OverheadPerMicroBatch(cost_in) : cost_in;
  if (auto e =
          RangeError("world size", static_cast<long long>(options.world_size), 1, kMaxWorldSize)) {
    return Failure::InvalidArgument(*e);
  }
  if (auto e = RangeError("M_mem (tokens per batch)", static_cast<long long>(options.m_mem_tokens),
                          1, kMaxMMemTokens)) {
    return Failure::InvalidArgument(*e);
  }
  if (auto e = RangeError("M_comp (0: automatic)", options.m_comp, 0.0, kMaxMComp)) {
    return Failure::InvalidArgument(*e);
  }
  if (auto e =
          RangeError("rank budget (s, 0: default)", options.rank_budget_s, 0.0, kMaxRankBudgetS)) {
    return Failure::InvalidArgument(*e);
  }
  if (auto e = RangeError("epoch", static_cast<long long>(options.epoch), 0,
                          std::numeric_limits<int64_t>::max())) {
    return Failure::InvalidArgument(*e);
  }
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
  // Bucket s holds ids [bucket_begin[s], bucket_begin[s + 1]) of the plan (internal/buckets.h).
  std::vector<int64_t> bucket_begin(num_shapes + 1, 0);
  for (int32_t s : shaped.shape_of) {
    if (s < 0 || s >= num_shapes) {
      return Failure::InvalidArgument("shaped manifest: shape index " + std::to_string(s) +
                                      " out of range [0, " + std::to_string(num_shapes) + ")");
    }
    ++bucket_begin[s + 1];
  }
  for (int32_t s = 0; s < num_shapes; ++s) bucket_begin[s + 1] += bucket_begin[s];
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
  const std::vector<int64_t> count = ShapeCounts(shaped);
  std::vector<double> work_of_shape(num_shapes, 0.0);
  for (int32_t s = 0; s < num_shapes; ++s) {
    work_of_shape[s] = cost.Work(shaped.shapes[s].seq_len);
    if (count[s] > 0 && !(work_of_shape[s] > 0 && std::isfinite(work_of_shape[s]))) {
      return Failure::InvalidArgument(
          "cost model (" + cost.source + ") predicts work " + std::to_string(work_of_shape[s]) +
          " s for S = " + std::to_string(shaped.shapes[s].seq_len) + " tokens; it must be > 0");
    }
  }

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
  plan.batch_size_of_shape.resize(num_shapes);
  for (int32_t s = 0; s < num_shapes; ++s) {
    const int64_t len = shaped.shapes[s].seq_len;
    plan.batch_size_of_shape[s] =
        options.policy == Policy::kEqualToken
            ? EqualTokenBatch(len, options.m_mem_tokens)
            : DualConstraintBatch(len, options.m_mem_tokens, plan.m_comp, plan.p);
    if (len > options.m_mem_tokens) plan.samples_over_m_mem += count[s];
  }

  // The shuffled ids are only needed in the finished plan: from kParallelSamples samples on they
  // are sorted and shuffled on a second thread while the micro-batches and steps are built from
  // the bucket bounds alone.
  internal::Buckets buckets;
  std::exception_ptr buckets_error;
  auto sort_ids = [&] {
    try {
      buckets = internal::SortAndShuffle(shaped, options.seed, options.epoch);
    } catch (...) {
      buckets_error = std::current_exception();
    }
  };
  std::jthread ids_worker;
  if (num_samples >= kParallelSamples && std::thread::hardware_concurrency() >= 2) {
    ids_worker = std::jthread(sort_ids);
  } else {
    sort_ids();
  }
  std::vector<Chunk> chunks;
  // Declared after chunks and plan: joined before their arrays are freed.
  std::jthread prefault;
  {
    int64_t n = 0;
    for (int32_t s = 0; s < num_shapes; ++s) {
      n += (count[s] + plan.batch_size_of_shape[s] - 1) / plan.batch_size_of_shape[s];
    }
    chunks.reserve(n);
    // Every chunk becomes at least one micro-batch with one entry in work: those pages are
    // mapped on a helper thread while this one fills them (internal/prefault.h).
    if (num_samples >= kParallelSamples && std::thread::hardware_concurrency() >= 2) {
      const size_t mbs = options.policy == Policy::kBalanced ? ReservedMicroBatches(n) : n;
      plan.micro_batches.reserve(mbs);
      plan.work.reserve(mbs);
      prefault = std::jthread([c = chunks.data(), mb = plan.micro_batches.data(),
                               work = plan.work.data(), n = static_cast<size_t>(n)] {
        internal::PrefaultForWrite(c, n * sizeof(Chunk));
        internal::PrefaultForWrite(mb, n * sizeof(MicroBatch));
        internal::PrefaultForWrite(work, n * sizeof(int64_t));
      });
    }
  }
  for (int32_t s = 0; s < num_shapes; ++s) {
    const int64_t b = plan.batch_size_of_shape[s];
    for (int64_t i = bucket_begin[s]; i < bucket_begin[s + 1]; i += b) {
      chunks.push_back(Chunk{i, std::min(i + b, bucket_begin[s + 1]), s});
    }
  }
  {
    SplitMix64 rng(StreamKey(options.seed, options.epoch, internal::kMicroBatchOrder));
    internal::PrefetchedShuffle(chunks.data(), static_cast<int64_t>(chunks.size()), rng);
  }
  plan.rank_offsets.push_back(0);

  if (options.policy == Policy::kBalanced) {
    BalanceContext ctx;
    ctx.shaped = &shaped;
    ctx.cost = &cost;
    ctx.work_of_shape = work_of_shape;
    ctx.step_overhead = cost.a;
    ctx.mb_overhead = cost.a_mb;
    const double max_unit = MinRankBudget(shaped, cost);
    if (options.rank_budget_s > 0 && options.rank_budget_s < max_unit) {
      return Failure::InvalidArgument(
          "rank budget " + FormatNumber(options.rank_budget_s) +
          " s is below the cost of the most expensive sample, " + FormatNumber(max_unit) +
          " s (a + a_mb + Work(S)): every sample must fit one rank's step; give a budget >= " +
          FormatNumber(max_unit) + " s, or 0 for the default");
    }
    const double requested = options.rank_budget_s > 0
                                 ? options.rank_budget_s
                                 : DefaultRankBudget(shaped, cost, plan.m_comp, plan.p);
    ctx.budget = std::max(requested, max_unit);
    plan.rank_budget_raised = requested < max_unit;
    ctx.lookahead = 8 * static_cast<int64_t>(options.world_size) + 32;
    plan.rank_budget_s = ctx.budget;
    BuildBalanced(chunks, ctx, plan);
  } else {
    plan.micro_batches.reserve(chunks.size());
    for (const Chunk& c : chunks) {
      plan.micro_batches.push_back(MicroBatch{
          c.begin, c.end, c.shape, cost.StepTime(c.end - c.begin, shaped.shapes[c.shape].seq_len)});
    }
    BuildOnePerRank(plan);
  }
  if (prefault.joinable()) prefault.join();
  if (ids_worker.joinable()) ids_worker.join();
  if (buckets_error) std::rethrow_exception(buckets_error);
  DS_CHECK(buckets.begin == bucket_begin, "bucket bounds differ from the shape counts");
  plan.ids = std::move(buckets.ids);
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

}  // namespace ditscale::balance
