#include "ditscale/balance/internal/balanced_sp.h"

#include <algorithm>
#include <cmath>

#include "ditscale/balance/internal/fast_floor.h"
#include "ditscale/balance/sp_cost.h"

namespace ditscale::balance::internal {

double SpContext::Unit(int32_t shape, int d) const {
  const int slot = SpSlot(d);
  return work_of_shape[shape] / (static_cast<double>(d) * cost->sp_efficiency[slot]) +
         comm_per_sample_s[static_cast<size_t>(shape) * kSpDegreeSlots + slot];
}

int SpContext::NextDegree(int d, int w) const {
  for (int x : degrees) {
    if (x > d && x <= w) return x;
  }
  return 0;
}

namespace {

constexpr double kSlack = 1 + 1e-9;
constexpr double kGapTolerance = 0.005;

// A cut piece of the stream and its degree.
struct Task {
  Chunk c;
  int d = 1;
};

// Samples of one task on one aligned group (first rank g * d).
struct Piece {
  int32_t task = 0;
  int32_t group = 0;
  int64_t count = 0;
};

class SpSteps {
 public:
  SpSteps(const std::vector<Chunk>& chunks, const SpContext& ctx, Plan& plan)
      : chunks_(chunks),
        ctx_(ctx),
        plan_(plan),
        w_(plan.world_size),
        target_(static_cast<double>(w_) * (ctx.budget - ctx.step_overhead)),
        load_(w_),
        lists_(w_) {}

  void Run() {
    for (int64_t step = 0;; ++step) {
      Compact();
      if (!Cut()) break;
      RaiseDegrees(step);
      EmitPieces();
      FillGaps();
      for (auto& l : lists_) {
        std::sort(l.begin(), l.end(), [this](int64_t x, int64_t y) {
          const int dx = plan_.micro_batches[x].sp_degree, dy = plan_.micro_batches[y].sp_degree;
          return dx != dy ? dx > dy : x < y;
        });
      }
      EmitStep(lists_, plan_);
    }
  }

 private:
  // Drops the used-up front of the window once it is long: amortised O(1).
  void Compact() {
    if (head_ < 1024 || 2 * head_ < win_.size()) return;
    win_.erase(win_.begin(), win_.begin() + static_cast<std::ptrdiff_t>(head_));
    head_ = 0;
  }

  // 1. The step's tasks at d_min, target_ rank-seconds from the head of the stream.
  bool Cut() {
    tasks_.clear();
    double total = 0;
    while (true) {
      if (head_ >= win_.size()) {
        if (next_ >= chunks_.size()) break;
        win_.push_back(chunks_[next_++]);
      }
      Chunk& h = win_[head_];
      if (h.begin >= h.end) {
        ++head_;
        continue;
      }
      const int d = ctx_.min_degree_of_shape[h.shape];
      const double u = d * ctx_.Unit(h.shape, d);  // rank-seconds per sample
      const double ovh = d * ctx_.mb_overhead;
      const int64_t n = h.end - h.begin;
      if (total + static_cast<double>(n) * u + ovh <= target_ * kSlack) {
        tasks_.push_back(Task{h, d});
        total += static_cast<double>(n) * u + ovh;
        h.begin = h.end;
        ++head_;
        continue;
      }
      const double fit = FastFloor((target_ - total - ovh) * kSlack / u);
      int64_t b = fit <= 0 ? 0 : std::min<int64_t>(n, static_cast<int64_t>(fit));
      if (tasks_.empty() && b == 0) b = 1;
      if (b > 0 && static_cast<double>(n - b) * u < ovh) b = n;
      if (b > 0) {
        tasks_.push_back(Task{Chunk{h.begin, h.begin + b, h.shape}, d});
        h.begin += b;
        if (h.begin >= h.end) ++head_;
      }
      break;
    }
    return !tasks_.empty();
  }

  // The load of the busiest rank of group g of degree d, a included.
  double GroupMax(int32_t g, int d) const {
    double m = 0;
    for (int r = g * d; r < g * d + d; ++r) m = std::max(m, load_[r]);
    return m + ctx_.step_overhead;
  }

