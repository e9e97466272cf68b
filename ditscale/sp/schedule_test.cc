// Schedule validation (hostile edits are caught) and communication volumes (closed forms).
#include "ditscale/sp/schedule.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>

#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

AttentionShape Shape(int64_t seq, int64_t text, int64_t heads) {
  AttentionShape a;
  a.batch = 2;
  a.seq_tokens = seq;
  a.text_tokens = text;
  a.heads = heads;
  a.head_dim = 8;
  a.dtype_bytes = 2;
  return a;
}

// chunks: torus token chunks, ulysses head chunks (SpConfig::torus_chunks / ulysses_chunks).
Schedule Build(SpMesh mesh, Strategy strategy, AttentionShape shape, bool one_sided, int u = 0,
               int r = 0, int chunks = 1) {
  SpConfig c;
  c.strategy = strategy;
  c.one_sided = one_sided;
  c.ulysses_degree = u;
  c.ring_degree = r;
  (strategy == Strategy::kUlysses ? c.ulysses_chunks : c.torus_chunks) = chunks;
  Result<Schedule> s = BuildSchedule(mesh, c, shape);
  EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.failure().ToString());
  return std::move(s).ValueOrThrow();
}

bool HasError(const ValidationReport& rep, const std::string& needle) {
  for (const std::string& e : rep.errors) {
    if (e.find(needle) != std::string::npos) return true;
  }
  return false;
}

// Removes op `index` of `prog`, renumbering deps.
void EraseOp(RankProgram* prog, int index) {
  prog->ops.erase(prog->ops.begin() + index);
  for (Op& op : prog->ops) {
    std::vector<int> deps;
    for (int d : op.deps) {
      if (d != index) deps.push_back(d > index ? d - 1 : d);
    }
    op.deps = deps;
  }
}

int FindOp(const RankProgram& prog, OpKind kind) {
  for (size_t i = 0; i < prog.ops.size(); ++i) {
    if (prog.ops[i].kind == kind) return static_cast<int>(i);
  }
  return -1;
}

TEST(Schedule, BuiltSchedulesValidate) {
  for (Strategy st : kAllStrategies) {
    for (bool one_sided : {false, true}) {
      const Schedule s =
          Build({2, 4}, st, Shape(64, 8, 8), one_sided, 0, 0, st == Strategy::kTorus ? 3 : 1);
      const ValidationReport rep = ValidateSchedule(s);
      EXPECT_TRUE(rep.ok()) << st << "\n" << rep.ToString();
    }
  }
}

TEST(Schedule, MissingRecvIsCaught) {
  Schedule s = Build({1, 2}, Strategy::kRing, Shape(32, 0, 4), false);
  const int i = FindOp(s.ranks[1], OpKind::kRecv);
  ASSERT_GE(i, 0);
  EraseOp(&s.ranks[1], i);
  const ValidationReport rep = ValidateSchedule(s);
  EXPECT_TRUE(HasError(rep, "no matching Recv on rank 1")) << rep.ToString();
}

TEST(Schedule, MissingSignalIsCaught) {
  Schedule s = Build({2, 2}, Strategy::kSwiftFusionTas, Shape(32, 0, 4), true);
  const int i = FindOp(s.ranks[0], OpKind::kPut);
  ASSERT_GE(i, 0);
  s.ranks[0].ops[i].counter.clear();  // a put without its signal
  s.ranks[0].ops[i].count = 0;
  const ValidationReport rep = ValidateSchedule(s);
  EXPECT_TRUE(HasError(rep, "but all signals to it add up to")) << rep.ToString();
}

TEST(Schedule, RendezvousDeadlockIsCaught) {
  // Each rank receives before it sends, on one stream and in no group: NCCL would hang.
  Schedule s;
  s.strategy = "hand-made";
  s.mesh = {1, 2};
  s.shape = Shape(4, 0, 1);
  for (int r = 0; r < 2; ++r) {
    RankProgram p;
    p.rank = r;
    p.buffers.push_back(BufferDecl{"x", BufferRole::kWork, BufferInit::kZero, 2, 1, 8, 2});
    p.buffers.push_back(BufferDecl{"y", BufferRole::kWork, BufferInit::kZero, 2, 1, 8, 2});
    Op recv;
    recv.kind = OpKind::kRecv;
    recv.stream = Stream::kCommIntra;
    recv.peer = 1 - r;
    recv.link = LinkKind::kIntraMachine;
    recv.tag = 10 + (1 - r);
    recv.dst = Region{1, 0, 2, 0, 1};
    recv.bytes = 2 * 2 * 8 * 2;
    Op send = recv;
    send.kind = OpKind::kSend;
    send.tag = 10 + r;
    send.dst = Region{};
    send.src = Region{0, 0, 2, 0, 1};
    p.ops = {recv, send};
    s.ranks.push_back(p);
  }
  ValidationReport rep = ValidateSchedule(s);
  EXPECT_TRUE(HasError(rep, "deadlock")) << rep.ToString();
  EXPECT_TRUE(HasError(rep, "rank 0 op #0 (Recv)")) << rep.ToString();
  // Grouping the two ops of each rank (ncclGroupStart/End) resolves it.
  for (RankProgram& p : s.ranks) {
    for (Op& op : p.ops) op.group = 0;
  }
  rep = ValidateSchedule(s);
  EXPECT_TRUE(rep.ok()) << rep.ToString();
}

