#include "ditscale/sp/ref_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include "ditscale/sp/attention_ref.h"

namespace ditscale::sp {
namespace {

using Key = std::tuple<int, int, int64_t>;  // sender, receiver, tag

// The schedule or the inputs do not run: invalid, mismatched, or failing as run (a rank's
// check, a deadlock).
Failure Fail(const std::string& message) { return Failure::InvalidArgument(message); }

struct Shared {
  std::mutex m;
  std::condition_variable cv;
  std::map<Key, std::vector<float>> mailbox;
  std::vector<std::map<std::string, int64_t>> counters;
  std::vector<std::string> blocked_at;  // per rank, non-empty while blocked
  int blocked = 0, finished = 0, n = 0;
  bool abort = false;
  std::string error;
  std::vector<char> is_blocked;  // per rank: blocked with no cross-rank effect since
};

class RankRunner {
 public:
  RankRunner(const Schedule& s, int rank, std::vector<std::vector<std::vector<float>>>* mem,
             Shared* sh, const ExecutorOptions& opt)
      : s_(s),
        prog_(s.ranks[rank]),
        rank_(rank),
        mem_(mem),
        sh_(sh),
        opt_(opt),
        rng_(opt.seed * 7919 + rank) {
    for (size_t i = 0; i < prog_.ops.size(); ++i) {
      streams_[static_cast<int>(prog_.ops[i].stream)].push_back(static_cast<int>(i));
    }
    done_.assign(prog_.ops.size(), 0);
  }

  void Run() {
    std::unique_lock<std::mutex> lock(sh_->m, std::defer_lock);
    while (true) {
      std::vector<int> cand = Candidates();
      if (cand.empty() && AllDone()) break;
      lock.lock();
      if (sh_->abort) return;
      std::vector<int> runnable;
      for (int i : cand) {
        if (Runnable(prog_.ops[i])) runnable.push_back(i);
      }
      if (runnable.empty()) {
        sh_->blocked_at[rank_] = Describe(cand);
        sh_->is_blocked[rank_] = 1;
        ++sh_->blocked;
        if (sh_->blocked + sh_->finished == sh_->n) {
          Abort("deadlock: every rank is blocked");
          return;
        }
        sh_->cv.wait_for(lock, std::chrono::duration<double>(opt_.timeout_s),
                         [&] { return sh_->abort || !sh_->is_blocked[rank_]; });
        if (sh_->abort) return;
        if (sh_->is_blocked[rank_]) {
          Abort("timeout: no progress for " + std::to_string(opt_.timeout_s) + " s");
          return;
        }
        lock.unlock();
        continue;
      }
      const int pick = opt_.shuffle ? runnable[rng_() % runnable.size()] : runnable[0];
      const Op& op = prog_.ops[pick];
      const bool remote = op.kind == OpKind::kSend || op.kind == OpKind::kRecv ||
                          op.kind == OpKind::kPut || op.kind == OpKind::kSignal ||
                          op.kind == OpKind::kWait;
      if (remote) {
        ExecuteRemote(op);
        WakeAll();
        lock.unlock();
        sh_->cv.notify_all();
      } else {
        lock.unlock();
        ExecuteLocal(op);
      }
      done_[pick] = 1;
    }
    std::lock_guard<std::mutex> g(sh_->m);
    ++sh_->finished;
    if (sh_->blocked + sh_->finished == sh_->n && sh_->finished < sh_->n) {
      Abort("deadlock: every unfinished rank is blocked");
    }
    sh_->cv.notify_all();
  }

 private:
  // Ops that may start under stream order, groups and deps (not yet checking peers/counters).
  std::vector<int> Candidates() {
    std::vector<int> out;
    for (int st = 0; st < kNumStreams; ++st) {
      std::vector<int>& ops = streams_[st];
      size_t& pos = pos_[st];
      // Step over finished units (a group counts as finished when all its ops are).
      while (pos < ops.size()) {
        const size_t end = UnitEnd(ops, pos);
        bool all = true;
        for (size_t u = pos; u < end; ++u) all = all && done_[ops[u]];
        if (!all) break;
        pos = end;
      }
      if (pos >= ops.size()) continue;
      const size_t end = UnitEnd(ops, pos);
      bool ready = true;
      for (size_t u = pos; u < end && ready; ++u) {
        for (int d : prog_.ops[ops[u]].deps) ready = ready && done_[d];
      }
      if (!ready) continue;
      for (size_t u = pos; u < end; ++u) {
        if (!done_[ops[u]]) out.push_back(ops[u]);
      }
    }
    return out;
  }