  // The group of degree d with the least-loaded busiest rank; ties: the first in the order
  // rotated by `shift`.
  int32_t LeastLoadedGroup(int d, int64_t shift) const {
    const int32_t groups = w_ / d;
    int32_t best = -1;
    double best_load = 0;
    for (int32_t k = 0; k < groups; ++k) {
      const int32_t g = static_cast<int32_t>((k + shift) % groups);
      const double l = GroupMax(g, d);
      if (best < 0 || l < best_load) best = g, best_load = l;
    }
    return best;
  }

  void AddToGroup(int32_t g, int d, double cost) {
    for (int r = g * d; r < g * d + d; ++r) load_[r] += cost;
  }

  // 2. LPT of the tasks at their degrees: pieces_ and load_ (a excluded); returns the step's
  // slowest rank's cost.
  double Assign(int64_t step) {
    order_.resize(tasks_.size());
    for (size_t i = 0; i < order_.size(); ++i) order_[i] = static_cast<int32_t>(i);
    auto rank_cost = [this](const Task& t) {
      return ctx_.mb_overhead +
             static_cast<double>(t.c.end - t.c.begin) * ctx_.Unit(t.c.shape, t.d);
    };
    std::stable_sort(order_.begin(), order_.end(), [&](int32_t x, int32_t y) {
      const Task &a = tasks_[x], &b = tasks_[y];
      return a.d != b.d ? a.d > b.d : rank_cost(a) > rank_cost(b);
    });
    double mean = 0;
    for (const Task& t : tasks_) mean += t.d * rank_cost(t);
    mean = mean / w_ + ctx_.step_overhead;
    std::fill(load_.begin(), load_.end(), 0.0);
    pieces_.clear();
    for (int32_t i : order_) PlaceTask(i, mean, step);
    return Makespan();
  }

  void PlaceTask(int32_t i, double mean, int64_t step) {
    const Task& t = tasks_[i];
    const double u = ctx_.Unit(t.c.shape, t.d);
    const size_t first = pieces_.size();
    int64_t left = t.c.end - t.c.begin;
    while (left > 0) {
      const int32_t g = LeastLoadedGroup(t.d, step);
      size_t p = first;
      while (p < pieces_.size() && pieces_[p].group != g) ++p;
      if (p == pieces_.size()) pieces_.push_back(Piece{i, g, 0});
      const double ovh = pieces_[p].count == 0 ? ctx_.mb_overhead : 0;
      const double cap = mean - GroupMax(g, t.d) - ovh;
      int64_t take = 1;
      if (u <= 0 || cap + ctx_.mb_overhead >= static_cast<double>(left) * u) {
        take = left;
      } else if (cap >= u) {
        take = std::clamp<int64_t>(static_cast<int64_t>(FastFloor(cap * kSlack / u)), 1, left);
      }
      AddToGroup(g, t.d, ovh + static_cast<double>(take) * u);
      pieces_[p].count += take;
      left -= take;
    }
  }

  double Makespan() const {
    double m = 0;
    for (int r = 0; r < w_; ++r) {
      if (load_[r] > 0) m = std::max(m, load_[r] + ctx_.step_overhead);
    }
    return m;
  }

  // 3. Raises the degree of a task on the slowest rank while that lowers the makespan.
  void RaiseDegrees(int64_t step) {
    double best = Assign(step);
    if (ctx_.degrees.size() < 2) return;
    tried_.assign(tasks_.size(), 0);
    bool stale = false;  // pieces_ hold a rejected trial
    for (int trial = 0; trial < kMaxRaiseTrials; ++trial) {
      const int32_t t = RaiseCandidate();
      if (t < 0) break;
      const int old = tasks_[t].d;
      tasks_[t].d = ctx_.NextDegree(old, w_);
      const double m = Assign(step);
      if (m < best * (1 - 1e-9)) {
        best = m;
        stale = false;
        tried_.assign(tasks_.size(), 0);
      } else {
        tasks_[t].d = old;
        tried_[t] = 1;
        stale = true;
      }
    }
    if (stale) Assign(step);
  }

