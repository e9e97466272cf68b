#include "ditscale/runtime/exec_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>

#include "ditscale/sp/strategies.h"

namespace ditscale::runtime {
namespace {

// chunks: torus token chunks, ulysses head chunks (SpConfig::torus_chunks / ulysses_chunks).
sp::Schedule Build(int machines, int gpus, sp::Strategy strategy, int chunks, bool one_sided,
                   int64_t text = 16, int64_t heads = 6, int64_t batch = 2,
                   bool one_sided_inter = true) {
  sp::SpMesh mesh{machines, gpus};
  sp::SpConfig cfg;
  cfg.strategy = strategy;
  (strategy == sp::Strategy::kUlysses ? cfg.ulysses_chunks : cfg.torus_chunks) = chunks;
  cfg.one_sided = one_sided;
  cfg.one_sided_inter = one_sided_inter;
  sp::AttentionShape shape;
  shape.batch = batch;
  shape.seq_tokens = 96;
  shape.text_tokens = text;
  shape.heads = heads;
  shape.head_dim = 8;
  auto s = sp::BuildSchedule(mesh, cfg, shape);
  EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.failure().ToString());
  return std::move(s).value();
}

// Every invariant the GPU executor relies on.
void CheckPlans(const sp::Schedule& s, const std::vector<ExecPlan>& plans) {
  ASSERT_EQ(plans.size(), s.ranks.size());
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    const sp::RankProgram& p = s.ranks[r];
    const ExecPlan& plan = plans[r];
    // Each op in exactly one unit; units are single-stream; stream order kept.
    std::vector<int> seen(p.ops.size(), 0);
    std::vector<int> position(p.ops.size(), -1);
    int pos = 0;
    for (size_t u = 0; u < plan.units.size(); ++u) {
      for (int i : plan.units[u].ops) {
        ++seen[i];
        position[i] = pos++;
        EXPECT_EQ(p.ops[i].stream, plan.units[u].stream);
        EXPECT_EQ(plan.unit_of_op[i], static_cast<int>(u));
      }
    }
    for (size_t i = 0; i < p.ops.size(); ++i) {
      EXPECT_EQ(seen[i], 1) << "op " << i;
      for (int d : p.ops[i].deps) {
        EXPECT_LT(position[d], position[i]) << "rank " << r << " op " << i << " dep " << d;
        const int du = plan.unit_of_op[d], iu = plan.unit_of_op[i];
        if (p.ops[d].stream != p.ops[i].stream) {
          EXPECT_TRUE(plan.units[du].record_event);
          const auto& w = plan.units[iu].wait_units;
          EXPECT_NE(std::find(w.begin(), w.end(), du), w.end());
        }
      }
    }
    for (int st = 0; st < sp::kNumStreams; ++st) {  // stream order preserved
      int last = -1;
      for (size_t i = 0; i < p.ops.size(); ++i) {
        if (static_cast<int>(p.ops[i].stream) != st) continue;
        EXPECT_GT(position[i], last);
        last = position[i];
      }
    }
    // Arena: aligned, disjoint, inside; inputs/outputs bound unless a peer puts into them.
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (size_t b = 0; b < p.buffers.size(); ++b) {
      if (plan.offset[b] < 0) {
        EXPECT_NE(plan.binding[b], UserBinding::kNone) << p.buffers[b].name;
        continue;
      }
      EXPECT_EQ(plan.offset[b] % kArenaAlignment, 0);
      spans.push_back({plan.offset[b], plan.offset[b] + plan.bytes[b]});
      EXPECT_LE(plan.offset[b] + plan.bytes[b], plan.buffers_bytes);
    }
    std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k) EXPECT_LE(spans[k - 1].second, spans[k].first);
    // A buffer bound to the caller's input tensor is only read: a ring that reuses its own k/v
    // buffers for later blocks must not overwrite the caller's k and v (seen on 4 GPUs).
    for (const sp::Op& o : p.ops) {
      if (o.kind == sp::OpKind::kPut || o.kind == sp::OpKind::kSend ||
          o.kind == sp::OpKind::kSignal || o.kind == sp::OpKind::kWait) {
        continue;
      }
      for (const sp::Region* w : {&o.dst, &o.dst_lse}) {
        if (!w->valid()) continue;
        const UserBinding b = plan.binding[w->buffer];
        const bool caller_input =
            plan.offset[w->buffer] < 0 && b != UserBinding::kOut && b != UserBinding::kTextOut;
        EXPECT_FALSE(caller_input) << "rank " << r << ": '" << o.label << "' writes the caller's "
                                   << ToString(b) << " tensor";
      }
    }
    EXPECT_GE(plan.arena_bytes, plan.buffers_bytes);
  }
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    for (const sp::Op& o : s.ranks[r].ops) {
      if (o.kind == sp::OpKind::kPut) EXPECT_GE(plans[o.peer].offset[o.dst.buffer], 0);
    }
  }
  EXPECT_EQ(CheckNcclOrder(s, plans), "");
}

