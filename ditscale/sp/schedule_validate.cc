// ValidateSchedule: structural checks and a token-game run of the execution model (schedule.h).
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "ditscale/sp/schedule.h"

namespace ditscale::sp {
namespace {

std::string Where(const RankProgram& prog, size_t i) {
  std::ostringstream os;
  os << "rank " << prog.rank << " op #" << i << " (" << ToString(prog.ops[i].kind);
  if (!prog.ops[i].label.empty()) os << " '" << prog.ops[i].label << "'";
  os << ")";
  return os.str();
}

// The token game of ValidateSchedule: the execution model (schedule.h) with zero-time ops. On
// each stream the unit at the head starts once its ops' dependencies are done; Send/Recv pairs
// complete when both have started, Waits when their counter is reached, other ops at once.
class TokenGameRun {
 public:
  TokenGameRun(const Schedule& s, const std::map<std::pair<int, int>, std::pair<int, int>>& partner)
      : s_(s), partner_(partner), st_(s.mesh.ranks()) {
    for (int r = 0; r < static_cast<int>(st_.size()); ++r) {
      const RankProgram& prog = s_.ranks[r];
      for (size_t i = 0; i < prog.ops.size(); ++i) {
        st_[r].stream_ops[static_cast<int>(prog.ops[i].stream)].push_back(static_cast<int>(i));
      }
      st_[r].started.assign(prog.ops.size(), 0);
      st_[r].done.assign(prog.ops.size(), 0);
      remaining_ += prog.ops.size();
    }
  }

  // Plays until every op completed (nullopt) or nothing moves (the deadlock's description).
  std::optional<std::string> Play() {
    bool progress = true;
    while (remaining_ > 0 && progress) {
      progress = false;
      for (int r = 0; r < static_cast<int>(st_.size()); ++r) {
        for (int sidx = 0; sidx < kNumStreams; ++sidx) progress |= AdvanceStream(r, sidx);
      }
    }
    if (remaining_ == 0) return std::nullopt;
    return Deadlock();
  }

 private:
  struct RankState {
    std::vector<std::vector<int>> stream_ops{kNumStreams};
    std::vector<size_t> pos = std::vector<size_t>(kNumStreams, 0);  // first op of current unit
    std::vector<size_t> unit_end = std::vector<size_t>(kNumStreams, 0);
    std::vector<char> started, done;
    std::map<std::string, int64_t> counters;
  };

  void Complete(int r, int i) {
    const Op& op = s_.ranks[r].ops[i];
    st_[r].done[i] = 1;
    --remaining_;
    if ((op.kind == OpKind::kSignal || op.kind == OpKind::kPut) && !op.counter.empty()) {
      st_[op.peer].counters[op.counter] += op.count;
    }
  }

  // Starts the unit at the stream's head when its dependencies are done; false: not ready.
  bool TryStart(int r, int sidx, bool* progress) {
    const RankProgram& prog = s_.ranks[r];
    RankState& rs = st_[r];
    const std::vector<int>& ops = rs.stream_ops[sidx];
    const size_t pos = rs.pos[sidx];
    if (rs.started[ops[pos]]) return true;
    size_t end = pos + 1;
    const int g = prog.ops[ops[pos]].group;
    while (g >= 0 && end < ops.size() && prog.ops[ops[end]].group == g) ++end;
    bool ready = true;
    for (size_t u = pos; u < end && ready; ++u) {
      for (int dep : prog.ops[ops[u]].deps) ready = ready && rs.done[dep];
    }
    if (!ready) return false;
    rs.unit_end[sidx] = end;
    for (size_t u = pos; u < end; ++u) rs.started[ops[u]] = 1;
    *progress = true;
    return true;
  }

