#include "ditscale/balance/internal/balanced.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "ditscale/balance/internal/fast_floor.h"
#include "ditscale/balance/internal/partition.h"

namespace ditscale::balance::internal {
namespace {

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

// Min-heap order of (load, slot): the least-loaded slot first, ties by slot.
bool HeapAfter(const std::pair<double, int32_t>& x, const std::pair<double, int32_t>& y) {
  return x.first > y.first || (x.first == y.first && x.second > y.second);
}

// Gaps under this fraction of a step's level are left: filling them would add many tiny
// micro-batches (each a forward/backward call) for little balance.
constexpr double kGapTolerance = 0.005;
constexpr double kSlack = 1 + 1e-9;

// The state of the balanced build, kept across steps so its buffers are reused. One step is
// Cut -> AssignLpt -> EmitSlices -> FillGaps -> SwapIfUneven -> EmitStep.
class BalancedSteps {
 public:
  BalancedSteps(const std::vector<Chunk>& chunks, const BalanceContext& ctx, Plan& plan)
      : chunks_(chunks),
        ctx_(ctx),
        plan_(plan),
        w_(plan.world_size),
        target_(static_cast<double>(w_) * (ctx.budget - ctx.step_overhead)),
        mark_(w_, -1),
        slot_of_(w_, 0),
        load_(w_),
        base_(w_, ctx.step_overhead),
        lists_(w_) {}

  void Run() {
    plan_.micro_batches.reserve(ReservedMicroBatches(static_cast<int64_t>(chunks_.size())));
    plan_.work.reserve(ReservedMicroBatches(static_cast<int64_t>(chunks_.size())));
    for (int64_t step = 0;; ++step) {
      CompactWindow();
      if (!Cut()) break;
      AssignLpt(step);
      EmitSlices();
      FillGaps();
      SwapIfUneven();
      EmitStep(lists_, plan_);
    }
  }

 private:
  void Push(const Chunk& c) {
    win_.push_back(c);
    wunit_.push_back(ctx_.work_of_shape[c.shape] + ctx_.mb_overhead);
  }

  // Drops used-up window entries, only when the window has grown: amortised O(1).
  void CompactWindow() {
    if (win_.size() <= 2 * static_cast<size_t>(ctx_.lookahead) + 64) return;
    size_t live = 0;
    for (size_t j = 0; j < win_.size(); ++j) {
      if (win_[j].begin < win_[j].end) {
        wunit_[live] = wunit_[j];
        win_[live++] = win_[j];
      }
    }
    win_.resize(live);
    wunit_.resize(live);
  }

  // 1. Cuts the step's work (sel_) from the head of the stream; false when nothing is left.
  bool Cut() {
    sel_.clear();
    double total = 0;
    i_cut_ = 0;
    while (true) {
      if (i_cut_ >= win_.size()) {
        if (next_ >= chunks_.size()) break;
        Push(chunks_[next_++]);
      }
      Chunk& head = win_[i_cut_];
      if (head.begin >= head.end) {  // used up by an earlier step's gap filling
        ++i_cut_;
        continue;
      }
      const double u = ctx_.work_of_shape[head.shape];
      const int64_t n = head.end - head.begin;
      if (total + static_cast<double>(n) * u + ctx_.mb_overhead <= target_ * kSlack) {
        sel_.push_back(head);
        total += static_cast<double>(n) * u + ctx_.mb_overhead;
        head.begin = head.end;
        ++i_cut_;
        continue;
      }
      const double fit = FastFloor((target_ - total - ctx_.mb_overhead) * kSlack / u);
      int64_t b = fit <= 0 ? 0 : std::min<int64_t>(n, static_cast<int64_t>(fit));
      if (sel_.empty() && b == 0) b = 1;  // the budget is at least one sample's cost
      // A split never leaves a micro-batch whose work is below its own overhead a_mb: such a
      // remainder is taken whole (with a_mb = 0 nothing changes).
      if (b > 0 && static_cast<double>(n - b) * u < ctx_.mb_overhead) b = n;
      if (b > 0) {
        sel_.push_back(Chunk{head.begin, head.begin + b, head.shape});
        head.begin += b;
        total += static_cast<double>(b) * u + ctx_.mb_overhead;
        if (head.begin >= head.end) ++i_cut_;
      }
      break;
    }
    return !sel_.empty();
  }