struct Case {
  int machines, gpus;
  sp::Strategy strategy;
  int chunks;
};

TEST(ExecPlan, EveryStrategyMeshAndTransportIsExecutable) {
  const std::vector<Case> cases = {
      {1, 2, sp::Strategy::kUlysses, 1},
      {1, 2, sp::Strategy::kRing, 1},
      {2, 1, sp::Strategy::kRing, 1},
      {1, 4, sp::Strategy::kUsp, 1},
      {2, 2, sp::Strategy::kUsp, 1},
      {2, 2, sp::Strategy::kSwiftFusionTas, 1},
      {2, 2, sp::Strategy::kTorus, 1},
      {2, 2, sp::Strategy::kTorus, 2},
      {2, 2, sp::Strategy::kTorus, 3},
      {2, 1, sp::Strategy::kSwiftFusionTas, 1},
      {2, 1, sp::Strategy::kTorus, 2},
      {2, 4, sp::Strategy::kTorus, 2},
      {1, 4, sp::Strategy::kRing, 1},
      {4, 1, sp::Strategy::kRing, 1},
      {1, 3, sp::Strategy::kRing, 1},
      {1, 4, sp::Strategy::kSwiftFusionTas, 1},
      {1, 2, sp::Strategy::kUlyssesOverlap, 1},
      {2, 2, sp::Strategy::kUlyssesOverlap, 1},
  };
  for (const Case& c : cases) {
    for (bool one_sided : {false, true}) {
      SCOPED_TRACE(std::string(sp::StrategyName(c.strategy)) + " " + std::to_string(c.machines) +
                   "x" + std::to_string(c.gpus) + " chunks " + std::to_string(c.chunks) +
                   (one_sided ? " one-sided" : ""));
      const sp::Schedule s = Build(c.machines, c.gpus, c.strategy, c.chunks, one_sided);
      auto plans = BuildExecPlans(s, {});
      ASSERT_TRUE(plans.ok()) << plans.failure().ToString();
      CheckPlans(s, plans.value());
      EXPECT_EQ(plans.value()[0].uses_nvshmem, one_sided);
      EXPECT_EQ(plans.value()[0].uses_nccl, !one_sided);
      if (one_sided) {
        // Same arena size everywhere, signal words after every rank's buffers.
        for (const ExecPlan& p : plans.value()) {
          EXPECT_EQ(p.arena_bytes, plans.value()[0].arena_bytes);
          EXPECT_GE(p.signal_offset, p.buffers_bytes);
        }
      }
    }
  }
}