  // Completes what can complete of the started unit; true when all of it is done.
  bool TryComplete(int r, int sidx, bool* progress) {
    const RankProgram& prog = s_.ranks[r];
    RankState& rs = st_[r];
    const std::vector<int>& ops = rs.stream_ops[sidx];
    for (size_t u = rs.pos[sidx]; u < rs.unit_end[sidx]; ++u) {
      const int i = ops[u];
      if (rs.done[i]) continue;
      const Op& op = prog.ops[i];
      if (op.kind == OpKind::kSend || op.kind == OpKind::kRecv) {
        const auto& p = partner_.at({r, i});
        if (st_[p.first].started[p.second]) {
          Complete(r, i);
          if (!st_[p.first].done[p.second]) Complete(p.first, p.second);
          *progress = true;
        }
      } else if (op.kind == OpKind::kWait) {
        if (rs.counters[op.counter] >= op.count) {
          Complete(r, i);
          *progress = true;
        }
      } else {
        Complete(r, i);
        *progress = true;
      }
    }
    bool unit_done = true;
    for (size_t u = rs.pos[sidx]; u < rs.unit_end[sidx]; ++u) {
      unit_done = unit_done && rs.done[ops[u]];
    }
    return unit_done;
  }

  // Runs rank r's stream until its head unit cannot start or finish; true when anything moved.
  bool AdvanceStream(int r, int sidx) {
    RankState& rs = st_[r];
    bool progress = false;
    while (rs.pos[sidx] < rs.stream_ops[sidx].size()) {
      if (!TryStart(r, sidx, &progress)) break;
      if (!TryComplete(r, sidx, &progress)) break;
      rs.pos[sidx] = rs.unit_end[sidx];
    }
    return progress;
  }

  std::string Deadlock() const {
    std::ostringstream os;
    os << "deadlock: " << remaining_ << " ops never complete; blocked at:";
    for (int r = 0; r < static_cast<int>(st_.size()); ++r) {
      for (int sidx = 0; sidx < kNumStreams; ++sidx) {
        if (st_[r].pos[sidx] < st_[r].stream_ops[sidx].size()) {
          const int i = st_[r].stream_ops[sidx][st_[r].pos[sidx]];
          os << "\n  " << Where(s_.ranks[r], i) << " on " << ToString(static_cast<Stream>(sidx))
             << (st_[r].started[i] ? " (started, waiting for its peer or counter)"
                                   : " (waiting for deps)");
        }
      }
    }
    return os.str();
  }

  const Schedule& s_;
  const std::map<std::pair<int, int>, std::pair<int, int>>& partner_;
  std::vector<RankState> st_;
  size_t remaining_ = 0;
};

class Checker {
 public:
  explicit Checker(const Schedule& s) : s_(s) {}

  ValidationReport Run() {
    CheckHeader();
    if (!report_.ok()) return report_;
    for (const RankProgram& prog : s_.ranks) CheckRank(prog);
    CheckMatching();
    if (report_.ok()) TokenGame();
    return report_;
  }

 private:
  template <typename... A>
  void Err(A&&... args) {
    std::ostringstream os;
    (os << ... << args);
    report_.errors.push_back(os.str());
  }

  void CheckHeader() {
    if (s_.mesh.machines < 1 || s_.mesh.gpus_per_machine < 1) {
      Err("mesh: machines and gpus_per_machine must be >= 1");
      return;
    }
    if (static_cast<int>(s_.ranks.size()) != s_.mesh.ranks()) {
      Err("schedule has ", s_.ranks.size(), " rank programs, mesh has ", s_.mesh.ranks());
    }
    for (size_t r = 0; r < s_.ranks.size(); ++r) {
      if (s_.ranks[r].rank != static_cast<int>(r)) Err("ranks[", r, "].rank is ", s_.ranks[r].rank);
    }
  }

  // Region inside buffer bounds; returns the decl or nullptr.
  const BufferDecl* CheckRegion(const RankProgram& owner, const Region& r, const std::string& where,
                                const char* field) {
    if (!r.valid()) {
      Err(where, ": field '", field, "' missing");
      return nullptr;
    }
    if (r.buffer >= static_cast<int>(owner.buffers.size())) {
      Err(where, ": field '", field, "' names buffer ", r.buffer, " but rank ", owner.rank, " has ",
          owner.buffers.size(), " buffers");
      return nullptr;
    }
    const BufferDecl& d = owner.buffers[r.buffer];
    if (r.token_begin < 0 || r.tokens < 0 || r.token_begin + r.tokens > d.tokens ||
        r.head_begin < 0 || r.heads < 0 || r.head_begin + r.heads > d.heads) {
      Err(where, ": field '", field, "' region t[", r.token_begin, ",", r.token_begin + r.tokens,
          ") h[", r.head_begin, ",", r.head_begin + r.heads, ") outside buffer '", d.name, "' [",
          d.tokens, ",", d.heads, "]");
      return nullptr;
    }
    return &d;
  }