  // 2. LPT over the step's samples (assign_): most expensive samples first, each slice to the
  // least-loaded rank; a slice that would lift that rank above the step's mean load is split
  // there (the rest goes on to the next least-loaded rank), so a rank gets about one split and
  // the step stays near its mean. Heap slot j is rank (j + step) % w: ties rotate between steps.
  void AssignLpt(int64_t step) {
    SortByWorkStable(sel_, ctx_.work_of_shape, &order_);
    assign_.clear();
    std::fill(mark_.begin(), mark_.end(), -1);
    load_.assign(w_, 0.0);
    heap_.clear();
    const int32_t shift = static_cast<int32_t>(step % w_);
    for (int32_t j = 0; j < w_; ++j) heap_.emplace_back(0.0, j);
    double mean = 0;
    for (const Chunk& c : sel_) {
      mean += ctx_.mb_overhead + static_cast<double>(c.end - c.begin) * ctx_.work_of_shape[c.shape];
    }
    mean /= static_cast<double>(w_);
    for (int32_t i : order_) {
      const double u = ctx_.work_of_shape[sel_[i].shape];
      int64_t left = sel_[i].end - sel_[i].begin;
      while (left > 0) {
        std::pop_heap(heap_.begin(), heap_.end(), HeapAfter);
        auto& [l, j] = heap_.back();
        const int32_t r = j + shift < w_ ? j + shift : j + shift - w_;  // (j + step) % w
        if (mark_[r] != i) {
          mark_[r] = i;
          slot_of_[r] = static_cast<int64_t>(assign_.size());
          assign_.push_back(Assign{r, i, 0});
        }
        int64_t& c = assign_[slot_of_[r]].count;
        const double ovh = c == 0 ? ctx_.mb_overhead : 0;
        const double cap = mean - l - ovh;
        int64_t take = 1;
        if (u <= 0 || cap + ctx_.mb_overhead >= static_cast<double>(left) * u) {
          // All of it fits, or what would overflow the mean costs less than the a_mb that
          // splitting it off onto another rank adds (a_mb = 0: only when all of it fits).
          take = left;
        } else if (cap >= u) {
          take = std::min<int64_t>(left, static_cast<int64_t>(FastFloor(cap * kSlack / u)));
          take = std::max<int64_t>(take, 1);
        }
        l += ovh + static_cast<double>(take) * u;
        c += take;
        left -= take;
        std::push_heap(heap_.begin(), heap_.end(), HeapAfter);
      }
    }
  }

  // 3. Contiguous micro-batches per (rank, slice), rank-major then slice order (the order of the
  // dense slice x rank loop it replaces); load_ becomes each rank's cost.
  void EmitSlices() {
    const int64_t m = static_cast<int64_t>(sel_.size());
    pos_.resize(m);
    for (int64_t i = 0; i < m; ++i) pos_[i] = sel_[i].begin;
    step_mbs_.clear();
    for (int32_t r = 0; r < w_; ++r) lists_[r].clear();
    SortRankMajor(assign_, w_, &rank_start_, &sorted_);
    for (const Assign& as : sorted_) {
      const int64_t c = as.count;
      const int32_t i = as.slice;
      if (c == 0) continue;
      const int64_t idx = static_cast<int64_t>(plan_.micro_batches.size());
      plan_.micro_batches.push_back(
          MicroBatch{pos_[i], pos_[i] + c, sel_[i].shape, ctx_.StepTime(c, sel_[i].shape)});
      pos_[i] += c;
      lists_[as.rank].push_back(idx);
      step_mbs_.push_back(idx);
    }
    for (int32_t r = 0; r < w_; ++r) {
      load_[r] = lists_[r].empty() ? 0 : ctx_.step_overhead;
      for (int64_t mb : lists_[r]) {
        const MicroBatch& x = plan_.micro_batches[mb];
        load_[r] +=
            ctx_.mb_overhead + static_cast<double>(x.end - x.begin) * ctx_.work_of_shape[x.shape];
      }
    }
  }

  // Room of rank r below the step's level (a rank without work would also pay a).
  double Gap(int32_t r, double level) const {
    return level - load_[r] - (lists_[r].empty() ? ctx_.step_overhead : 0);
  }

  // 4. Fills every rank's gap below the step's level (its largest load) with work from the
  // lookahead window, in stream order, splitting micro-batches to fit. What does not fit stays
  // in the stream for the next step's cut.
  void FillGaps() {
    while (win_.size() - i_cut_ < static_cast<size_t>(ctx_.lookahead) && next_ < chunks_.size()) {
      Push(chunks_[next_++]);
    }
    const double level = *std::max_element(load_.begin(), load_.end());
    double max_gap = 0;
    for (int32_t r = 0; r < w_; ++r) max_gap = std::max(max_gap, Gap(r, level));
    // Candidates: window entries (in stream order) whose next sample fits the largest gap
    // (wunit_[j]: cost of one more sample of entry j, +inf once used up). min_unit: the smallest
    // wunit of the candidates, a lower bound for the rest of the step (wunit only rises): a rank
    // whose gap * slack is below it takes nothing more, so its scan can stop.
    cand_.clear();
    double min_unit = std::numeric_limits<double>::infinity();
    if (max_gap > kGapTolerance * level) {
      for (size_t j = i_cut_; j < win_.size(); ++j) {
        if (wunit_[j] <= max_gap * kSlack) {
          cand_.push_back(j);
          min_unit = std::min(min_unit, wunit_[j]);
        }
      }
    }
    for (int32_t r = 0; r < w_ && !cand_.empty(); ++r) {
      const double gap = Gap(r, level);
      if (gap > kGapTolerance * level) FillRank(r, gap, min_unit);
    }
  }