// Puts within machines, NCCL between them: one plan with both, NCCL order consistent, every put
// target in the (symmetric) arena, and the counters of the sync rounds only within machines.
TEST(ExecPlan, IntraOneSidedInterTwoSidedIsExecutable) {
  const std::vector<Case> cases = {
      {2, 2, sp::Strategy::kUlysses, 1},
      {2, 2, sp::Strategy::kRing, 1},
      {2, 2, sp::Strategy::kUsp, 1},
      {2, 2, sp::Strategy::kSwiftFusionTas, 1},
      {2, 2, sp::Strategy::kTorus, 1},
      {2, 2, sp::Strategy::kTorus, 2},
      {2, 4, sp::Strategy::kUsp, 1},
      {2, 4, sp::Strategy::kTorus, 2},
      {2, 4, sp::Strategy::kRing, 1},
      {3, 2, sp::Strategy::kUlysses, 1},
      {2, 2, sp::Strategy::kUlyssesOverlap, 1},
      {3, 2, sp::Strategy::kSwiftFusionTas, 1},
      {3, 2, sp::Strategy::kTorus, 3},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(sp::StrategyName(c.strategy)) + " " + std::to_string(c.machines) +
                 "x" + std::to_string(c.gpus) + " chunks " + std::to_string(c.chunks) +
                 " nvshmem-intra");
    const sp::Schedule s = Build(c.machines, c.gpus, c.strategy, c.chunks, true, 16, 6, 2, false);
    auto plans = BuildExecPlans(s, {});
    ASSERT_TRUE(plans.ok()) << plans.failure().ToString();
    CheckPlans(s, plans.value());
    EXPECT_TRUE(plans.value()[0].uses_nvshmem);
    EXPECT_TRUE(plans.value()[0].uses_nccl);
    const CounterTable counters = BuildCounterTable(s);
    for (const std::string& name : counters.names) {
      EXPECT_EQ(name.find(".inter"), std::string::npos) << name;
    }
    for (size_t r = 0; r < s.ranks.size(); ++r) {
      const ExecPlan& p = plans.value()[r];
      EXPECT_EQ(p.arena_bytes, plans.value()[0].arena_bytes);
      EXPECT_GE(p.signal_offset, p.buffers_bytes);
      // A Recv into the caller's output needs no symmetric memory: it stays bound unless a
      // peer also puts into it.
      for (const sp::Op& o : s.ranks[r].ops) {
        if (o.kind == sp::OpKind::kRecv && o.dst.buffer == s.ranks[r].out) {
          bool put_into = false;
          for (const sp::RankProgram& q : s.ranks) {
            for (const sp::Op& x : q.ops) {
              put_into |= x.kind == sp::OpKind::kPut && x.peer == static_cast<int>(r) &&
                          x.dst.buffer == s.ranks[r].out;
            }
          }
          EXPECT_EQ(p.offset[o.dst.buffer] < 0, !put_into);
        }
      }
    }
  }
}

TEST(ExecPlan, PlansAreDeterministic) {
  const sp::Schedule s = Build(2, 2, sp::Strategy::kTorus, 2, false);
  auto a = BuildExecPlans(s, {});
  auto b = BuildExecPlans(s, {});
  ASSERT_TRUE(a.ok() && b.ok());
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    EXPECT_EQ(PrintPlan(s, a.value()[r]), PrintPlan(s, b.value()[r]));
  }
}

TEST(ExecPlan, WithoutBindingEveryBufferIsInTheArena) {
  const sp::Schedule s = Build(1, 2, sp::Strategy::kUlysses, 1, false);
  PlanOptions o;
  o.bind_user_tensors = false;
  auto plans = BuildExecPlans(s, o);
  ASSERT_TRUE(plans.ok());
  for (const ExecPlan& p : plans.value()) {
    for (int64_t off : p.offset) EXPECT_GE(off, 0);
  }
}

TEST(ExecPlan, CountersGrowByTheSignalsSentPerLayer) {
  const sp::Schedule s = Build(2, 2, sp::Strategy::kTorus, 2, true);
  const CounterTable t = BuildCounterTable(s);
  ASSERT_FALSE(t.names.empty());
  EXPECT_TRUE(std::is_sorted(t.names.begin(), t.names.end()));
  // Every Wait's threshold is reachable within one layer.
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    for (const sp::Op& o : s.ranks[r].ops) {
      if (o.kind != sp::OpKind::kWait) continue;
      const int c = t.index(o.counter);
      ASSERT_GE(c, 0);
      EXPECT_LE(o.count, t.per_layer_total[r][c]) << o.label;
    }
  }
  EXPECT_EQ(t.index("no such counter"), -1);
}