TEST(Schedule, HostileFieldsAreNamed) {
  const Schedule good = Build({2, 2}, Strategy::kUsp, Shape(32, 4, 4), false);
  {
    Schedule s = good;
    const int i = FindOp(s.ranks[0], OpKind::kAttention);
    s.ranks[0].ops[i].key.tokens += 1000;
    EXPECT_TRUE(HasError(ValidateSchedule(s), "field 'key' region")) << "key out of bounds";
  }
  {
    Schedule s = good;
    const int i = FindOp(s.ranks[0], OpKind::kAttention);
    s.ranks[0].ops[i].flops *= 2;
    EXPECT_TRUE(HasError(ValidateSchedule(s), "flops is"));
  }
  {
    Schedule s = good;
    const int i = FindOp(s.ranks[0], OpKind::kSend);
    s.ranks[0].ops[i].bytes += 2;
    const ValidationReport rep = ValidateSchedule(s);
    EXPECT_TRUE(HasError(rep, "bytes is")) << rep.ToString();
  }
  {
    Schedule s = good;
    const int i = FindOp(s.ranks[0], OpKind::kSend);
    s.ranks[0].ops[i].link = s.ranks[0].ops[i].link == LinkKind::kInterMachine
                                 ? LinkKind::kIntraMachine
                                 : LinkKind::kInterMachine;
    EXPECT_TRUE(HasError(ValidateSchedule(s), "mesh says"));
  }
  {
    Schedule s = good;
    s.ranks[1].ops[0].deps = {5};
    EXPECT_TRUE(HasError(ValidateSchedule(s), "is not an earlier op"));
  }
  {
    Schedule s = good;
    s.ranks[1].buffers[3].name = s.ranks[1].buffers[2].name;
    EXPECT_TRUE(HasError(ValidateSchedule(s), "twice"));
  }
  {
    Schedule s = good;
    const int i = FindOp(s.ranks[0], OpKind::kMerge);
    ASSERT_GE(i, 0);
    s.ranks[0].ops[i].dst.heads -= 1;
    EXPECT_TRUE(HasError(ValidateSchedule(s), "differ in shape"));
  }
}

// Received bytes of every rank, intra + inter, in closed form.
TEST(Schedule, VolumesMatchClosedForms) {
  const int64_t b = 2, d = 8, e = 2, S = 96, H = 8;
  auto recv = [](const Schedule& s, int r) {
    const auto v = CommVolumePerRank(s);
    return v[r].recv_bytes();
  };
  for (bool one_sided : {false, true}) {
    for (SpMesh mesh : {SpMesh{1, 2}, SpMesh{2, 2}, SpMesh{2, 4}}) {
      const int64_t N = mesh.ranks();
      const Schedule uly = Build(mesh, Strategy::kUlysses, Shape(S, 0, H), one_sided);
      const Schedule ring = Build(mesh, Strategy::kRing, Shape(S, 0, H), one_sided);
      for (int r = 0; r < N; ++r) {
        // Ulysses: q, k, v in and out back: 4 * b * (S/N) * H * d * e * (N-1)/N.
        EXPECT_EQ(recv(uly, r), 4 * b * (S / N) * H * d * e * (N - 1) / N);
        EXPECT_EQ(CommVolumePerRank(uly)[r].sent_bytes(), recv(uly, r));
        // Ring: k and v of the other R-1 blocks: 2 * b * S * H * d * e * (R-1)/R.
        EXPECT_EQ(recv(ring, r), 2 * b * S * H * d * e * (N - 1) / N);
      }
    }
    // Hybrids on 4 machines x 2 GPUs: U x R = 4 x 2 (tas, torus) and 2 x 4 (usp).
    const SpMesh mesh{4, 2};
    const int64_t N = 8;
    const Schedule usp = Build(mesh, Strategy::kUsp, Shape(S, 0, H), one_sided);
    const Schedule tas = Build(mesh, Strategy::kSwiftFusionTas, Shape(S, 0, H), one_sided);
    const Schedule torus = Build(mesh, Strategy::kTorus, Shape(S, 0, H), one_sided, 0, 0, 3);
    const auto vu = CommVolumePerRank(usp), vt = CommVolumePerRank(tas),
               vx = CommVolumePerRank(torus);
    for (int r = 0; r < N; ++r) {
      // usp: Ulysses (U = 2) within the machine, Ring (R = 4) across.
      EXPECT_EQ(vu[r].recv_intra_bytes, 4 * b * (S / N) * H * d * e * 1 / 2);
      EXPECT_EQ(vu[r].recv_inter_bytes, 2 * 3 * b * (S / 4) * (H / 2) * d * e);
      // tas: Ulysses (U = 4) across machines, Ring (R = 2) within.
      EXPECT_EQ(vt[r].recv_inter_bytes, 4 * b * (S / N) * H * d * e * 3 / 4);
      EXPECT_EQ(vt[r].recv_intra_bytes, 2 * 1 * b * (S / 2) * (H / 4) * d * e);
      // The paper's point: less inter-machine volume than USP from 3 machines on.
      EXPECT_LT(vt[r].recv_inter_bytes, vu[r].recv_inter_bytes);
      // Torus moves exactly what tas moves, only in chunks.
      EXPECT_EQ(vx[r].recv_inter_bytes, vt[r].recv_inter_bytes);
      EXPECT_EQ(vx[r].recv_intra_bytes, vt[r].recv_intra_bytes);
      EXPECT_EQ(vx[r].attention_flops, vt[r].attention_flops);
    }
  }
}