  // One past the last op of the unit (a group, or a single op) starting at ops[pos].
  size_t UnitEnd(const std::vector<int>& ops, size_t pos) const {
    const int g = prog_.ops[ops[pos]].group;
    size_t end = pos + 1;
    while (g >= 0 && end < ops.size() && prog_.ops[ops[end]].group == g) ++end;
    return end;
  }

  bool AllDone() const {
    for (char d : done_) {
      if (!d) return false;
    }
    return true;
  }

  bool Runnable(const Op& op) {  // under the lock
    if (op.kind == OpKind::kRecv) return sh_->mailbox.count(Key{op.peer, rank_, op.tag}) > 0;
    if (op.kind == OpKind::kWait) return sh_->counters[rank_][op.counter] >= op.count;
    return true;
  }

  std::string Describe(const std::vector<int>& cand) {
    std::ostringstream os;
    os << "rank " << rank_ << ":";
    if (cand.empty()) os << " no op can start (waiting on local deps of stream heads)";
    for (int i : cand) {
      const Op& op = prog_.ops[i];
      os << " [#" << i << " " << ToString(op.kind) << " '" << op.label << "'";
      if (op.kind == OpKind::kRecv) os << " from rank " << op.peer << " tag " << op.tag;
      if (op.kind == OpKind::kWait) {
        os << " counter " << op.counter << " = " << sh_->counters[rank_][op.counter] << " < "
           << op.count;
      }
      os << "]";
    }
    return os.str();
  }

  // A cross-rank effect happened: every blocked rank must look again (under the lock).
  void WakeAll() {
    std::fill(sh_->is_blocked.begin(), sh_->is_blocked.end(), 0);
    sh_->blocked = 0;
  }

  void Abort(const std::string& why) {  // under the lock
    if (!sh_->abort) {
      std::ostringstream os;
      os << why << "; blocked ops:";
      for (int r = 0; r < sh_->n; ++r) {
        if (sh_->is_blocked[r]) os << "\n  " << sh_->blocked_at[r];
      }
      sh_->error = os.str();
    }
    sh_->abort = true;
    sh_->cv.notify_all();
  }

  TensorView View(int rank, const Region& r) {
    const BufferDecl& d = s_.ranks[rank].buffers[r.buffer];
    float* base = (*mem_)[rank][r.buffer].data();
    return TensorView::Dense(base, s_.shape.batch, d.tokens, d.heads, d.width)
        .Sub(r.token_begin, r.tokens, r.head_begin, r.heads);
  }

  static void CopyView(const TensorView& src, const TensorView& dst) {
    for (int64_t b = 0; b < src.batch; ++b) {
      for (int64_t t = 0; t < src.tokens; ++t) {
        for (int64_t h = 0; h < src.heads; ++h) {
          std::copy_n(src.at(b, t, h), src.width, dst.at(b, t, h));
        }
      }
    }
  }

  void ExecuteRemote(const Op& op) {  // under the lock
    switch (op.kind) {
      case OpKind::kSend: {
        const TensorView v = View(rank_, op.src);
        std::vector<float> msg(v.batch * v.tokens * v.heads * v.width);
        CopyView(v, TensorView::Dense(msg.data(), v.batch, v.tokens, v.heads, v.width));
        sh_->mailbox[Key{rank_, op.peer, op.tag}] = std::move(msg);
        break;
      }
      case OpKind::kRecv: {
        auto it = sh_->mailbox.find(Key{op.peer, rank_, op.tag});
        const TensorView v = View(rank_, op.dst);
        DS_CHECK(static_cast<int64_t>(it->second.size()) == v.batch * v.tokens * v.heads * v.width,
                 "rank ", rank_, " '", op.label, "': message size mismatch");
        CopyView(TensorView::Dense(it->second.data(), v.batch, v.tokens, v.heads, v.width), v);
        sh_->mailbox.erase(it);
        break;
      }
      case OpKind::kPut:
        CopyView(View(rank_, op.src), View(op.peer, op.dst));
        if (!op.counter.empty()) sh_->counters[op.peer][op.counter] += op.count;
        break;
      case OpKind::kSignal:
        sh_->counters[op.peer][op.counter] += op.count;
        break;
      default:  // Wait: nothing to do once runnable
        break;
    }
  }