  void SameShape(const Region& a, const BufferDecl* da, const Region& b, const BufferDecl* db,
                 const std::string& where, const char* fa, const char* fb) {
    if (da == nullptr || db == nullptr) return;
    if (a.tokens != b.tokens || a.heads != b.heads || da->width != db->width ||
        da->element_bytes != db->element_bytes) {
      Err(where, ": '", fa, "' (", da->name, " ", a.tokens, "x", a.heads, "x", da->width, ") and '",
          fb, "' (", db->name, " ", b.tokens, "x", b.heads, "x", db->width,
          ") differ in shape or dtype");
    }
  }

  void CheckBytes(const Op& op, const Region& r, const BufferDecl* d, const std::string& where) {
    if (d == nullptr) return;
    const int64_t want = RegionBytes(r, *d, s_.shape.batch);
    if (op.bytes != want) Err(where, ": bytes is ", op.bytes, ", its region holds ", want);
  }

  void CheckBuffers(const RankProgram& prog) {
    std::set<std::string> names;
    for (const BufferDecl& d : prog.buffers) {
      if (!names.insert(d.name).second)
        Err("rank ", prog.rank, ": buffer name '", d.name, "' twice");
      if (d.tokens < 0 || d.heads < 0 || d.width < 1 || d.element_bytes < 1) {
        Err("rank ", prog.rank, ": buffer '", d.name, "' has a bad shape or element size");
      }
    }
  }

  // Op i's dependencies are earlier ops; its group is one run of ops on one stream and none of
  // its dependencies (group_end: group id -> stream, last op index so far).
  void CheckDepsAndGroup(const RankProgram& prog, size_t i, const std::string& w,
                         std::map<int, std::pair<Stream, size_t>>& group_end) {
    const Op& op = prog.ops[i];
    for (int dep : op.deps) {
      if (dep < 0 || dep >= static_cast<int>(i)) Err(w, ": dep ", dep, " is not an earlier op");
    }
    if (op.group < 0) return;
    auto it = group_end.find(op.group);
    if (it != group_end.end()) {
      bool contiguous = it->second.first == op.stream;
      for (size_t j = it->second.second + 1; j < i && contiguous; ++j) {
        if (prog.ops[j].stream == op.stream && prog.ops[j].group != op.group) contiguous = false;
      }
      if (!contiguous) Err(w, ": group ", op.group, " is not one run of ops on one stream");
    }
    group_end[op.group] = {op.stream, i};
    for (int dep : op.deps) {
      if (dep >= 0 && dep < static_cast<int>(i) && prog.ops[dep].group == op.group &&
          prog.ops[dep].stream == op.stream) {
        Err(w, ": depends on op #", dep, " of its own group");
      }
    }
  }

  // A transfer's peer is another rank and its link kind the mesh's; false: no valid peer.
  bool CheckPeer(const RankProgram& prog, const Op& op, const std::string& w) {
    const bool comm = op.kind == OpKind::kSend || op.kind == OpKind::kRecv ||
                      op.kind == OpKind::kPut || op.kind == OpKind::kSignal;
    if (!comm) return true;
    const int n = s_.mesh.ranks();
    if (op.peer < 0 || op.peer >= n || op.peer == prog.rank) {
      Err(w, ": peer ", op.peer, " is not another rank in [0, ", n, ")");
      return false;
    }
    const LinkKind want = s_.mesh.same_machine(prog.rank, op.peer) ? LinkKind::kIntraMachine
                                                                   : LinkKind::kInterMachine;
    if (op.link != want) Err(w, ": link is ", ToString(op.link), ", mesh says ", ToString(want));
    return true;
  }