TEST(ExecPlan, TimelineListsUnitsInStartOrderWithStreamSummaries) {
  const sp::Schedule s = Build(1, 2, sp::Strategy::kRing, 1, false);
  auto plans = BuildExecPlans(s, {});
  ASSERT_TRUE(plans.ok());
  const ExecPlan& plan = plans.value()[0];
  ASSERT_GE(plan.units.size(), 3u);
  // Three units out of order, one out of range (ignored).
  std::vector<UnitTiming> t = {{2, 5.0, 9.0}, {0, 0.5, 1.0}, {1, 1.0, 4.0}, {999, 0, 1}};
  const std::string text = PrintTimeline(s, plan, t);
  EXPECT_NE(text.find("rank 0: 3 units, layer 9.000 ms"), std::string::npos) << text;
  const size_t a = text.find("[0] "), b = text.find("[1] "), c = text.find("[2] ");
  ASSERT_NE(a, std::string::npos);
  EXPECT_LT(a, b);
  EXPECT_LT(b, c);
  EXPECT_EQ(text.find("[999]"), std::string::npos);
  // Per-stream lines: busy = sum of the durations on that stream.
  double busy_compute = 0;
  for (const UnitTiming& x : t) {
    if (x.unit < static_cast<int>(plan.units.size()) &&
        plan.units[x.unit].stream == sp::Stream::kCompute) {
      busy_compute += x.end_ms - x.begin_ms;
    }
  }
  if (busy_compute > 0) {
    std::ostringstream want;
    want << std::fixed << std::setprecision(3) << "compute: busy " << busy_compute << " ms";
    EXPECT_NE(text.find(want.str()), std::string::npos) << text;
  }
}

TEST(ExecPlan, MismatchedNcclOrderIsReported) {
  sp::Schedule s = Build(1, 2, sp::Strategy::kRing, 1, false);
  auto plans = BuildExecPlans(s, {});
  ASSERT_TRUE(plans.ok());
  // Swap the tags of two sends of rank 0 to rank 1 on one stream: the receiver's order no
  // longer matches.
  std::vector<int> sends;
  for (size_t i = 0; i < s.ranks[0].ops.size(); ++i) {
    if (s.ranks[0].ops[i].kind == sp::OpKind::kSend) sends.push_back(static_cast<int>(i));
  }
  ASSERT_GE(sends.size(), 2u);
  std::swap(s.ranks[0].ops[sends[0]].tag, s.ranks[0].ops[sends[1]].tag);
  const std::string why = CheckNcclOrder(s, plans.value());
  EXPECT_NE(why.find("rank 0 sends tags"), std::string::npos) << why;
}

// The pure ring with text attends its own work copies (ring.q/k/v: text rows joined to the
// image rows), so the caller's q, k, v are only read and every caller tensor is bound. Without
// text the ring's own block buffer is the caller's k / v, reused for a later block when R > 2:
// those two live in the arena (the executor copies them in).
TEST(ExecPlan, RingWithTextBindsEveryCallerTensor) {
  for (int64_t text : {0, 16}) {
    for (bool one_sided : {false, true}) {
      SCOPED_TRACE("text " + std::to_string(text) + (one_sided ? " one-sided" : ""));
      const sp::Schedule s = Build(1, 4, sp::Strategy::kRing, 1, one_sided, text);
      auto plans = BuildExecPlans(s, {});
      ASSERT_TRUE(plans.ok()) << plans.failure().ToString();
      CheckPlans(s, plans.value());
      for (size_t r = 0; r < s.ranks.size(); ++r) {
        const sp::RankProgram& p = s.ranks[r];
        const ExecPlan& plan = plans.value()[r];
        EXPECT_LT(plan.offset[p.q], 0);
        EXPECT_LT(plan.offset[p.out], 0);
        const bool kv_bound = text > 0;
        for (int kv : {p.k, p.v}) EXPECT_EQ(plan.offset[kv] < 0, kv_bound) << p.buffers[kv].name;
      }
    }
  }
}

