#include "ditscale/sp/simulator.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <sstream>

#include "ditscale/sp/internal/sim.h"

namespace ditscale::sp {
namespace internal {

void Sim::Build() {
  n_ = s_.mesh.ranks();
  offset_.assign(n_ + 1, 0);
  for (int r = 0; r < n_; ++r) offset_[r + 1] = offset_[r] + int(s_.ranks[r].ops.size());
  ops_.resize(offset_[n_]);
  stream_units_.resize(n_);
  head_.assign(n_, {0, 0, 0});
  std::map<std::tuple<int, int, int64_t>, std::pair<int, int>> match;  // send gid, recv gid
  for (int r = 0; r < n_; ++r) {
    const RankProgram& p = s_.ranks[r];
    int last_group[kNumStreams] = {-2, -2, -2};
    for (int i = 0; i < int(p.ops.size()); ++i) {
      int g = offset_[r] + i;
      OpState& o = ops_[g];
      o.rank = r;
      o.index = i;
      o.op = &p.ops[i];
      o.deps_left = int(o.op->deps.size());
      for (int d : o.op->deps) {
        DS_CHECK(d >= 0 && d < i, "rank ", r, " op ", i, " (", o.op->label, "): dep ", d,
                 " is not an earlier op");
        ops_[offset_[r] + d].dependents.push_back(g);
      }
      int st = static_cast<int>(o.op->stream);
      DS_CHECK(st >= 0 && st < kNumStreams, "rank ", r, " op ", i, ": bad stream");
      int grp = o.op->group;
      if (grp < 0 || grp != last_group[st]) {
        units_.push_back({});
        unit_left_.push_back(0);
        stream_units_[r][st].push_back(int(units_.size()) - 1);
      }
      last_group[st] = grp < 0 ? -2 : grp;
      int u = stream_units_[r][st].back();
      units_[u].push_back(g);
      ++unit_left_[u];
      o.unit = u;
      if (o.op->kind == OpKind::kSend || o.op->kind == OpKind::kRecv) {
        bool send = o.op->kind == OpKind::kSend;
        auto key = send ? std::make_tuple(r, o.op->peer, o.op->tag)
                        : std::make_tuple(o.op->peer, r, o.op->tag);
        auto it = match.try_emplace(key, -1, -1).first;
        int& slot = send ? it->second.first : it->second.second;
        DS_CHECK(slot < 0, "rank ", r, " op ", i, " (", o.op->label, "): duplicate ",
                 ToString(o.op->kind), " tag ", o.op->tag);
        slot = g;
      }
    }
  }
  for (auto& [key, pr] : match) {
    DS_CHECK(pr.first >= 0 && pr.second >= 0, "unmatched send/recv from rank ", std::get<0>(key),
             " to rank ", std::get<1>(key), " tag ", std::get<2>(key));
    ops_[pr.first].partner = pr.second;
    ops_[pr.second].partner = pr.first;
  }
  compute_running_.assign(n_, 0);
  comm_pending_.assign(n_, 0);
  res_.ranks.assign(n_, {});
}

void Sim::Issue(int gid, int releaser, double release_t) {
  OpState& o = ops_[gid];
  o.issued = true;
  if (releaser >= 0 && release_t >= o.release_t) {
    o.release_t = release_t;
    o.released_by = releaser;
  }
  if (IsCommKind(o.op->kind) || o.op->stream != Stream::kCompute) ++comm_pending_[o.rank];
  if (o.deps_left == 0) post_queue_.push_back(gid);
}

void Sim::StartTransfer(int gid, int src, int dst, int64_t bytes, double delay, bool two_sided) {
  Activity a;
  a.gid = gid;
  a.src = src;
  a.dst = dst;
  a.two_sided = two_sided;
  a.needs_sm = two_sided || !t_.SameMachine(src, dst);
  a.t0 = now_;
  if (src == dst) {
    a.phase = Phase::kWork;
    a.remaining = t_.MemorySeconds(2.0 * bytes);
  } else {
    a.phase = Phase::kDelay;
    a.remaining = delay + (t_.SameMachine(src, dst) ? t_.intra_latency_s : t_.inter_latency_s);
    a.bytes = bytes;
  }
  acts_.push_back(a);
}

void Sim::Post(int gid) {
  OpState& o = ops_[gid];
  o.posted = true;
  o.post_t = now_;
  const Op& op = *o.op;
  switch (op.kind) {
    case OpKind::kAttention:
    case OpKind::kMerge:
    case OpKind::kPack:
    case OpKind::kUnpack:
    case OpKind::kCopy: {
      Activity a;
      a.gid = gid;
      a.src = a.dst = o.rank;
      if (op.kind == OpKind::kAttention) {
        a.remaining = t_.AttentionSeconds(op.flops, double(op.src.tokens), double(op.key.tokens),
                                          double(s_.shape.batch) * double(op.src.heads),
                                          op.stream == Stream::kCompute ? compute_sms_ : 0);
      } else {
        a.remaining = t_.MemorySeconds((op.kind == OpKind::kMerge ? 3.0 : 2.0) * op.bytes);
      }
      a.compute_stream = op.stream == Stream::kCompute;
      a.comm_kernel = !a.compute_stream;
      a.t0 = now_;
      if (a.compute_stream) ++compute_running_[o.rank];
      o.started = true;
      o.start_t = now_;
      acts_.push_back(a);
      break;
    }
    case OpKind::kSend:
    case OpKind::kRecv: {
      OpState& p = ops_[o.partner];
      if (!p.posted) break;  // rendezvous: the partner starts the pair
      int send = op.kind == OpKind::kSend ? gid : o.partner;
      int recv = o.partner == send ? gid : o.partner;
      // The pair's critical-path predecessor is the releaser of the side posted last (this one).
      for (int g : {gid, o.partner}) {
        ops_[g].started = true;
        ops_[g].start_t = now_;
      }
      p.released_by = o.released_by;
      p.release_t = o.release_t;
      StartTransfer(send, ops_[send].rank, ops_[recv].rank, ops_[send].op->bytes,
                    t_.two_sided_sync_s, true);
      break;
    }
    case OpKind::kPut:
      o.started = true;
      o.start_t = now_;
      StartTransfer(gid, o.rank, op.peer, op.bytes, t_.one_sided_overhead_s, false);
      break;
    case OpKind::kSignal:
      o.started = true;
      o.start_t = now_;
      StartTransfer(gid, o.rank, op.peer, 0, t_.one_sided_overhead_s, false);
      break;
    case OpKind::kWait: {
      auto key = std::make_pair(o.rank, op.counter);
      if (counters_[key] >= op.count) {
        o.started = true;
        o.start_t = now_;
        complete_queue_.push_back({gid, -1});
      } else {
        waiters_[key].push_back(gid);
      }
      break;
    }
  }
}

void Sim::RaiseCounter(int rank, const std::string& name, int64_t value, int releaser) {
  auto key = std::make_pair(rank, name);
  int64_t& c = counters_[key];
  c += value;
  auto it = waiters_.find(key);
  if (it == waiters_.end()) return;
  std::vector<int>& w = it->second;
  for (size_t i = 0; i < w.size();) {
    OpState& o = ops_[w[i]];
    if (c >= o.op->count) {
      o.started = true;
      o.start_t = now_;
      o.released_by = releaser;
      o.release_t = now_;
      complete_queue_.push_back({w[i], -1});
      w[i] = w.back();
      w.pop_back();
    } else {
      ++i;
    }
  }
}

void Sim::Complete(int gid, int releaser) {
  OpState& o = ops_[gid];
  if (o.done) return;
  o.done = true;
  o.end_t = now_;
  ++done_count_;
  RankBreakdown& rb = res_.ranks[o.rank];
  rb.end_s = std::max(rb.end_s, now_);
  if (o.op->kind == OpKind::kAttention) rb.attention_s += now_ - o.start_t;
  if (IsCommKind(o.op->kind) || o.op->stream != Stream::kCompute) --comm_pending_[o.rank];
  for (int d : o.dependents) {
    OpState& x = ops_[d];
    if (now_ >= x.release_t) {
      x.release_t = now_;
      x.released_by = gid;
    }
    if (--x.deps_left == 0 && x.issued) post_queue_.push_back(d);
  }
  if (--unit_left_[o.unit] == 0) {
    int st = static_cast<int>(o.op->stream);
    int& h = head_[o.rank][st];
    ++h;
    const auto& su = stream_units_[o.rank][st];
    if (h < int(su.size())) {
      for (int g : units_[su[h]]) Issue(g, gid, now_);
    }
  }
  const Op& op = *o.op;
  if ((op.kind == OpKind::kPut && !op.counter.empty()) || op.kind == OpKind::kSignal) {
    RaiseCounter(op.peer, op.counter, op.count, gid);
  }
}

void Sim::Drain() {
  while (!post_queue_.empty() || !complete_queue_.empty()) {
    if (!complete_queue_.empty()) {
      auto [g, rel] = complete_queue_.front();
      complete_queue_.pop_front();
      Complete(g, rel);
    } else {
      int g = post_queue_.front();
      post_queue_.pop_front();
      if (!ops_[g].posted) Post(g);
    }
  }
}

// The schedule's mesh and rank count match the topology; the SM partition's rates.
std::optional<Failure> Sim::Check() {
  if (s_.mesh.machines != t_.machines || s_.mesh.gpus_per_machine != t_.gpus_per_machine) {
    return Failure::InvalidArgument("schedule mesh " + std::to_string(s_.mesh.machines) + "x" +
                                        std::to_string(s_.mesh.gpus_per_machine) +
                                        " does not match topology " + std::to_string(t_.machines) +
                                        "x" + std::to_string(t_.gpus_per_machine),
                                    "machines");
  }
  if (int(s_.ranks.size()) != s_.mesh.ranks()) {
    return Failure::InvalidArgument("schedule has " + std::to_string(s_.ranks.size()) +
                                        " rank programs for " + std::to_string(s_.mesh.ranks()) +
                                        " ranks",
                                    "ranks");
  }
  if (s_.config.comm_sms > 0) {
    Result<int> sms = t_.ComputeSms(s_.config.comm_sms);
    if (!sms.ok()) return sms.failure();
    compute_sms_ = *sms;
    free_sm_Bps_ = (t_.gpu_sms - compute_sms_) * t_.comm_sm_Bps;
  }
  return std::nullopt;
}

// One event: every activity runs dt at its rate (the one that ends first ends); the breakdown
// of [now, now + dt) is counted; finished delays turn into data phases, finished ops complete.
void Sim::Advance() {
  Recompute();
  double dt = std::numeric_limits<double>::infinity();
  for (const Activity& a : acts_) dt = std::min(dt, a.remaining / a.rate);
  for (int r = 0; r < n_; ++r) {
    RankBreakdown& rb = res_.ranks[r];
    if (comm_pending_[r] > 0) rb.comm_active_s += dt;
    if (compute_running_[r] > 0) {
      rb.compute_s += dt;
    } else if (comm_pending_[r] > 0) {
      rb.exposed_comm_s += dt;
    }
  }
  if (inter_flows_ > 0) res_.inter_busy_s += dt;
  now_ += dt;
  ++res_.events;
  std::vector<Activity> next;
  std::vector<Activity> finished;
  for (Activity& a : acts_) {
    double t_left = a.remaining / a.rate - dt;
    if (t_left <= dt * 1e-9 + 1e-15) {
      finished.push_back(a);
    } else {
      a.remaining -= a.rate * dt;
      next.push_back(a);
    }
  }
  acts_.swap(next);
  for (Activity& a : finished) Finish(a);
  Drain();
}

// An activity at its end: a delay phase goes on as its data phase; otherwise its op (and a
// rendezvous partner) completes, and a transfer's bytes are counted.
void Sim::Finish(Activity& a) {
  if (a.phase == Phase::kDelay && a.bytes > 0) {
    a.phase = Phase::kData;
    a.remaining = double(a.bytes);
    acts_.push_back(a);
    return;
  }
  if (a.phase == Phase::kWork && a.compute_stream) --compute_running_[a.src];
  OpState& o = ops_[a.gid];
  if (o.op->kind == OpKind::kSend || o.op->kind == OpKind::kPut) {
    bool inter = !t_.SameMachine(a.src, a.dst);
    (inter ? res_.ranks[a.src].sent_inter_bytes : res_.ranks[a.src].sent_intra_bytes) +=
        o.op->bytes;
    (inter ? res_.inter_bytes : res_.intra_bytes) += o.op->bytes;
  }
  complete_queue_.push_back({a.gid, -1});
  if (o.partner >= 0) complete_queue_.push_back({o.partner, -1});
}

// The ops that never finished (at most 8 named).
Failure Sim::DeadlockError() const {
  std::ostringstream os;
  os << "schedule deadlocks: " << ops_.size() - done_count_ << " ops never finish; first:";
  int shown = 0;
  for (const OpState& o : ops_) {
    if (o.done || shown >= 8) continue;
    ++shown;
    os << " [rank " << o.rank << " op " << o.index << " " << ToString(o.op->kind) << " '"
       << o.op->label << "' "
       << (o.posted   ? "posted"
           : o.issued ? "issued"
                      : "not issued")
       << "]";
  }
  return Failure::InvalidArgument(os.str(), "schedule");
}

// Layer time, idle time per rank, and the critical path walked back from the last op to end.
void Sim::Summarize() {
  int last = -1;
  for (int g = 0; g < int(ops_.size()); ++g) {
    if (last < 0 || ops_[g].end_t > ops_[last].end_t) last = g;
  }
  res_.layer_s = last >= 0 ? ops_[last].end_t : 0;
  for (RankBreakdown& rb : res_.ranks) {
    rb.idle_s = std::max(0.0, res_.layer_s - rb.compute_s - rb.exposed_comm_s);
  }
  CriticalPath& cp = res_.critical_path;
  for (int g = last, guard = 0; g >= 0 && guard <= int(ops_.size()); ++guard) {
    const OpState& o = ops_[g];
    double d = o.end_t - o.start_t;
    ++cp.ops;
    switch (o.op->kind) {
      case OpKind::kAttention:
        cp.attention_s += d;
        break;
      case OpKind::kMerge:
      case OpKind::kPack:
      case OpKind::kUnpack:
      case OpKind::kCopy:
        cp.memory_s += d;
        break;
      case OpKind::kSignal:
        cp.signal_s += d;
        break;
      case OpKind::kWait:
        break;
      default:
        (t_.SameMachine(o.rank, o.op->peer) ? cp.intra_transfer_s : cp.inter_transfer_s) += d;
    }
    g = o.released_by;
  }
}

// check -> build -> issue every stream's first unit -> events until nothing runs -> summary.
Result<SimResult> Sim::Run() {
  if (auto f = Check()) return *f;
  Build();
  for (int r = 0; r < n_; ++r) {
    for (int st = 0; st < kNumStreams; ++st) {
      if (!stream_units_[r][st].empty()) {
        for (int g : units_[stream_units_[r][st][0]]) Issue(g, -1, 0);
      }
    }
  }
  Drain();
  while (!acts_.empty()) Advance();
  if (done_count_ != int(ops_.size())) return DeadlockError();
  Summarize();
  return res_;
}

}  // namespace internal

std::string CriticalPath::Describe() const {
  double tot = total_s();
  struct Part {
    const char* name;
    double s;
  };
  std::vector<Part> parts = {{"attention", attention_s},
                             {"inter-machine transfer", inter_transfer_s},
                             {"intra-machine transfer", intra_transfer_s},
                             {"merge/pack", memory_s},
                             {"signals", signal_s}};
  std::stable_sort(parts.begin(), parts.end(), [](auto& a, auto& b) { return a.s > b.s; });
  std::ostringstream os;
  os.precision(3);
  bool first = true;
  for (const Part& p : parts) {
    if (p.s <= 0) continue;
    os << (first ? "" : ", ") << p.name << " " << std::llround(tot > 0 ? 100 * p.s / tot : 0)
       << "% (" << p.s * 1e3 << " ms)";
    first = false;
  }
  os << "; " << ops << " ops";
  return os.str();
}

namespace {
double MeanOf(const std::vector<RankBreakdown>& ranks, double RankBreakdown::*field) {
  double s = 0;
  for (const RankBreakdown& r : ranks) s += r.*field;
  return ranks.empty() ? 0 : s / double(ranks.size());
}
}  // namespace

double SimResult::mean_compute_s() const { return MeanOf(ranks, &RankBreakdown::compute_s); }
double SimResult::mean_exposed_comm_s() const {
  return MeanOf(ranks, &RankBreakdown::exposed_comm_s);
}
double SimResult::mean_idle_s() const { return MeanOf(ranks, &RankBreakdown::idle_s); }
double SimResult::mean_comm_active_s() const {
  return MeanOf(ranks, &RankBreakdown::comm_active_s);
}

Result<SimResult> Simulate(const Schedule& schedule, const Topology& topology) {
  Result<bool> v = topology.Validate();
  if (!v.ok()) return v.failure();
  internal::Sim sim(schedule, topology);
  return sim.Run();
}

StepPrediction PredictStep(const SimResult& layer, const Workload& workload,
                           const Topology& topology) {
  StepPrediction p;
  p.layer_s = layer.layer_s;
  p.linear_layer_s = topology.LinearSeconds(workload.LinearFlops() / topology.world_size());
  p.step_s = workload.layers * (p.layer_s + p.linear_layer_s);
  return p;
}

}  // namespace ditscale::sp