  void CheckAttention(const RankProgram& prog, const Op& op, const std::string& w) {
    const int64_t d = s_.shape.head_dim;
    const int64_t group = s_.shape.heads / std::max<int64_t>(1, s_.shape.kv_heads_or_heads());
    const BufferDecl* q = CheckRegion(prog, op.src, w, "src");
    const BufferDecl* k = CheckRegion(prog, op.key, w, "key");
    const BufferDecl* v = CheckRegion(prog, op.value, w, "value");
    const BufferDecl* o = CheckRegion(prog, op.dst, w, "dst");
    const BufferDecl* l = CheckRegion(prog, op.dst_lse, w, "dst_lse");
    if (!q || !k || !v || !o || !l) return;
    SameShape(op.key, k, op.value, v, w, "key", "value");
    SameShape(op.src, q, op.dst, o, w, "src", "dst");
    if (q->width != d || k->width != d || l->width != 1) {
      Err(w, ": q/k/v/out width must be head_dim ", d, " and lse width 1");
    }
    if (op.src.heads != op.key.heads * group) {
      Err(w, ": ", op.src.heads, " query heads against ", op.key.heads,
          " kv heads, expected a ratio of heads/kv_heads = ", group);
    }
    if (op.dst_lse.tokens != op.src.tokens || op.dst_lse.heads != op.src.heads) {
      Err(w, ": dst_lse does not match the query block");
    }
    const double flops = 4.0 * s_.shape.batch * op.src.heads * op.src.tokens * op.key.tokens * d;
    if (op.flops != flops) Err(w, ": flops is ", op.flops, ", expected ", flops);
  }

  // The regions, shapes and byte counts of one op, by kind.
  void CheckOpRegions(const RankProgram& prog, const Op& op, const std::string& w) {
    switch (op.kind) {
      case OpKind::kSend: {
        const BufferDecl* b = CheckRegion(prog, op.src, w, "src");
        CheckBytes(op, op.src, b, w);
        break;
      }
      case OpKind::kRecv: {
        const BufferDecl* b = CheckRegion(prog, op.dst, w, "dst");
        CheckBytes(op, op.dst, b, w);
        break;
      }
      case OpKind::kPut: {
        const BufferDecl* a = CheckRegion(prog, op.src, w, "src");
        const BufferDecl* b = CheckRegion(s_.ranks[op.peer], op.dst, w + " (peer's buffer)", "dst");
        SameShape(op.src, a, op.dst, b, w, "src", "dst");
        CheckBytes(op, op.src, a, w);
        if (op.counter.empty() != (op.count == 0)) {
          Err(w, ": a put-with-signal needs both counter and a non-zero value");
        }
        break;
      }
      case OpKind::kSignal:
      case OpKind::kWait:
        if (op.counter.empty()) Err(w, ": field 'counter' missing");
        if (op.kind == OpKind::kSignal && op.count <= 0) Err(w, ": increment must be > 0");
        if (op.kind == OpKind::kWait && op.dst.valid()) CheckRegion(prog, op.dst, w, "dst");
        break;
      case OpKind::kPack:
      case OpKind::kUnpack:
      case OpKind::kCopy: {
        const BufferDecl* a = CheckRegion(prog, op.src, w, "src");
        const BufferDecl* b = CheckRegion(prog, op.dst, w, "dst");
        SameShape(op.src, a, op.dst, b, w, "src", "dst");
        CheckBytes(op, op.src, a, w);
        break;
      }
      case OpKind::kAttention:
        CheckAttention(prog, op, w);
        break;
      case OpKind::kMerge: {
        const BufferDecl* a = CheckRegion(prog, op.src, w, "src");
        const BufferDecl* b = CheckRegion(prog, op.dst, w, "dst");
        const BufferDecl* la = CheckRegion(prog, op.src_lse, w, "src_lse");
        const BufferDecl* lb = CheckRegion(prog, op.dst_lse, w, "dst_lse");
        SameShape(op.src, a, op.dst, b, w, "src", "dst");
        SameShape(op.src_lse, la, op.dst_lse, lb, w, "src_lse", "dst_lse");
        if (a && la && (op.src.tokens != op.src_lse.tokens || op.src.heads != op.src_lse.heads)) {
          Err(w, ": src_lse does not match src");
        }
        CheckBytes(op, op.src, a, w);
        break;
      }
    }
  }