  // Tops rank r up by `gap` seconds from the candidates.
  void FillRank(int32_t r, double gap, double min_unit) {
    for (size_t j : cand_) {
      if (gap * kSlack < min_unit) break;
      if (wunit_[j] > gap * kSlack) continue;
      Chunk& c = win_[j];
      const double u = ctx_.work_of_shape[c.shape];
      const int64_t b = std::min<int64_t>(
          c.end - c.begin,
          std::max<int64_t>(
              1, static_cast<int64_t>(FastFloor((gap - ctx_.mb_overhead) * kSlack / u))));
      if (b == c.end - c.begin) wunit_[j] = std::numeric_limits<double>::infinity();
      const int64_t idx = static_cast<int64_t>(plan_.micro_batches.size());
      plan_.micro_batches.push_back(
          MicroBatch{c.begin, c.begin + b, c.shape, ctx_.StepTime(b, c.shape)});
      if (lists_[r].empty()) load_[r] += ctx_.step_overhead;
      lists_[r].push_back(idx);
      c.begin += b;
      const double add = ctx_.mb_overhead + static_cast<double>(b) * u;
      gap -= add;
      load_[r] += add;
    }
  }

  // 5. Pairwise swaps of the step's micro-batches when it is still uneven by > 1%.
  void SwapIfUneven() {
    const double hi = *std::max_element(load_.begin(), load_.end());
    const double lo = *std::min_element(load_.begin(), load_.end());
    size_t step_count = 0;
    for (const auto& l : lists_) step_count += l.size();
    if (!(hi > 0 && hi - lo > 0.01 * hi && step_count > static_cast<size_t>(w_))) return;
    weights_.clear();
    std::vector<int32_t> bin_of;
    for (int32_t r = 0; r < w_; ++r) {
      for (int64_t mb : lists_[r]) {
        const MicroBatch& x = plan_.micro_batches[mb];
        weights_.push_back(ctx_.mb_overhead +
                           static_cast<double>(x.end - x.begin) * ctx_.work_of_shape[x.shape]);
        bin_of.push_back(r);
      }
    }
    step_mbs_.clear();
    for (int32_t r = 0; r < w_; ++r) {
      step_mbs_.insert(step_mbs_.end(), lists_[r].begin(), lists_[r].end());
    }
    const double new_hi = ImproveBySwaps(weights_, w_, bin_of, base_, 16);
    if (new_hi < hi * (1 - 1e-12)) {
      for (auto& l : lists_) l.clear();
      for (size_t i = 0; i < step_mbs_.size(); ++i) lists_[bin_of[i]].push_back(step_mbs_[i]);
    }
  }

  const std::vector<Chunk>& chunks_;
  const BalanceContext& ctx_;
  Plan& plan_;
  const int32_t w_;
  const double target_;
  // The stream: chunks_[next_..] not yet read; win_ holds read chunks, in order, some partly
  // used; win_[0, i_cut_) is used up by this step's cut.
  size_t next_ = 0, i_cut_ = 0;
  std::vector<Chunk> win_, sel_;
  std::vector<double> wunit_;
  std::vector<int32_t> order_;
  // The step's LPT assignment, sparse: (rank, slice, samples) for every pair with samples (about
  // slices + ranks entries, never slices x ranks); slot_of_[r] is rank r's entry for the slice
  // being assigned (valid while mark_[r] == that slice).
  std::vector<Assign> assign_, sorted_;
  std::vector<int32_t> rank_start_, mark_;
  std::vector<int64_t> slot_of_, pos_;
  std::vector<double> load_, weights_, base_;
  std::vector<size_t> cand_;
  std::vector<std::pair<double, int32_t>> heap_;
  std::vector<std::vector<int64_t>> lists_;
  std::vector<int64_t> step_mbs_;
};

}  // namespace

void EmitStep(const std::vector<std::vector<int64_t>>& lists, Plan& plan) {
  for (const auto& l : lists) {
    plan.work.insert(plan.work.end(), l.begin(), l.end());
    plan.rank_offsets.push_back(static_cast<int64_t>(plan.work.size()));
  }
}

void BuildBalanced(const std::vector<Chunk>& chunks, const BalanceContext& ctx, Plan& plan) {
  BalancedSteps(chunks, ctx, plan).Run();
}

}  // namespace ditscale::balance::internal