  // The untried task with the most expensive piece on the slowest rank that can go up a degree;
  // -1 when none.
  int32_t RaiseCandidate() const {
    int slowest = 0;
    for (int r = 1; r < w_; ++r) {
      if (load_[r] > load_[slowest]) slowest = r;
    }
    int32_t best = -1;
    double best_cost = -1;
    for (const Piece& p : pieces_) {
      const Task& t = tasks_[p.task];
      if (slowest < p.group * t.d || slowest >= (p.group + 1) * t.d) continue;
      if (tried_[p.task] || ctx_.NextDegree(t.d, w_) == 0) continue;
      const double c = static_cast<double>(p.count) * ctx_.Unit(t.c.shape, t.d);
      if (c > best_cost) best = p.task, best_cost = c;
    }
    return best;
  }

  // Appends a micro-batch of `count` samples from `c` on group g of degree d.
  void NewMicroBatch(Chunk& c, int64_t count, int32_t g, int d) {
    const double cost = ctx_.mb_overhead + static_cast<double>(count) * ctx_.Unit(c.shape, d);
    const int64_t idx = static_cast<int64_t>(plan_.micro_batches.size());
    plan_.micro_batches.push_back(MicroBatch{c.begin, c.begin + count, c.shape,
                                             ctx_.step_overhead + cost, static_cast<int16_t>(d)});
    c.begin += count;
    for (int r = g * d; r < g * d + d; ++r) lists_[r].push_back(idx);
  }

  void EmitPieces() {
    for (auto& l : lists_) l.clear();
    for (const Piece& p : pieces_) {
      Task& t = tasks_[p.task];
      NewMicroBatch(t.c, p.count, p.group, t.d);
    }
  }

  // 4. Tops every group up to the step's level from the lookahead window: each chunk at its
  // smallest degree where a group has room, else at the next degrees (a long sample on d_min
  // ranks may not fit a gap that it fits on more ranks).
  void FillGaps() {
    while (win_.size() - head_ < static_cast<size_t>(ctx_.lookahead) && next_ < chunks_.size()) {
      win_.push_back(chunks_[next_++]);
    }
    const double level = Makespan();
    const double low = *std::min_element(load_.begin(), load_.end()) + ctx_.step_overhead;
    if (level - low <= kGapTolerance * level) return;
    for (size_t j = head_; j < win_.size(); ++j) {
      Chunk& c = win_[j];
      for (int d = ctx_.min_degree_of_shape[c.shape]; d > 0 && c.begin < c.end;
           d = ctx_.NextDegree(d, w_)) {
        FillGroups(c, d, level);
      }
    }
  }

  // Puts samples of c on every group of degree d with room below `level`.
  void FillGroups(Chunk& c, int d, double level) {
    const double u = ctx_.Unit(c.shape, d);
    for (int32_t g = 0; g < w_ / d && c.begin < c.end; ++g) {
      const double room = level - GroupMax(g, d) - ctx_.mb_overhead;
      if (room <= kGapTolerance * level || room * kSlack < u) continue;
      const int64_t b = std::clamp<int64_t>(static_cast<int64_t>(FastFloor(room * kSlack / u)), 1,
                                            c.end - c.begin);
      AddToGroup(g, d, ctx_.mb_overhead + static_cast<double>(b) * u);
      NewMicroBatch(c, b, g, d);
    }
  }

  const std::vector<Chunk>& chunks_;
  const SpContext& ctx_;
  Plan& plan_;
  const int32_t w_;
  const double target_;
  // The stream: chunks_[next_..] not read yet; win_[head_..] read, in order, some used up.
  size_t next_ = 0, head_ = 0;
  std::vector<Chunk> win_;
  std::vector<Task> tasks_;
  std::vector<Piece> pieces_;
  std::vector<int32_t> order_;
  std::vector<char> tried_;
  std::vector<double> load_;  // per rank, this step, a excluded
  std::vector<std::vector<int64_t>> lists_;
};

}  // namespace

void BuildBalancedSp(const std::vector<Chunk>& chunks, const SpContext& ctx, Plan& plan) {
  SpSteps(chunks, ctx, plan).Run();
}

}  // namespace ditscale::balance::internal
