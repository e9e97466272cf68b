#include "ditscale/runtime/exec_plan.h"

#include <algorithm>
#include <iomanip>
#include <map>
#include <optional>
#include <queue>
#include <set>
#include <sstream>
#include <tuple>

namespace ditscale::runtime {
namespace {

// A Signal, or a put with a signal: it adds `count` to `counter` on `peer`.
bool SignalsCounter(const sp::Op& o) {
  return o.kind == sp::OpKind::kSignal || (o.kind == sp::OpKind::kPut && !o.counter.empty());
}

int64_t AlignUp(int64_t x) { return (x + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment; }

bool IsTwoSided(sp::OpKind k) { return k == sp::OpKind::kSend || k == sp::OpKind::kRecv; }
bool IsOneSided(sp::OpKind k) {
  return k == sp::OpKind::kPut || k == sp::OpKind::kSignal || k == sp::OpKind::kWait;
}

std::string OpName(const sp::Schedule& s, int rank, int op) {
  std::ostringstream os;
  const sp::Op& o = s.ranks[rank].ops[op];
  os << "rank " << rank << " op #" << op << " (" << sp::ToString(o.kind) << " '" << o.label << "')";
  return os.str();
}

UserBinding BindingOf(const sp::RankProgram& p, int buffer) {
  if (buffer == p.q) return UserBinding::kQ;
  if (buffer == p.k) return UserBinding::kK;
  if (buffer == p.v) return UserBinding::kV;
  if (buffer == p.out) return UserBinding::kOut;
  if (buffer == p.text_q) return UserBinding::kTextQ;
  if (buffer == p.text_k) return UserBinding::kTextK;
  if (buffer == p.text_v) return UserBinding::kTextV;
  if (buffer == p.text_out) return UserBinding::kTextOut;
  return UserBinding::kNone;
}

// Units of one rank per stream in stream order (the ops of one NCCL group make one unit);
// *unit_of_op: each op's unit; *per_stream_units: the units of each stream.
std::vector<IssueUnit> GroupUnits(const sp::RankProgram& p, std::vector<int>* unit_of_op,
                                  std::vector<std::vector<int>>* per_stream_units) {
  const int n = static_cast<int>(p.ops.size());
  std::vector<IssueUnit> units;
  unit_of_op->assign(n, -1);
  per_stream_units->assign(sp::kNumStreams, {});
  for (int st = 0; st < sp::kNumStreams; ++st) {
    int last_group = -1, last_unit = -1;
    for (int i = 0; i < n; ++i) {
      const sp::Op& o = p.ops[i];
      if (static_cast<int>(o.stream) != st) continue;
      if (o.group >= 0 && o.group == last_group && last_unit >= 0) {
        units[last_unit].ops.push_back(i);
      } else {
        IssueUnit u;
        u.stream = o.stream;
        u.ops.push_back(i);
        units.push_back(u);
        last_unit = static_cast<int>(units.size()) - 1;
        (*per_stream_units)[st].push_back(last_unit);
      }
      last_group = o.group;
      (*unit_of_op)[i] = last_unit;
    }
  }
  return units;
}

// Edges: previous unit on the stream, and each dependency's unit; a dependency on another
// stream's unit makes that unit record an event this one waits for.
Result<std::vector<std::set<int>>> UnitEdges(const sp::Schedule& s, int rank,
                                             const std::vector<int>& unit_of_op,
                                             const std::vector<std::vector<int>>& per_stream_units,
                                             std::vector<IssueUnit>& units) {
  const sp::RankProgram& p = s.ranks[rank];
  const int n = static_cast<int>(p.ops.size());
  const int nu = static_cast<int>(units.size());
  std::vector<std::set<int>> preds(nu);
  for (int st = 0; st < sp::kNumStreams; ++st) {
    for (size_t k = 1; k < per_stream_units[st].size(); ++k) {
      preds[per_stream_units[st][k]].insert(per_stream_units[st][k - 1]);
    }
  }
  for (int u = 0; u < nu; ++u) {
    for (int op : units[u].ops) {
      for (int d : p.ops[op].deps) {
        if (d < 0 || d >= n) {
          return Failure::InvalidArgument(OpName(s, rank, op) + ": dependency " +
                                              std::to_string(d) + " is not an op of the rank",
                                          "deps");
        }
        const int du = unit_of_op[d];
        if (du == u) {
          return Failure::InvalidArgument(OpName(s, rank, op) + " depends on op #" +
                                              std::to_string(d) + " of its own NCCL group",
                                          "deps");
        }
        preds[u].insert(du);
        if (units[du].stream != units[u].stream) {
          units[du].record_event = true;
          if (std::find(units[u].wait_units.begin(), units[u].wait_units.end(), du) ==
              units[u].wait_units.end()) {
            units[u].wait_units.push_back(du);
          }
        }
      }
    }
  }
  return preds;
}

// Kahn's algorithm, lowest first-op index first; shorter than the units on a cycle.
std::vector<int> TopologicalOrder(const std::vector<IssueUnit>& units,
                                  const std::vector<std::set<int>>& preds) {
  const int nu = static_cast<int>(units.size());
  std::vector<int> indeg(nu, 0);
  std::vector<std::vector<int>> succ(nu);
  for (int u = 0; u < nu; ++u) {
    for (int q : preds[u]) {
      succ[q].push_back(u);
      ++indeg[u];
    }
  }
  using Item = std::pair<int, int>;  // (first op index, unit)
  std::priority_queue<Item, std::vector<Item>, std::greater<Item>> ready;
  for (int u = 0; u < nu; ++u) {
    if (indeg[u] == 0) ready.push({units[u].ops.front(), u});
  }
  std::vector<int> order;
  while (!ready.empty()) {
    const int u = ready.top().second;
    ready.pop();
    order.push_back(u);
    for (int v : succ[u]) {
      if (--indeg[v] == 0) ready.push({units[v].ops.front(), v});
    }
  }
  return order;
}

// Units of one rank in host issue order (see the header): group -> edges -> order -> renumber.
Result<std::vector<IssueUnit>> OrderUnits(const sp::Schedule& s, int rank,
                                          std::vector<int>* unit_of_op) {
  std::vector<std::vector<int>> per_stream_units;
  std::vector<IssueUnit> units = GroupUnits(s.ranks[rank], unit_of_op, &per_stream_units);
  const int nu = static_cast<int>(units.size());
  Result<std::vector<std::set<int>>> preds =
      UnitEdges(s, rank, *unit_of_op, per_stream_units, units);
  if (!preds.ok()) return preds.failure();
  const std::vector<int> order = TopologicalOrder(units, *preds);
  if (static_cast<int>(order.size()) != nu) {
    return Failure::InvalidArgument(
        "rank " + std::to_string(rank) +
            ": the op groups and dependencies form a cycle; the schedule cannot be "
            "issued from one host thread",
        "group");
  }
  std::vector<int> new_index(nu);
  for (int k = 0; k < nu; ++k) new_index[order[k]] = k;
  std::vector<IssueUnit> sorted(nu);
  for (int k = 0; k < nu; ++k) {
    sorted[k] = units[order[k]];
    for (int& w : sorted[k].wait_units) w = new_index[w];
    std::sort(sorted[k].wait_units.begin(), sorted[k].wait_units.end());
  }
  for (int& u : *unit_of_op) u = new_index[u];
  return sorted;
}

}  // namespace

const char* ToString(UserBinding b) {
  switch (b) {
    case UserBinding::kNone:
      return "none";
    case UserBinding::kQ:
      return "q";
    case UserBinding::kK:
      return "k";
    case UserBinding::kV:
      return "v";
    case UserBinding::kOut:
      return "out";
    case UserBinding::kTextQ:
      return "text_q";
    case UserBinding::kTextK:
      return "text_k";
    case UserBinding::kTextV:
      return "text_v";
    case UserBinding::kTextOut:
      return "text_out";
  }
  return "?";
}

int CounterTable::index(const std::string& name) const {
  auto it = std::lower_bound(names.begin(), names.end(), name);
  return it != names.end() && *it == name ? static_cast<int>(it - names.begin()) : -1;
}

CounterTable BuildCounterTable(const sp::Schedule& s) {
  CounterTable t;
  std::set<std::string> names;
  for (const sp::RankProgram& p : s.ranks) {
    for (const sp::Op& o : p.ops) {
      if (!o.counter.empty()) names.insert(o.counter);
    }
  }
  t.names.assign(names.begin(), names.end());
  t.per_layer_total.assign(s.ranks.size(), std::vector<int64_t>(t.names.size(), 0));
  for (const sp::RankProgram& p : s.ranks) {
    for (const sp::Op& o : p.ops) {
      if (SignalsCounter(o)) t.per_layer_total[o.peer][t.index(o.counter)] += o.count;
    }
  }
  return t;
}

Result<SlotSignals> BuildSlotSignals(const sp::Schedule& s) {
  const int n = static_cast<int>(s.ranks.size());
  const CounterTable t = BuildCounterTable(s);
  const int64_t nc = static_cast<int64_t>(t.names.size());
  SlotSignals out;
  out.words = nc * n;
  out.writes.resize(n);
  out.waits.resize(n);
  // Per-layer growth of every slot on every receiver: [receiver][slot].
  std::vector<std::vector<int64_t>> growth(n, std::vector<int64_t>(out.words, 0));
  for (int r = 0; r < n; ++r) {
    for (const sp::Op& o : s.ranks[r].ops) {
      if (SignalsCounter(o)) growth[o.peer][t.index(o.counter) * n + r] += o.count;
    }
  }
  for (int r = 0; r < n; ++r) {
    const sp::RankProgram& p = s.ranks[r];
    out.writes[r].assign(p.ops.size(), SlotWrite{});
    out.waits[r].assign(p.ops.size(), {});
    // (peer, slot) -> running total and the stream that signals it.
    std::map<std::pair<int, int64_t>, std::pair<int64_t, sp::Stream>> running;
    for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
      const sp::Op& o = p.ops[i];
      if (SignalsCounter(o)) {
        const int64_t slot = t.index(o.counter) * n + r;
        auto [it, fresh] = running.try_emplace({o.peer, slot}, 0, o.stream);
        if (!fresh && it->second.second != o.stream) {
          return Failure::InvalidArgument(
              OpName(s, r, i) + " signals counter '" + o.counter + "' on rank " +
                  std::to_string(o.peer) + " from the " + sp::ToString(o.stream) +
                  " stream, an earlier op of this rank from the " +
                  sp::ToString(it->second.second) +
                  " stream: the copy-engine signals need one stream per sender and "
                  "counter (a set word is only monotone in stream order)",
              "stream");
        }
        it->second.first += o.count;
        out.writes[r][i] = SlotWrite{slot, it->second.first, growth[o.peer][slot]};
      } else if (o.kind == sp::OpKind::kWait) {
        const int c = t.index(o.counter);
        std::vector<SlotWait> w;
        int64_t total = 0;
        for (int src = 0; src < n; ++src) {
          const int64_t slot = c * static_cast<int64_t>(n) + src;
          if (c >= 0 && growth[r][slot] > 0) {
            w.push_back(SlotWait{slot, growth[r][slot], growth[r][slot]});
            total += growth[r][slot];
          }
        }
        if (w.empty()) {
          return Failure::InvalidArgument(
              OpName(s, r, i) + " waits for counter '" + o.counter + "', which no rank signals",
              "counter");
        }
        if (w.size() == 1) {
          w[0].value = o.count;
        } else if (o.count != total) {
          return Failure::InvalidArgument(
              OpName(s, r, i) + " waits for " + std::to_string(o.count) + " of counter '" +
                  o.counter + "', which " + std::to_string(w.size()) + " ranks signal (" +
                  std::to_string(total) +
                  " per layer): the copy-engine signals need a Wait to count one "
                  "sender's signals or all of them",
              "count");
        }
        out.waits[r][i] = std::move(w);
      }
    }
  }
  return out;
}

int64_t RegionByteOffset(const sp::Region& r, const sp::BufferDecl& d) {
  return (r.token_begin * d.heads + r.head_begin) * d.width * d.element_bytes;
}

namespace {

// Per rank: the buffers some peer Puts into (they must live in the symmetric arena) and the
// buffers its own ops write (a ring reuses the own k/v buffers for later blocks: such a buffer
// must not be the caller's tensor, binding it would overwrite the caller's inputs).
struct BufferUse {
  std::vector<std::set<int>> put_targets, written;
  bool any_two = false, any_one = false;  // some op is two-sided / one-sided
};

BufferUse UsesOfBuffers(const sp::Schedule& s) {
  const int n = static_cast<int>(s.ranks.size());
  BufferUse use;
  use.put_targets.resize(n);
  use.written.resize(n);
  for (int r = 0; r < n; ++r) {
    for (const sp::Op& o : s.ranks[r].ops) {
      use.any_two = use.any_two || IsTwoSided(o.kind);
      use.any_one = use.any_one || IsOneSided(o.kind);
      if (o.kind == sp::OpKind::kPut) use.put_targets[o.peer].insert(o.dst.buffer);
    }
  }
  for (int r = 0; r < n; ++r) {
    for (const sp::Op& o : s.ranks[r].ops) {
      if (o.kind == sp::OpKind::kPut || o.kind == sp::OpKind::kSend ||
          o.kind == sp::OpKind::kSignal || o.kind == sp::OpKind::kWait) {
        continue;  // no local write (a Wait's region is the put target, handled above)
      }
      if (o.dst.valid()) use.written[r].insert(o.dst.buffer);
      if (o.dst_lse.valid()) use.written[r].insert(o.dst_lse.buffer);
    }
  }
  return use;
}

// Rank r's buffers: bound to the caller's tensors where allowed, else placed in the arena.
void PlaceBuffers(const sp::Schedule& s, int r, const PlanOptions& opt, const BufferUse& use,
                  ExecPlan& plan) {
  const sp::RankProgram& p = s.ranks[r];
  const int nb = static_cast<int>(p.buffers.size());
  plan.offset.assign(nb, -1);
  plan.bytes.assign(nb, 0);
  plan.binding.assign(nb, UserBinding::kNone);
  int64_t at = 0;
  for (int b = 0; b < nb; ++b) {
    const sp::BufferDecl& d = p.buffers[b];
    plan.bytes[b] = d.elements(s.shape.batch) * d.element_bytes;
    UserBinding bind = BindingOf(p, b);
    const bool input = bind != UserBinding::kOut && bind != UserBinding::kTextOut;
    if (bind != UserBinding::kNone && opt.bind_user_tensors && !use.put_targets[r].count(b) &&
        !(input && use.written[r].count(b))) {
      plan.binding[b] = bind;
      continue;
    }
    plan.binding[b] = bind;  // in the arena; the executor copies in/out when bound != kNone
    plan.offset[b] = at;
    at = AlignUp(at + plan.bytes[b]);
  }
  plan.buffers_bytes = at;
}

// Rank r's ops: kinds on the right streams, contiguous transfer regions.
std::optional<Failure> CheckOps(const sp::Schedule& s, int r) {
  const sp::RankProgram& p = s.ranks[r];
  for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
    const sp::Op& o = p.ops[i];
    // Each comm stream has its own NCCL communicator; Send/Recv elsewhere have none.
    if (IsTwoSided(o.kind) && o.stream == sp::Stream::kCompute) {
      return Failure::InvalidArgument(OpName(s, r, i) +
                                          " runs on the compute stream: Send/Recv belong on a comm "
                                          "stream (each has its own NCCL communicator)",
                                      "stream");
    }
    auto contiguous = [&](const sp::Region& reg, const sp::RankProgram& owner,
                          const char* field) -> std::optional<Failure> {
      if (!reg.valid() || sp::RegionContiguous(reg, owner.buffers[reg.buffer], s.shape.batch)) {
        return std::nullopt;
      }
      return Failure::InvalidArgument(OpName(s, r, i) + ": the " + field +
                                          " region is not contiguous (a Pack/Unpack to a "
                                          "staging buffer must come first)",
                                      field);
    };
    std::optional<Failure> f;
    if (o.kind == sp::OpKind::kSend) {
      f = contiguous(o.src, p, "src");
    } else if (o.kind == sp::OpKind::kRecv) {
      f = contiguous(o.dst, p, "dst");
    } else if (o.kind == sp::OpKind::kPut) {
      f = contiguous(o.src, p, "src");
      if (!f) f = contiguous(o.dst, s.ranks[o.peer], "dst");
    }
    if (f) return f;
  }
  return std::nullopt;
}

// The arena: one-sided schedules add the signal words after the largest rank's buffers.
void SizeArenas(const sp::Schedule& s, bool any_one, std::vector<ExecPlan>& plans) {
  if (!any_one) {
    for (ExecPlan& p : plans) p.arena_bytes = p.buffers_bytes;
    return;
  }
  int64_t arena = 0;
  for (const ExecPlan& p : plans) arena = std::max(arena, p.buffers_bytes);
  const CounterTable counters = BuildCounterTable(s);
  // One word per counter (NVSHMEM) or per (counter, sender) (SlotSignals), plus one scratch
  // word that NVSHMEM puts without a counter signal (add 0).
  const int64_t words =
      static_cast<int64_t>(counters.names.size()) * static_cast<int64_t>(plans.size()) + 1;
  for (ExecPlan& p : plans) {
    p.signal_offset = arena;
    p.arena_bytes = AlignUp(arena + words * 8);
  }
}

}  // namespace