TEST(ExecPlan, NonContiguousTransferRegionFailsNamingTheField) {
  sp::Schedule s = Build(1, 2, sp::Strategy::kRing, 1, false, /*text=*/0, /*heads=*/6, /*batch=*/2);
  for (sp::Op& o : s.ranks[0].ops) {
    if (o.kind == sp::OpKind::kSend) {  // half the heads of a buffer: strided
      const sp::BufferDecl& d = s.ranks[0].buffers[o.src.buffer];
      o.src.head_begin = 0;
      o.src.heads = d.heads / 2;
      break;
    }
  }
  auto plans = BuildExecPlans(s, {});
  ASSERT_FALSE(plans.ok());
  EXPECT_EQ(plans.failure().column, "src");
  EXPECT_NE(plans.failure().message.find("not contiguous"), std::string::npos);
}

TEST(ExecPlan, SendOnTheComputeStreamIsRejected) {
  sp::Schedule s = Build(1, 2, sp::Strategy::kRing, 1, false);
  for (sp::Op& o : s.ranks[1].ops) {
    if (o.kind == sp::OpKind::kRecv) {
      o.stream = sp::Stream::kCompute;
      break;
    }
  }
  auto plans = BuildExecPlans(s, {});
  ASSERT_FALSE(plans.ok());
  EXPECT_EQ(plans.failure().column, "stream");
}

// Copy-engine signalling: every one-sided schedule of every strategy splits into per-sender
// words. Replaying a layer's signals in any order (here: all senders' ops in program order, then
// each word at its final value) satisfies every Wait exactly when all the signals it counts have
// been set, and the last value a sender sets is the word's per-layer growth.
TEST(ExecPlan, SlotSignalsSplitEveryOneSidedScheduleBySender) {
  const std::vector<Case> cases = {
      {1, 2, sp::Strategy::kUlysses, 1},
      {1, 4, sp::Strategy::kUlysses, 1},
      {1, 2, sp::Strategy::kRing, 1},
      {1, 4, sp::Strategy::kRing, 1},
      {2, 1, sp::Strategy::kRing, 1},
      {1, 4, sp::Strategy::kUsp, 1},
      {2, 2, sp::Strategy::kUsp, 1},
      {2, 2, sp::Strategy::kSwiftFusionTas, 1},
      {2, 2, sp::Strategy::kTorus, 2},
      {2, 4, sp::Strategy::kTorus, 2},
      {1, 2, sp::Strategy::kUlyssesOverlap, 1},
      {2, 2, sp::Strategy::kUlyssesOverlap, 1},
      {1, 2, sp::Strategy::kUlysses, 2},
      {1, 4, sp::Strategy::kUlysses, 3},
  };
  for (const Case& c : cases) {
    for (bool inter : {true, false}) {
      if (!inter && c.machines == 1) continue;
      SCOPED_TRACE(std::string(sp::StrategyName(c.strategy)) + " " + std::to_string(c.machines) +
                   "x" + std::to_string(c.gpus) + " chunks " + std::to_string(c.chunks) +
                   (inter ? "" : " intra"));
      const sp::Schedule s =
          Build(c.machines, c.gpus, c.strategy, c.chunks, true, 16, 12, 2, inter);
      auto slots = BuildSlotSignals(s);
      ASSERT_TRUE(slots.ok()) << slots.failure().ToString();
      const SlotSignals& t = slots.value();
      const int n = static_cast<int>(s.ranks.size());
      EXPECT_EQ(t.words, static_cast<int64_t>(BuildCounterTable(s).names.size()) * n);
      auto plans = BuildExecPlans(s, {});
      ASSERT_TRUE(plans.ok());
      // The signal area holds every slot.
      EXPECT_GE(plans.value()[0].arena_bytes - plans.value()[0].signal_offset, t.words * 8);
      // Final value of every word after one layer; each write stays within its word's growth.
      std::vector<std::vector<int64_t>> word(n, std::vector<int64_t>(t.words, 0));
      std::vector<std::vector<int64_t>> growth(n, std::vector<int64_t>(t.words, -1));
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < s.ranks[r].ops.size(); ++i) {
          const sp::Op& o = s.ranks[r].ops[i];
          const SlotWrite& w = t.writes[r][i];
          const bool signals =
              o.kind == sp::OpKind::kSignal || (o.kind == sp::OpKind::kPut && !o.counter.empty());
          ASSERT_EQ(w.slot >= 0, signals) << o.label;
          if (!signals) continue;
          EXPECT_EQ(w.slot % n, r) << "a sender writes only its own words";
          EXPECT_GT(w.value, word[o.peer][w.slot]) << "monotone: " << o.label;
          EXPECT_LE(w.value, w.per_layer);
          word[o.peer][w.slot] = w.value;
          growth[o.peer][w.slot] = w.per_layer;
        }
      }
      for (int r = 0; r < n; ++r) {
        for (int64_t k = 0; k < t.words; ++k) {
          if (growth[r][k] >= 0) EXPECT_EQ(word[r][k], growth[r][k]);
        }
        for (size_t i = 0; i < s.ranks[r].ops.size(); ++i) {
          const sp::Op& o = s.ranks[r].ops[i];
          if (o.kind != sp::OpKind::kWait) {
            EXPECT_TRUE(t.waits[r][i].empty());
            continue;
          }
          ASSERT_FALSE(t.waits[r][i].empty()) << o.label;
          int64_t sum = 0;
          for (const SlotWait& w : t.waits[r][i]) {
            EXPECT_EQ(w.per_layer, growth[r][w.slot]);
            EXPECT_LE(w.value, w.per_layer);
            sum += w.value;
          }
          EXPECT_EQ(sum, o.count) << o.label;  // the Wait counts exactly its signals
        }
      }
    }
  }
}