  void CheckRank(const RankProgram& prog) {
    CheckBuffers(prog);
    std::map<int, std::pair<Stream, size_t>> group_end;  // group id -> stream, last op index
    for (size_t i = 0; i < prog.ops.size(); ++i) {
      const Op& op = prog.ops[i];
      const std::string w = Where(prog, i);
      CheckDepsAndGroup(prog, i, w, group_end);
      if (!CheckPeer(prog, op, w)) continue;
      CheckOpRegions(prog, op, w);
    }
  }

  using Key = std::tuple<int, int, int64_t>;  // sender, receiver, tag

  void CheckMatching() {
    std::map<Key, std::pair<int, int>> sends, recvs;  // -> (rank, op)
    std::map<std::pair<int, std::string>, int64_t> signalled;
    for (const RankProgram& prog : s_.ranks) {
      for (size_t i = 0; i < prog.ops.size(); ++i) {
        const Op& op = prog.ops[i];
        if (op.peer < 0 || op.peer >= s_.mesh.ranks()) continue;
        if (op.kind == OpKind::kSend || op.kind == OpKind::kRecv) {
          const bool send = op.kind == OpKind::kSend;
          const Key key = send ? Key{prog.rank, op.peer, op.tag} : Key{op.peer, prog.rank, op.tag};
          auto& map = send ? sends : recvs;
          if (!map.emplace(key, std::make_pair(prog.rank, static_cast<int>(i))).second) {
            Err(Where(prog, i), ": a second ", ToString(op.kind), " with tag ", op.tag,
                " between ranks ", std::get<0>(key), " -> ", std::get<1>(key));
          }
        }
        if ((op.kind == OpKind::kSignal || op.kind == OpKind::kPut) && !op.counter.empty()) {
          signalled[{op.peer, op.counter}] += op.count;
        }
      }
    }
    for (const auto& [key, where] : sends) {
      const RankProgram& prog = s_.ranks[where.first];
      auto it = recvs.find(key);
      if (it == recvs.end()) {
        Err(Where(prog, where.second), ": no matching Recv on rank ", std::get<1>(key), " (tag ",
            std::get<2>(key), ")");
        continue;
      }
      const Op& send = prog.ops[where.second];
      const Op& recv = s_.ranks[it->second.first].ops[it->second.second];
      if (send.bytes != recv.bytes) {
        Err(Where(prog, where.second), ": sends ", send.bytes, " bytes, the matching Recv on rank ",
            it->second.first, " expects ", recv.bytes);
      }
      partner_[{where.first, where.second}] = it->second;
      partner_[it->second] = where;
    }
    for (const auto& [key, where] : recvs) {
      if (!sends.count(key)) {
        Err(Where(s_.ranks[where.first], where.second), ": no matching Send from rank ",
            std::get<0>(key), " (tag ", std::get<2>(key), ")");
      }
    }
    for (const RankProgram& prog : s_.ranks) {
      for (size_t i = 0; i < prog.ops.size(); ++i) {
        const Op& op = prog.ops[i];
        if (op.kind != OpKind::kWait || op.counter.empty()) continue;
        const int64_t got = signalled[{prog.rank, op.counter}];
        if (got < op.count) {
          Err(Where(prog, i), ": waits for counter '", op.counter, "' >= ", op.count,
              " but all signals to it add up to ", got);
        }
      }
    }
  }

  // Runs the execution model with zero-time ops until everything completed or nothing moves.
  void TokenGame() {
    if (auto deadlock = TokenGameRun(s_, partner_).Play()) Err(*deadlock);
  }

  const Schedule& s_;
  ValidationReport report_;
  std::map<std::pair<int, int>, std::pair<int, int>> partner_;
};

}  // namespace

std::string ValidationReport::ToString() const {
  std::string s;
  for (const std::string& e : errors) s += e + "\n";
  return s;
}

ValidationReport ValidateSchedule(const Schedule& schedule) { return Checker(schedule).Run(); }

}  // namespace ditscale::sp