  void ExecuteLocal(const Op& op) {
    switch (op.kind) {
      case OpKind::kAttention:
        AttentionRef(View(rank_, op.src), View(rank_, op.key), View(rank_, op.value),
                     View(rank_, op.dst), View(rank_, op.dst_lse),
                     1.0 / std::sqrt(static_cast<double>(s_.shape.head_dim)));
        break;
      case OpKind::kMerge:
        MergeRef(View(rank_, op.src), View(rank_, op.src_lse), View(rank_, op.dst),
                 View(rank_, op.dst_lse));
        break;
      case OpKind::kPack:
      case OpKind::kUnpack:
      case OpKind::kCopy:
        CopyView(View(rank_, op.src), View(rank_, op.dst));
        break;
      default:
        DS_FAIL("not a local op");
    }
  }

  const Schedule& s_;
  const RankProgram& prog_;
  int rank_;
  std::vector<std::vector<std::vector<float>>>* mem_;
  Shared* sh_;
  ExecutorOptions opt_;
  std::mt19937_64 rng_;
  std::vector<int> streams_[kNumStreams];
  size_t pos_[kNumStreams] = {0, 0, 0};
  std::vector<char> done_;
};

// Copies global rows [row0, row0 + tokens) x all heads of `global` ([b, rows, heads, d]) into a
// [b, tokens, heads, d] buffer.
void FillRows(const std::vector<float>& global, int64_t rows, int64_t batch, int64_t heads,
              int64_t d, int64_t row0, int64_t tokens, std::vector<float>* dst) {
  const int64_t row = heads * d;
  for (int64_t b = 0; b < batch; ++b) {
    std::copy_n(global.data() + (b * rows + row0) * row, tokens * row,
                dst->data() + b * tokens * row);
  }
}

}  // namespace

DenseInputs RandomInputs(const AttentionShape& shape, uint64_t seed) {
  DenseInputs in;
  in.shape = shape;
  const int64_t rows = shape.text_tokens + shape.seq_tokens;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  in.q.resize(shape.batch * rows * shape.heads * shape.head_dim);
  in.k.resize(shape.batch * rows * shape.kv_heads_or_heads() * shape.head_dim);
  in.v.resize(in.k.size());
  for (float& x : in.q) x = dist(rng);
  for (float& x : in.k) x = dist(rng);
  for (float& x : in.v) x = dist(rng);
  return in;
}

std::vector<float> DenseAttention(const DenseInputs& in) {
  const AttentionShape& s = in.shape;
  const int64_t rows = s.text_tokens + s.seq_tokens, hk = s.kv_heads_or_heads();
  std::vector<float> out(s.batch * rows * s.heads * s.head_dim);
  std::vector<float> lse(s.batch * rows * s.heads);
  auto cq = const_cast<float*>(in.q.data());
  auto ck = const_cast<float*>(in.k.data());
  auto cv = const_cast<float*>(in.v.data());
  AttentionRef(TensorView::Dense(cq, s.batch, rows, s.heads, s.head_dim),
               TensorView::Dense(ck, s.batch, rows, hk, s.head_dim),
               TensorView::Dense(cv, s.batch, rows, hk, s.head_dim),
               TensorView::Dense(out.data(), s.batch, rows, s.heads, s.head_dim),
               TensorView::Dense(lse.data(), s.batch, rows, s.heads, 1),
               1.0 / std::sqrt(static_cast<double>(s.head_dim)));
  return out;
}

Result<std::vector<RankOutput>> ExecuteSchedule(const Schedule& s, const DenseInputs& in,
                                                const ExecutorOptions& opt) {
  if (opt.validate) {
    const ValidationReport rep = ValidateSchedule(s);
    if (!rep.ok()) return Fail("invalid schedule:\n" + rep.ToString());
  }
  const AttentionShape& shape = s.shape;
  const int64_t T = shape.text_tokens, rows = T + shape.seq_tokens, d = shape.head_dim;
  const int64_t hk = shape.kv_heads_or_heads();
  if (in.q.size() != static_cast<size_t>(shape.batch * rows * shape.heads * d) ||
      in.k.size() != static_cast<size_t>(shape.batch * rows * hk * d) ||
      in.v.size() != in.k.size()) {
    return Fail("inputs do not match the schedule's shape");
  }
  const int n = static_cast<int>(s.ranks.size());
  std::vector<std::vector<std::vector<float>>> mem(n);
  for (int r = 0; r < n; ++r) {
    const RankProgram& p = s.ranks[r];
    for (const BufferDecl& b : p.buffers) {
      const float init = b.init == BufferInit::kZero     ? 0.f
                         : b.init == BufferInit::kNegInf ? -std::numeric_limits<float>::infinity()
                                                         : std::numeric_limits<float>::quiet_NaN();
      mem[r].emplace_back(b.elements(shape.batch), init);
    }
    auto fill = [&](int buf, const std::vector<float>& g, int64_t heads, int64_t row0,
                    int64_t tokens) {
      if (buf >= 0) FillRows(g, rows, shape.batch, heads, d, row0, tokens, &mem[r][buf]);
    };
    fill(p.q, in.q, shape.heads, T + p.image_token_begin, p.image_token_count);
    fill(p.k, in.k, hk, T + p.image_token_begin, p.image_token_count);
    fill(p.v, in.v, hk, T + p.image_token_begin, p.image_token_count);
    fill(p.text_q, in.q, shape.heads, 0, T);
    fill(p.text_k, in.k, hk, 0, T);
    fill(p.text_v, in.v, hk, 0, T);
  }
  Shared sh;
  sh.n = n;
  sh.counters.resize(n);
  sh.blocked_at.resize(n);
  sh.is_blocked.assign(n, 0);
  std::vector<std::thread> threads;
  std::vector<std::string> thread_errors(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        RankRunner(s, r, &mem, &sh, opt).Run();
      } catch (const std::exception& e) {
        thread_errors[r] = e.what();
        std::lock_guard<std::mutex> g(sh.m);
        sh.abort = true;
        sh.cv.notify_all();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    if (!thread_errors[r].empty())
      return Fail("rank " + std::to_string(r) + ": " + thread_errors[r]);
  }
  if (sh.abort) return Fail(sh.error);
  std::vector<RankOutput> outs(n);
  for (int r = 0; r < n; ++r) {
    const RankProgram& p = s.ranks[r];
    if (p.out >= 0) outs[r].out = std::move(mem[r][p.out]);
    if (p.text_out >= 0) outs[r].text_out = std::move(mem[r][p.text_out]);
  }
  return outs;
}

std::string Comparison::ToString() const {
  std::ostringstream os;
  os << "max abs error " << max_abs_error << " (max |ref| " << max_abs_ref << ", relative "
     << max_rel_error << "), text replicas differ by " << text_replica_diff;
  return os.str();
}

Comparison CompareWithDense(const Schedule& s, const std::vector<float>& dense,
                            const std::vector<RankOutput>& outputs) {
  const AttentionShape& shape = s.shape;
  const int64_t T = shape.text_tokens, rows = T + shape.seq_tokens,
                row = shape.heads * shape.head_dim;
  Comparison c;
  for (float x : dense) c.max_abs_ref = std::max(c.max_abs_ref, std::fabs(static_cast<double>(x)));
  auto diff = [](double a, double b) {
    const double e = std::fabs(a - b);
    return std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
  };
  DS_CHECK(outputs.size() == s.ranks.size(), "one output per rank expected");
  for (size_t r = 0; r < outputs.size(); ++r) {
    const RankProgram& p = s.ranks[r];
    const RankOutput& o = outputs[r];
    DS_CHECK(static_cast<int64_t>(o.out.size()) == shape.batch * p.image_token_count * row, "rank ",
             r, ": out has the wrong size");
    for (int64_t b = 0; b < shape.batch; ++b) {
      for (int64_t t = 0; t < p.image_token_count; ++t) {
        const float* ref = dense.data() + (b * rows + T + p.image_token_begin + t) * row;
        const float* got = o.out.data() + (b * p.image_token_count + t) * row;
        for (int64_t x = 0; x < row; ++x)
          c.max_abs_error = std::max(c.max_abs_error, diff(ref[x], got[x]));
      }
    }
    if (T == 0) continue;
    DS_CHECK(static_cast<int64_t>(o.text_out.size()) == shape.batch * T * row, "rank ", r,
             ": text_out has the wrong size");
    for (int64_t b = 0; b < shape.batch; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        const float* ref = dense.data() + (b * rows + t) * row;
        const float* got = o.text_out.data() + (b * T + t) * row;
        const float* first = outputs[0].text_out.data() + (b * T + t) * row;
        for (int64_t x = 0; x < row; ++x) {
          c.max_abs_error = std::max(c.max_abs_error, diff(ref[x], got[x]));
          c.text_replica_diff = std::max(c.text_replica_diff, diff(first[x], got[x]));
        }
      }
    }
  }
  c.max_rel_error = c.max_abs_ref > 0 ? c.max_abs_error / c.max_abs_ref : c.max_abs_error;
  return c;
}

}  // namespace ditscale::sp