Result<std::vector<ExecPlan>> BuildExecPlans(const sp::Schedule& s, const PlanOptions& opt) {
  const int n = static_cast<int>(s.ranks.size());
  std::vector<ExecPlan> plans(n);
  const BufferUse use = UsesOfBuffers(s);
  for (int r = 0; r < n; ++r) {
    ExecPlan& plan = plans[r];
    plan.rank = r;
    plan.element_bytes = s.shape.dtype_bytes;
    plan.uses_nccl = use.any_two;
    plan.uses_nvshmem = use.any_one;
    PlaceBuffers(s, r, opt, use, plan);
    if (auto f = CheckOps(s, r)) return *f;
    auto units = OrderUnits(s, r, &plan.unit_of_op);
    if (!units) return units.failure();
    plan.units = std::move(units.value());
  }
  SizeArenas(s, use.any_one, plans);
  return plans;
}

std::string CheckNcclOrder(const sp::Schedule& s, const std::vector<ExecPlan>& plans) {
  // (stream, sender, receiver) -> tags in issue order, for sends and for receives.
  using Key = std::tuple<int, int, int>;
  std::map<Key, std::vector<int64_t>> sends, recvs;
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    const sp::RankProgram& p = s.ranks[r];
    for (const IssueUnit& u : plans[r].units) {
      for (int i : u.ops) {
        const sp::Op& o = p.ops[i];
        const int st = static_cast<int>(o.stream);
        if (o.kind == sp::OpKind::kSend)
          sends[Key{st, static_cast<int>(r), o.peer}].push_back(o.tag);
        if (o.kind == sp::OpKind::kRecv)
          recvs[Key{st, o.peer, static_cast<int>(r)}].push_back(o.tag);
      }
    }
  }
  std::ostringstream os;
  auto show = [](const std::vector<int64_t>& v) {
    std::ostringstream t;
    for (size_t i = 0; i < v.size() && i < 8; ++i) t << (i ? "," : "") << v[i];
    if (v.size() > 8) t << ",...";
    return t.str();
  };
  std::set<Key> keys;
  for (auto& [k, v] : sends) keys.insert(k);
  for (auto& [k, v] : recvs) keys.insert(k);
  for (const Key& k : keys) {
    const std::vector<int64_t>& a = sends[k];
    const std::vector<int64_t>& b = recvs[k];
    if (a != b) {
      os << "stream " << sp::ToString(static_cast<sp::Stream>(std::get<0>(k))) << ": rank "
         << std::get<1>(k) << " sends tags [" << show(a) << "] to rank " << std::get<2>(k)
         << ", which receives tags [" << show(b) << "] in its issue order\n";
    }
  }
  return os.str();
}