TEST(Schedule, TextAllGatherVolumeAndFlops) {
  const int64_t b = 2, d = 8, e = 2, S = 96, H = 8, T = 16;
  const Schedule s = Build({2, 4}, Strategy::kUsp, Shape(S, T, H), false);  // U = 4, R = 2
  const auto v = CommVolumePerRank(s);
  const int64_t N = 8, U = 4, R = 2;
  for (int r = 0; r < N; ++r) {
    const int64_t base =
        4 * b * (S / N) * H * d * e * (U - 1) / U + 2 * (R - 1) * b * (S / R) * (H / U) * d * e;
    EXPECT_EQ(v[r].recv_bytes(), base + b * T * H * d * e * (N - 1) / N);
    // Image rows (S/R) x (S + T) plus text rows (T/R) x (S + T), for H/U heads.
    const double flops = 4.0 * b * (H / U) * ((S / R) + (T / R)) * (S + T) * d;
    EXPECT_EQ(v[r].attention_flops, flops);
  }
}

TEST(Schedule, OneSidedTasSyncsAcrossMachinesOnlyTwice) {
  for (Strategy st : {Strategy::kSwiftFusionTas, Strategy::kTorus}) {
    const Schedule s =
        Build({2, 4}, st, Shape(64, 8, 8), true, 0, 0, st == Strategy::kTorus ? 4 : 1);
    for (const RankProgram& p : s.ranks) {
      std::set<std::string> inter_counters;
      int inter_waits = 0;
      for (const Op& op : p.ops) {
        if (op.kind == OpKind::kSignal && op.link == LinkKind::kInterMachine) {
          inter_counters.insert(op.counter);
        }
        if (op.kind == OpKind::kWait && op.counter.find(".inter") != std::string::npos) {
          ++inter_waits;
        }
      }
      EXPECT_EQ(inter_counters, (std::set<std::string>{"ready.inter", "done.inter"})) << st;
      EXPECT_EQ(inter_waits, 2) << st;
    }
  }
  // USP's ring crosses machines, so its buffer-release signals do too.
  const Schedule usp = Build({4, 2}, Strategy::kUsp, Shape(64, 0, 8), true);
  bool ring_free_inter = false;
  for (const Op& op : usp.ranks[0].ops) {
    ring_free_inter |= op.kind == OpKind::kSignal && op.counter == "ring.free" &&
                       op.link == LinkKind::kInterMachine;
  }
  EXPECT_TRUE(ring_free_inter);
}