TEST(ExecPlan, SlotSignalsRejectPartialMultiSenderWaitsAndMixedStreams) {
  sp::Schedule s = Build(1, 4, sp::Strategy::kUlysses, 1, true);
  const CounterTable t = BuildCounterTable(s);
  // A Wait for part of a counter that three ranks signal: which sender's signals it means is
  // not defined, so it cannot become per-sender waits.
  sp::Schedule partial = s;
  bool changed = false;
  for (sp::Op& o : partial.ranks[0].ops) {
    if (o.kind == sp::OpKind::kWait && t.per_layer_total[0][t.index(o.counter)] > 1 && !changed) {
      o.count -= 1;
      changed = true;
    }
  }
  ASSERT_TRUE(changed);
  auto a = BuildSlotSignals(partial);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.failure().column, "count");
  EXPECT_NE(a.failure().message.find("ranks signal"), std::string::npos) << a.failure().message;
  // Two signals of one (sender, counter, receiver) from different streams.
  sp::Schedule mixed = Build(1, 2, sp::Strategy::kRing, 1, true);
  std::map<std::pair<int, std::string>, int> seen;
  changed = false;
  for (sp::Op& o : mixed.ranks[0].ops) {
    const bool sig =
        o.kind == sp::OpKind::kSignal || (o.kind == sp::OpKind::kPut && !o.counter.empty());
    if (!sig || changed) continue;
    if (seen[{o.peer, o.counter}]++ > 0) {
      o.stream = o.stream == sp::Stream::kCompute ? sp::Stream::kCommIntra : sp::Stream::kCompute;
      changed = true;
    }
  }
  ASSERT_TRUE(changed);
  auto b = BuildSlotSignals(mixed);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.failure().column, "stream");
}

}  // namespace
}  // namespace ditscale::runtime