std::string PrintPlan(const sp::Schedule& s, const ExecPlan& plan) {
  std::ostringstream os;
  const sp::RankProgram& p = s.ranks[plan.rank];
  os << "rank " << plan.rank << ": arena " << plan.arena_bytes << " bytes, " << plan.units.size()
     << " units\n";
  for (size_t u = 0; u < plan.units.size(); ++u) {
    const IssueUnit& unit = plan.units[u];
    os << "  [" << u << "] " << sp::ToString(unit.stream);
    if (!unit.wait_units.empty()) {
      os << " waits";
      for (int w : unit.wait_units) os << ' ' << w;
    }
    if (unit.record_event) os << " (event)";
    os << ':';
    for (int i : unit.ops) os << " #" << i << ' ' << sp::ToString(p.ops[i].kind);
    os << '\n';
  }
  return os.str();
}

std::string PrintTimeline(const sp::Schedule& s, const ExecPlan& plan,
                          const std::vector<UnitTiming>& timings) {
  const sp::RankProgram& p = s.ranks[plan.rank];
  std::vector<UnitTiming> t;
  for (const UnitTiming& x : timings) {
    if (x.unit >= 0 && x.unit < static_cast<int>(plan.units.size())) t.push_back(x);
  }
  std::stable_sort(t.begin(), t.end(), [](const UnitTiming& a, const UnitTiming& b) {
    return a.begin_ms < b.begin_ms;
  });
  std::ostringstream os;
  os << std::fixed << std::setprecision(3);
  double layer_end = 0;
  for (const UnitTiming& x : t) layer_end = std::max(layer_end, x.end_ms);
  os << "rank " << plan.rank << ": " << t.size() << " units, layer " << layer_end << " ms\n";
  os << "  begin ms    end ms    dur ms  stream       ops\n";
  for (const UnitTiming& x : t) {
    const IssueUnit& unit = plan.units[x.unit];
    os << std::setw(9) << x.begin_ms << ' ' << std::setw(9) << x.end_ms << ' ' << std::setw(9)
       << x.end_ms - x.begin_ms << "  " << std::left << std::setw(11) << sp::ToString(unit.stream)
       << std::right << ' ';
    const sp::Op& first = p.ops[unit.ops.front()];
    os << '[' << x.unit << "] " << sp::ToString(first.kind);
    if (unit.ops.size() > 1) os << " x" << unit.ops.size();
    os << " '" << first.label << "'\n";
  }
  for (int st = 0; st < sp::kNumStreams; ++st) {
    double busy = 0, longest = 0, first_begin = -1, last_end = 0;
    int longest_unit = -1;
    for (const UnitTiming& x : t) {
      if (static_cast<int>(plan.units[x.unit].stream) != st) continue;
      const double d = x.end_ms - x.begin_ms;
      busy += d;
      if (d > longest) longest = d, longest_unit = x.unit;
      if (first_begin < 0) first_begin = x.begin_ms;
      last_end = std::max(last_end, x.end_ms);
    }
    if (first_begin < 0) continue;
    os << "  " << sp::ToString(static_cast<sp::Stream>(st)) << ": busy " << busy << " ms, idle "
       << std::max(0.0, last_end - first_begin - busy) << " ms between " << first_begin << " and "
       << last_end << " ms, longest [" << longest_unit << "] " << longest << " ms\n";
  }
  return os.str();
}

}  // namespace ditscale::runtime