TEST(Schedule, PrintAndJson) {
  const Schedule s = Build({2, 2}, Strategy::kTorus, Shape(32, 4, 4), true, 0, 0, 2);
  const std::string text = PrintSchedule(s);
  EXPECT_NE(text.find("torus stationary"), std::string::npos);
  EXPECT_NE(text.find("Put peer"), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(ScheduleToJson(s));
  EXPECT_EQ(j["strategy"], "torus");
  EXPECT_EQ(j["ranks"].size(), 4u);
  EXPECT_EQ(j["ranks"][0]["ops"].size(), s.ranks[0].ops.size());
  EXPECT_EQ(j["config"]["placement"], "ulysses-outer");
  EXPECT_EQ(j["ranks"][1]["volume"]["recv_inter_bytes"], CommVolumePerRank(s)[1].recv_inter_bytes);
}

TEST(Schedule, TransportIsNamedInPrintAndJson) {
  SpConfig c;
  c.strategy = Strategy::kSwiftFusionTas;
  c.one_sided = true;
  c.one_sided_inter = false;
  const Schedule mixed = BuildSchedule({2, 2}, c, Shape(32, 4, 4)).ValueOrThrow();
  EXPECT_NE(PrintSchedule(mixed).find(", one-sided intra / two-sided inter\n"), std::string::npos);
  nlohmann::json j = nlohmann::json::parse(ScheduleToJson(mixed));
  EXPECT_EQ(j["config"]["transport"], "nvshmem-intra");
  EXPECT_EQ(j["config"]["one_sided"], true);
  EXPECT_EQ(j["config"]["one_sided_inter"], false);
  const Schedule two = Build({2, 2}, Strategy::kSwiftFusionTas, Shape(32, 4, 4), false);
  EXPECT_NE(PrintSchedule(two).find(", two-sided\n"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(ScheduleToJson(two))["config"]["transport"], "nccl");
  const Schedule one = Build({2, 2}, Strategy::kSwiftFusionTas, Shape(32, 4, 4), true);
  EXPECT_NE(PrintSchedule(one).find(", one-sided\n"), std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(ScheduleToJson(one))["config"]["transport"], "nvshmem");
  // The scope is meaningless for two-sided transport: resolved to the default.
  c.one_sided = false;
  EXPECT_TRUE(ResolveConfig({2, 2}, c, Shape(32, 4, 4))->one_sided_inter);
  for (const char* name : {"nccl", "nvshmem", "nvshmem-intra"}) {
    SpConfig t;
    ASSERT_TRUE(SetTransport(name, &t));
    EXPECT_STREQ(TransportName(t), name);
  }
  SpConfig t;
  EXPECT_FALSE(SetTransport("nvshmem-inter", &t));
  EXPECT_TRUE(OneSidedOn(mixed.config, LinkKind::kIntraMachine));
  EXPECT_FALSE(OneSidedOn(mixed.config, LinkKind::kInterMachine));
}

// Mixed transport: the sync rounds stay within machines, usp's ring across machines is NCCL and
// needs no release signals, and validation (token game with rendezvous and counters) passes.
TEST(Schedule, IntraOneSidedSyncsOnlyWithinMachines) {
  for (Strategy st : kAllStrategies) {
    for (SpMesh mesh : {SpMesh{2, 2}, SpMesh{2, 4}, SpMesh{3, 2}, SpMesh{4, 1}}) {
      SpConfig c;
      c.strategy = st;
      c.one_sided = true;
      c.one_sided_inter = false;
      c.torus_chunks = st == Strategy::kTorus ? 3 : 1;
      const Schedule s = BuildSchedule(mesh, c, Shape(64, 8, 8)).ValueOrThrow();
      const ValidationReport rep = ValidateSchedule(s);
      EXPECT_TRUE(rep.ok()) << st << "\n" << rep.ToString();
      const std::vector<RankCommVolume> vol = CommVolumePerRank(s);
      for (const RankProgram& p : s.ranks) {
        EXPECT_EQ(vol[p.rank].signals_inter, 0) << st;
        for (const Op& op : p.ops) {
          if (op.kind == OpKind::kSignal && op.counter == "ring.free") {
            EXPECT_TRUE(mesh.same_machine(p.rank, op.peer)) << st << " " << op.label;
          }
          // One GPU per machine: nothing one-sided is left.
          if (mesh.gpus_per_machine == 1) {
            EXPECT_TRUE(op.kind != OpKind::kPut && op.kind != OpKind::kSignal &&
                        op.kind != OpKind::kWait)
                << st << " " << op.label;
          }
        }
      }
    }
  }
}

TEST(Schedule, RegionContiguity) {
  const BufferDecl d{"x", BufferRole::kWork, BufferInit::kZero, 10, 4, 8, 2};
  EXPECT_TRUE(RegionContiguous(Region{0, 2, 3, 0, 4}, d, 1));
  EXPECT_FALSE(RegionContiguous(Region{0, 2, 3, 0, 4}, d, 2));
  EXPECT_FALSE(RegionContiguous(Region{0, 2, 3, 1, 2}, d, 1));
  EXPECT_TRUE(RegionContiguous(Region{0, 2, 1, 1, 2}, d, 1));
  EXPECT_TRUE(RegionContiguous(Region{0, 0, 10, 0, 4}, d, 2));
  EXPECT_EQ(RegionBytes(Region{0, 2, 3, 1, 2}, d, 2), 2 * 3 * 2 * 8 * 2);
}

}  // namespace
}  // namespace ditscale::sp
