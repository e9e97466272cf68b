#include "ditscale/sp/simulator.h"

#include <gtest/gtest.h>

#include <random>

#include "ditscale/sp/internal/fair_share.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

// Round numbers: intra 100 GB/s, NIC 10 GB/s, attention 100 TFLOP/s at any block size.
Topology Simple(int machines, int gpm) {
  Topology t;
  t.name = "simple";
  t.machines = machines;
  t.gpus_per_machine = gpm;
  t.intra_bandwidth_Bps = 100e9;
  t.intra_latency_s = 1e-6;
  t.nic_bandwidth_Bps = 10e9;
  t.inter_latency_s = 10e-6;
  t.attention_flops = 100e12;
  t.attention_half_tokens = 0;
  t.linear_flops = 200e12;
  t.hbm_bandwidth_Bps = 1000e9;
  t.launch_overhead_s = 0;
  t.two_sided_sync_s = 5e-6;
  t.two_sided_sm_fraction = 0;
  t.one_sided_overhead_s = 2e-6;
  return t;
}

struct Builder {
  Schedule s;
  Builder(int machines, int gpm) {
    s.mesh.machines = machines;
    s.mesh.gpus_per_machine = gpm;
    s.ranks.resize(machines * gpm);
    for (int r = 0; r < machines * gpm; ++r) s.ranks[r].rank = r;
  }
  int Add(int rank, Op op) {
    s.ranks[rank].ops.push_back(std::move(op));
    return int(s.ranks[rank].ops.size()) - 1;
  }
};

Op Attention(double seconds_at_100tf, std::vector<int> deps = {}) {
  Op op;
  op.kind = OpKind::kAttention;
  op.stream = Stream::kCompute;
  op.flops = seconds_at_100tf * 100e12;
  op.src.tokens = op.key.tokens = 1024;
  op.deps = std::move(deps);
  op.label = "attn";
  return op;
}

Op Xfer(OpKind kind, int peer, int64_t tag, int64_t bytes, Stream st, std::vector<int> deps = {},
        int group = -1) {
  Op op;
  op.kind = kind;
  op.peer = peer;
  op.tag = tag;
  op.bytes = bytes;
  op.stream = st;
  op.deps = std::move(deps);
  op.group = group;
  op.label = ToString(kind);
  return op;
}

SimResult SimOk(const Builder& b, const Topology& t) {
  auto r = Simulate(b.s, t);
  EXPECT_TRUE(r.ok()) << r.failure().ToString();
  return std::move(r).ValueOrThrow();
}

TEST(FairShare, ProgressiveFilling) {
  // Resource 0 (cap 10) carries A and B; resource 1 (cap 4) carries A: A = 4, B = 6.
  auto rates = internal::MaxMinFairRates({10, 4}, {{0, 1}, {0, -1}});
  EXPECT_DOUBLE_EQ(rates[0], 4);
  EXPECT_DOUBLE_EQ(rates[1], 6);
  // Three flows on one resource: a third each; a flow with no resource: infinite.
  rates = internal::MaxMinFairRates({9}, {{0, -1}, {0, -1}, {-1, 0}, {-1, -1}});
  EXPECT_DOUBLE_EQ(rates[0], 3);
  EXPECT_DOUBLE_EQ(rates[2], 3);
  EXPECT_TRUE(std::isinf(rates[3]));
  // Random instances: no resource over capacity, every flow bottlenecked somewhere.
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 50; ++trial) {
    int nr = 1 + rng() % 6, nf = 1 + rng() % 12;
    std::vector<double> cap(nr);
    for (double& c : cap) c = 1 + rng() % 100;
    std::vector<std::array<int, 2>> flows(nf);
    for (auto& f : flows) f = {int(rng() % nr), rng() % 2 ? int(rng() % nr) : -1};
    for (auto& f : flows)
      if (f[1] == f[0]) f[1] = -1;
    auto x = internal::MaxMinFairRates(cap, flows);
    std::vector<double> used(nr, 0);
    for (int f = 0; f < nf; ++f)
      for (int r : flows[f])
        if (r >= 0) used[r] += x[f];
    for (int r = 0; r < nr; ++r) EXPECT_LE(used[r], cap[r] * (1 + 1e-9));
    for (int f = 0; f < nf; ++f) {
      bool bottleneck = false;  // some resource of f is saturated and f has a maximal rate on it
      for (int r : flows[f]) {
        if (r < 0 || used[r] < cap[r] * (1 - 1e-9)) continue;
        bool max_there = true;
        for (int g = 0; g < nf; ++g)
          for (int q : flows[g])
            if (q == r && x[g] > x[f] * (1 + 1e-9)) max_there = false;
        bottleneck |= max_there;
      }
      EXPECT_TRUE(bottleneck) << "flow " << f << " rate " << x[f];
    }
  }
}

TEST(Simulator, OneIntraTransfer) {
  Builder b(1, 2);
  b.Add(0, Xfer(OpKind::kSend, 1, 7, 1'000'000'000, Stream::kCommIntra));
  b.Add(1, Xfer(OpKind::kRecv, 0, 7, 1'000'000'000, Stream::kCommIntra));
  SimResult r = SimOk(b, Simple(1, 2));
  // sync 5 us + latency 1 us + 1 GB / 100 GB/s.
  EXPECT_NEAR(r.layer_s, 6e-6 + 0.01, 1e-12);
  EXPECT_EQ(r.ranks[0].sent_intra_bytes, 1'000'000'000);
  EXPECT_EQ(r.intra_bytes, 1'000'000'000);
  EXPECT_EQ(r.inter_bytes, 0);
  EXPECT_NEAR(r.ranks[1].exposed_comm_s, r.layer_s, 1e-12);
  EXPECT_NEAR(r.critical_path.intra_transfer_s, r.layer_s, 1e-12);
}

TEST(Simulator, TwoFlowsShareTheNic) {
  const int64_t gb = 1'000'000'000;
  for (int flows : {1, 2}) {
    Builder b(2, 2);
    for (int f = 0; f < flows; ++f) {
      b.Add(f, Xfer(OpKind::kSend, 2 + f, 1, gb, Stream::kCommInter));
      b.Add(2 + f, Xfer(OpKind::kRecv, f, 1, gb, Stream::kCommInter));
    }
    SimResult r = SimOk(b, Simple(2, 2));
    EXPECT_NEAR(r.layer_s, 15e-6 + flows * 0.1, 1e-12) << flows;
    EXPECT_EQ(r.inter_bytes, flows * gb);
    EXPECT_NEAR(r.inter_busy_s, flows * 0.1, 1e-12);
  }
  // Two flows from different machines into one machine share its NIC ingress; flows in opposite
  // directions do not contend.
  Builder in(3, 1);
  in.Add(0, Xfer(OpKind::kPut, 2, -1, gb, Stream::kCommInter));
  in.Add(1, Xfer(OpKind::kPut, 2, -1, gb, Stream::kCommInter));
  EXPECT_NEAR(SimOk(in, Simple(3, 1)).layer_s, 12e-6 + 0.2, 1e-12);
  Builder both(2, 1);
  both.Add(0, Xfer(OpKind::kPut, 1, -1, gb, Stream::kCommInter));
  both.Add(1, Xfer(OpKind::kPut, 0, -1, gb, Stream::kCommInter));
  EXPECT_NEAR(SimOk(both, Simple(2, 1)).layer_s, 12e-6 + 0.1, 1e-12);
}

TEST(Simulator, LateFlowGetsFairShareThenFullRate) {
  // Flow A starts at 0, flow B starts when a 0.05 s attention ends; both 1 GB through one NIC.
  const int64_t gb = 1'000'000'000;
  Builder b(2, 2);
  Topology t = Simple(2, 2);
  t.inter_latency_s = 0;
  t.one_sided_overhead_s = 0;
  b.Add(0, Xfer(OpKind::kPut, 2, -1, gb, Stream::kCommInter));
  int a = b.Add(1, Attention(0.05));
  b.Add(1, Xfer(OpKind::kPut, 3, -1, gb, Stream::kCommInter, {a}));
  // A: 0.5 GB alone by 0.05 s, then 5 GB/s: done at 0.15. B: 0.5 GB by 0.15, then alone: 0.2.
  SimResult r = SimOk(b, t);
  EXPECT_NEAR(r.layer_s, 0.2, 1e-12);
  EXPECT_NEAR(r.ranks[0].end_s, 0.15, 1e-12);
}

TEST(Simulator, OverlapHidesCommunication) {
  const int64_t bytes = 5'000'000'000;  // 0.5 s over the NIC
  for (bool overlap : {true, false}) {
    Builder b(2, 1);
    Stream st = overlap ? Stream::kCommInter : Stream::kCompute;
    int s0 = b.Add(0, Xfer(OpKind::kSend, 1, 3, bytes, st));
    int a0 = b.Add(0, Attention(1.0));
    b.Add(0, Attention(1.0, {a0, s0}));
    int r1 = b.Add(1, Xfer(OpKind::kRecv, 0, 3, bytes, st));
    int a1 = b.Add(1, Attention(1.0));
    b.Add(1, Attention(1.0, {a1, r1}));
    SimResult r = SimOk(b, Simple(2, 1));
    double comm = 15e-6 + 0.5;
    if (overlap) {
      EXPECT_NEAR(r.layer_s, 2.0, 1e-12);
      EXPECT_NEAR(r.ranks[0].compute_s, 2.0, 1e-12);
      EXPECT_NEAR(r.ranks[0].exposed_comm_s, 0.0, 1e-12);
      EXPECT_NEAR(r.ranks[0].comm_active_s, comm, 1e-12);
      EXPECT_NEAR(r.critical_path.attention_s, 2.0, 1e-12);
    } else {
      EXPECT_NEAR(r.layer_s, 2.0 + comm, 1e-12);
      // Transfers on the compute stream count as compute-stream time but comm on the path.
      EXPECT_NEAR(r.critical_path.inter_transfer_s, comm, 1e-12);
    }
  }
}

TEST(Simulator, ExposedCommunicationAndIdle) {
  Builder b(2, 1);
  b.Add(0, Xfer(OpKind::kSend, 1, 1, 1'000'000'000, Stream::kCommInter));
  int rv = b.Add(1, Xfer(OpKind::kRecv, 0, 1, 1'000'000'000, Stream::kCommInter));
  b.Add(1, Attention(0.3, {rv}));
  SimResult r = SimOk(b, Simple(2, 1));
  double comm = 15e-6 + 0.1;
  EXPECT_NEAR(r.layer_s, comm + 0.3, 1e-12);
  EXPECT_NEAR(r.ranks[1].exposed_comm_s, comm, 1e-12);
  EXPECT_NEAR(r.ranks[1].compute_s, 0.3, 1e-12);
  EXPECT_NEAR(r.ranks[1].idle_s, 0, 1e-12);
  EXPECT_NEAR(r.ranks[0].idle_s, 0.3, 1e-12);  // rank 0 is done after the send
  EXPECT_NEAR(r.ranks[0].end_s, comm, 1e-12);
  const CriticalPath& cp = r.critical_path;
  EXPECT_EQ(cp.ops, 2);
  EXPECT_NEAR(cp.inter_transfer_s, comm, 1e-12);
  EXPECT_NEAR(cp.attention_s, 0.3, 1e-12);
  EXPECT_NE(cp.Describe().find("attention 75%"), std::string::npos) << cp.Describe();
}

// A ring of R ranks on one machine: step s attends the kv block received at step s-1 while the
// next block moves. Comm per step c = sync + latency + bytes / bw; attention per step a.
SimResult Ring(int R, double a, int64_t bytes, const Topology& t) {
  Builder b(1, R);
  for (int r = 0; r < R; ++r) {
    int prev_recv = -1;
    for (int s = 0; s < R; ++s) {
      std::vector<int> deps;
      if (prev_recv >= 0) deps.push_back(prev_recv);
      b.Add(r, Attention(a, deps));
      if (s == R - 1) break;
      b.Add(r, Xfer(OpKind::kSend, (r + 1) % R, s, bytes, Stream::kCommIntra, deps, s));
      prev_recv =
          b.Add(r, Xfer(OpKind::kRecv, (r + R - 1) % R, s, bytes, Stream::kCommIntra, deps, s));
    }
  }
  return SimOk(b, t);
}

TEST(Simulator, RingWithRSteps) {
  Topology t = Simple(1, 4);
  // Compute-bound: c = 6 us + 1 ms < a = 10 ms -> R * a.
  EXPECT_NEAR(Ring(4, 0.01, 100'000'000, t).layer_s, 4 * 0.01, 1e-12);
  // Comm-bound: c = 6 us + 50 ms > a -> (R - 1) * c + a.
  SimResult r = Ring(4, 0.01, 5'000'000'000, t);
  EXPECT_NEAR(r.layer_s, 3 * (6e-6 + 0.05) + 0.01, 1e-12);
  EXPECT_NEAR(r.ranks[2].exposed_comm_s, 3 * (6e-6 + 0.05) - 3 * 0.01, 1e-12);
  for (int R : {2, 3, 8}) {
    Topology tr = Simple(1, R);
    EXPECT_NEAR(Ring(R, 0.01, 100'000'000, tr).layer_s, R * 0.01, 1e-12) << R;
  }
}

TEST(Simulator, RendezvousVersusOneSided) {
  const int64_t gb = 1'000'000'000;
  // Receiver posts its Recv only after 1 s of attention: the two-sided send waits for it.
  Builder two(2, 1);
  two.Add(0, Xfer(OpKind::kSend, 1, 1, gb, Stream::kCommInter));
  int a = two.Add(1, Attention(1.0));
  two.Add(1, Xfer(OpKind::kRecv, 0, 1, gb, Stream::kCommInter, {a}));
  SimResult r2 = SimOk(two, Simple(2, 1));
  EXPECT_NEAR(r2.layer_s, 1.0 + 15e-6 + 0.1, 1e-12);
  EXPECT_NEAR(r2.ranks[0].end_s, r2.layer_s, 1e-12);
  // One-sided: the put lands during the attention; the wait passes at once.
  Builder one(2, 1);
  Op put = Xfer(OpKind::kPut, 1, -1, gb, Stream::kCommInter);
  put.counter = "kv";
  put.count = 1;
  one.Add(0, put);
  a = one.Add(1, Attention(1.0));
  Op wait;
  wait.kind = OpKind::kWait;
  wait.stream = Stream::kCompute;
  wait.counter = "kv";
  wait.count = 1;
  wait.deps = {a};
  int w = one.Add(1, wait);
  one.Add(1, Attention(0.5, {w}));
  SimResult r1 = SimOk(one, Simple(2, 1));
  EXPECT_NEAR(r1.layer_s, 1.5, 1e-12);
  EXPECT_NEAR(r1.ranks[0].end_s, 12e-6 + 0.1, 1e-12);
  // A late put: the wait blocks the compute stream until it lands (exposed comm).
  Builder late(2, 1);
  int a0 = late.Add(0, Attention(0.2));
  put.deps = {a0};
  late.Add(0, put);
  wait.deps = {};
  w = late.Add(1, wait);
  late.Add(1, Attention(0.5, {w}));
  SimResult rl = SimOk(late, Simple(2, 1));
  EXPECT_NEAR(rl.layer_s, 0.2 + 12e-6 + 0.1 + 0.5, 1e-12);
  EXPECT_NEAR(rl.ranks[1].exposed_comm_s, 0.2 + 12e-6 + 0.1, 1e-12);
  EXPECT_EQ(rl.critical_path.ops, 4);  // attention, put, wait, attention
}

TEST(Simulator, SignalsAndCountersThreshold) {
  // Two signals raise rank 2's counter to 2; its wait needs both.
  Builder b(3, 1);
  Op sig = Xfer(OpKind::kSignal, 2, -1, 0, Stream::kCommInter);
  sig.counter = "ready";
  sig.count = 1;
  b.Add(0, sig);
  int a = b.Add(1, Attention(0.1));
  sig.deps = {a};
  b.Add(1, sig);
  Op wait;
  wait.kind = OpKind::kWait;
  wait.stream = Stream::kCommInter;
  wait.counter = "ready";
  wait.count = 2;
  b.Add(2, wait);
  SimResult r = SimOk(b, Simple(3, 1));
  EXPECT_NEAR(r.layer_s, 0.1 + 12e-6, 1e-12);
  EXPECT_NEAR(r.critical_path.signal_s, 12e-6, 1e-12);
}

TEST(Simulator, TwoSidedTransfersSlowConcurrentCompute) {
  for (bool one_sided : {false, true}) {
    Topology t = Simple(2, 1);
    t.two_sided_sm_fraction = 0.5;
    t.two_sided_sync_s = 0;
    t.one_sided_overhead_s = 0;
    t.inter_latency_s = 0;
    Builder b(2, 1);
    b.Add(0,
          Xfer(one_sided ? OpKind::kPut : OpKind::kSend, 1, 1, 4'000'000'000, Stream::kCommInter));
    if (!one_sided) b.Add(1, Xfer(OpKind::kRecv, 0, 1, 4'000'000'000, Stream::kCommInter));
    b.Add(0, Attention(1.0));
    SimResult r = SimOk(b, t);
    // Two-sided: 0.4 s at half speed (0.2 s of work), then 0.8 s: 1.2 s.
    EXPECT_NEAR(r.ranks[0].end_s, one_sided ? 1.0 : 1.2, 1e-12);
  }
}

// Two GPUs of machine 0 send to two GPUs of machine 1 at once: one shared NIC per machine halves
// each flow's rate; one NIC per GPU (nics_per_machine 0, emulated machines) does not.
TEST(Simulator, NicsPerMachineShareOrSeparateInterMachineFlows) {
  for (int nics : {1, 2, 0}) {
    Topology t = Simple(2, 2);
    t.nics_per_machine = nics;
    t.inter_latency_s = 0;
    t.two_sided_sync_s = 0;
    t.one_sided_overhead_s = 0;
    Builder b(2, 2);
    b.Add(0, Xfer(OpKind::kPut, 2, -1, 1'000'000'000, Stream::kCommInter));
    b.Add(1, Xfer(OpKind::kPut, 3, -1, 1'000'000'000, Stream::kCommInter));
    SimResult r = SimOk(b, t);
    const double one = 1e9 / t.nic_bandwidth_Bps;  // 0.1 s alone
    EXPECT_NEAR(r.layer_s, nics == 1 ? 2 * one : one, 1e-9) << "nics_per_machine " << nics;
  }
  // Both flows from one GPU share its NIC whatever the count.
  Topology t = Simple(2, 2);
  t.nics_per_machine = 0;
  t.inter_latency_s = 0;
  t.one_sided_overhead_s = 0;
  Builder b(2, 2);
  b.Add(0, Xfer(OpKind::kPut, 2, -1, 1'000'000'000, Stream::kCommInter, {}, 0));
  b.Add(0, Xfer(OpKind::kPut, 3, -1, 1'000'000'000, Stream::kCommInter, {}, 0));
  EXPECT_NEAR(SimOk(b, t).layer_s, 0.2, 1e-9);
}

// inter_compute_interference: an inter-machine transfer runs at (1 - f) of its rate while either
// end computes (sender or receiver), at full rate otherwise; intra-machine transfers never slow.
TEST(Simulator, InterMachineTransfersSlowWhileEitherEndComputes) {
  for (int computing_rank : {0, 1}) {
    for (double f : {0.0, 0.5}) {
      Topology t = Simple(2, 1);  // NIC 10 GB/s: 1 GB alone is 0.1 s
      t.inter_compute_interference = f;
      t.inter_latency_s = 0;
      t.one_sided_overhead_s = 0;
      Builder b(2, 1);
      b.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, Stream::kCommInter));
      b.Add(computing_rank, Attention(0.04));
      SimResult r = SimOk(b, t);
      // 0.04 s at (1 - f): 0.04 * (1 - f) of the 0.1 s of data, the rest at full rate.
      EXPECT_NEAR(r.ranks[0].end_s, 0.04 + (0.1 - 0.04 * (1 - f)), 1e-9)
          << "f " << f << " computing rank " << computing_rank;
    }
  }
  Topology t = Simple(1, 2);  // intra-machine: unaffected
  t.inter_compute_interference = 0.5;
  t.one_sided_overhead_s = 0;
  t.intra_latency_s = 0;
  Builder b(1, 2);
  b.Add(0, Xfer(OpKind::kPut, 1, -1, 10'000'000'000, Stream::kCommIntra));
  b.Add(1, Attention(0.04));
  EXPECT_NEAR(SimOk(b, t).layer_s, 0.1, 1e-9);
}

// attention_holds_sms: a send/recv that becomes ready while either end runs an attention op
// makes no progress until the op ends (its NCCL kernel finds no SM), on any link; one that was
// running when the attention op started runs beside it (slowing it by the SM fraction); a put
// within a machine (copy engine) is never stalled, one between machines (NVSHMEM, a kernel) is;
// other compute does not stall a send/recv.
Op Pack(double seconds, Stream st) {  // Simple(): HBM 1000 GB/s, read + write
  Op op;
  op.kind = OpKind::kPack;
  op.stream = st;
  op.bytes = static_cast<int64_t>(seconds * 1000e9 / 2);
  op.label = "pack";
  return op;
}

TEST(Simulator, AttentionHoldingEverySmStallsLaterTwoSidedTransfers) {
  for (bool holds : {false, true}) {
    for (int attending_rank : {0, 1}) {
      for (int machines : {1, 2}) {
        Topology t = Simple(machines, 2 / machines);  // 1 GB: 0.01 s intra, 0.1 s inter
        t.attention_holds_sms = holds;
        t.two_sided_sm_fraction = 0.5;
        t.two_sided_sync_s = t.one_sided_overhead_s = 0;
        t.intra_latency_s = t.inter_latency_s = 0;
        const double xfer = machines == 1 ? 0.01 : 0.1;
        const Stream cs = machines == 1 ? Stream::kCommIntra : Stream::kCommInter;
        const std::string what = "holds " + std::to_string(holds) + " rank " +
                                 std::to_string(attending_rank) + " machines " +
                                 std::to_string(machines);
        // The transfer becomes ready 1 ms after the attention op started.
        Builder later(machines, 2 / machines);
        int pk = later.Add(0, Pack(0.001, cs));
        later.Add(0, Xfer(OpKind::kSend, 1, 1, 1'000'000'000, cs, {pk}));
        later.Add(1, Xfer(OpKind::kRecv, 0, 1, 1'000'000'000, cs));
        later.Add(attending_rank, Attention(0.2));
        SimResult r = SimOk(later, t);
        // Held: the attention alone at full speed, then the transfer. Not held: both at once,
        // the attention at half speed while the transfer runs.
        EXPECT_NEAR(r.layer_s, holds ? 0.2 + xfer : 0.2 + 0.5 * xfer, 1e-9) << what;
        // The transfer ready 1 ms before the attention op: it runs beside it either way.
        Builder first(machines, 2 / machines);
        first.Add(0, Xfer(OpKind::kSend, 1, 1, 1'000'000'000, cs));
        first.Add(1, Xfer(OpKind::kRecv, 0, 1, 1'000'000'000, cs));
        int ap = first.Add(attending_rank, Pack(0.001, Stream::kCompute));
        first.Add(attending_rank, Attention(0.2, {ap}));
        // The pack runs at half speed beside the transfer (0.002 s), then the attention at half
        // speed until the transfer ends, then at full speed.
        EXPECT_NEAR(SimOk(first, t).layer_s, 0.002 + 0.2 + 0.5 * (xfer - 0.002), 1e-9) << what;
      }
    }
  }
  // A put within a machine (copy engine, stream memory operations) runs beside the attention
  // op; one between machines (NVSHMEM's put-with-signal, a kernel) waits for its end.
  for (int machines : {1, 2}) {
    Topology t = Simple(machines, 2 / machines);
    t.attention_holds_sms = true;
    t.two_sided_sm_fraction = 0;
    t.two_sided_sync_s = t.one_sided_overhead_s = t.inter_latency_s = t.intra_latency_s = 0;
    const Stream cs = machines == 1 ? Stream::kCommIntra : Stream::kCommInter;
    Builder put(machines, 2 / machines);
    int pk = put.Add(0, Pack(0.001, cs));
    put.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, cs, {pk}));
    put.Add(0, Attention(0.2));
    EXPECT_NEAR(SimOk(put, t).layer_s, machines == 1 ? 0.2 : 0.2 + 0.1, 1e-9) << machines;
  }
  Topology t = Simple(2, 1);
  t.attention_holds_sms = true;
  t.two_sided_sm_fraction = 0;
  t.two_sided_sync_s = t.one_sided_overhead_s = t.inter_latency_s = 0;
  Builder merge(2, 1);
  int mp = merge.Add(0, Pack(0.001, Stream::kCommInter));
  merge.Add(0, Xfer(OpKind::kSend, 1, 1, 1'000'000'000, Stream::kCommInter, {mp}));
  merge.Add(1, Xfer(OpKind::kRecv, 0, 1, 1'000'000'000, Stream::kCommInter));
  Op m;
  m.kind = OpKind::kMerge;
  m.stream = Stream::kCompute;
  m.bytes = 50'000'000'000;  // 3 x 50 GB at 1000 GB/s: 0.15 s
  m.label = "merge";
  merge.Add(0, m);
  EXPECT_NEAR(SimOk(merge, t).layer_s, 0.15, 1e-9);
}

// A kernel on a comm stream (a pack) that becomes ready while its rank runs an attention call
// waits for the call's end under attention_holds_sms; one that started before runs beside it.
TEST(Simulator, CommStreamKernelsWaitForAnAttentionCallThatStartedFirst) {
  for (bool holds : {false, true}) {
    Topology t = Simple(1, 2);
    t.attention_holds_sms = holds;
    Builder later(1, 2);
    later.Add(0, Pack(0.001, Stream::kCommIntra));  // starts with the call: runs beside it
    later.Add(0, Pack(0.01, Stream::kCommIntra));   // ready 1 ms after the call started
    later.Add(0, Attention(0.2));
    // Held: the pack after the call (0.2 + 0.01); else beside it.
    EXPECT_NEAR(SimOk(later, t).layer_s, holds ? 0.21 : 0.2, 1e-9) << holds;
    Builder first(1, 2);
    first.Add(0, Pack(0.01, Stream::kCommIntra));
    int own = first.Add(0, Pack(0.001, Stream::kCompute));  // the call starts 1 ms later
    first.Add(0, Attention(0.2, {own}));
    EXPECT_NEAR(SimOk(first, t).layer_s, 0.201, 1e-9) << holds;
  }
}

// An SM partition (SpConfig::comm_sms): the attention op runs on the partition (longer by
// gpu_sms / compute SMs without a wave model), and what attention_holds_sms stalls runs beside it
// on the free SMs, at their copy rate: a transfer shares it, a comm kernel runs at its share of
// HBM bandwidth. A topology without partitions refuses comm_sms.
TEST(Simulator, SmPartitionRunsStalledKernelsBesideAttentionOnTheFreeSms) {
  Topology t = Simple(2, 1);  // NIC 10 GB/s, HBM 1000 GB/s
  t.attention_holds_sms = true;
  t.two_sided_sm_fraction = 0.5;
  t.two_sided_sync_s = t.one_sided_overhead_s = t.inter_latency_s = 0;
  t.gpu_sms = 100;
  t.sm_partition_step = 10;
  t.comm_sm_Bps = 0.5e9;  // comm_sms 5 -> 90 SMs for compute, 10 free: 5 GB/s
  const double attn = 0.2 * 100 / 90;
  for (int comm_sms : {0, 5}) {
    Builder x(2, 1);
    x.s.config.comm_sms = comm_sms;
    int pk = x.Add(0, Pack(0.001, Stream::kCommInter));
    x.Add(0, Xfer(OpKind::kSend, 1, 1, 2'000'000'000, Stream::kCommInter, {pk}));
    x.Add(1, Xfer(OpKind::kRecv, 0, 1, 2'000'000'000, Stream::kCommInter));
    x.Add(0, Attention(0.2));
    // Whole GPU: held until the call ends, then 0.2 s at the NIC rate. Partition: 5 GB/s beside
    // the (longer) call, the rest at 10 GB/s; no SM-fraction slow-down of the call.
    const double moved = (attn - 0.001) * 5e9;
    EXPECT_NEAR(SimOk(x, t).layer_s, comm_sms ? attn + (2e9 - moved) / 10e9 : 0.2 + 0.2, 1e-9)
        << comm_sms;
    Builder k(1, 2);
    Topology t1 = t;
    t1.machines = 1;
    t1.gpus_per_machine = 2;
    k.s.config.comm_sms = comm_sms;
    k.Add(0, Pack(0.001, Stream::kCommIntra));
    k.Add(0, Pack(0.01, Stream::kCommIntra));  // ready 1 ms after the call started
    k.Add(0, Attention(0.2));
    // Partition: 5 GB/s of 1000 GB/s HBM beside the call, the rest after it.
    const double done = (attn - 0.001) * 0.005;
    EXPECT_NEAR(SimOk(k, t1).layer_s, comm_sms ? attn + (0.01 - done) : 0.21, 1e-9) << comm_sms;
  }
  Builder bad(2, 1);
  bad.s.config.comm_sms = 4;
  bad.Add(0, Attention(0.2));
  auto r = Simulate(bad.s, Simple(2, 1));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.failure().ToString().find("comm_sms"), std::string::npos) << r.failure().ToString();
}

// A duplex limit (loopback sockets): one way runs at the NIC rate, two opposite flows share
// nic_duplex between them; without the limit each direction is independent.
TEST(Simulator, NicDuplexLimitsOppositeFlows) {
  for (double duplex_gbps : {0.0, 15.0}) {
    Topology t = Simple(2, 1);  // NIC 10 GB/s
    t.nic_duplex_Bps = duplex_gbps * 1e9;
    t.inter_latency_s = 0;
    t.one_sided_overhead_s = 0;
    Builder one(2, 1);
    one.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, Stream::kCommInter));
    EXPECT_NEAR(SimOk(one, t).layer_s, 0.1, 1e-9);  // one way: the NIC rate either way
    Builder both(2, 1);
    both.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, Stream::kCommInter));
    both.Add(1, Xfer(OpKind::kPut, 0, -1, 1'000'000'000, Stream::kCommInter));
    // Both ways: 10 GB/s each (full duplex) or 7.5 GB/s each (15 GB/s shared).
    EXPECT_NEAR(SimOk(both, t).layer_s, duplex_gbps > 0 ? 1.0 / 7.5 : 0.1, 1e-9) << duplex_gbps;
  }
}

TEST(Simulator, GroupsStartTogetherAndBlockTheStream) {
  // Two sends in one group run concurrently (sharing the egress port); the op after the group
  // starts when both have finished.
  Builder b(1, 3);
  b.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, Stream::kCommIntra, {}, 0));
  b.Add(0, Xfer(OpKind::kPut, 2, -1, 1'000'000'000, Stream::kCommIntra, {}, 0));
  b.Add(0, Xfer(OpKind::kPut, 1, -1, 1'000'000'000, Stream::kCommIntra));
  SimResult r = SimOk(b, Simple(1, 3));
  EXPECT_NEAR(r.layer_s, (3e-6 + 0.02) + (3e-6 + 0.01), 1e-12);
}

TEST(Simulator, DeadlockAndMismatchAreFailures) {
  Builder b(2, 1);
  b.Add(0, Xfer(OpKind::kRecv, 1, 1, 10, Stream::kCommInter));
  b.Add(0, Xfer(OpKind::kSend, 1, 2, 10, Stream::kCommInter));
  b.Add(1, Xfer(OpKind::kRecv, 0, 2, 10, Stream::kCommInter));
  b.Add(1, Xfer(OpKind::kSend, 0, 1, 10, Stream::kCommInter));
  auto r = Simulate(b.s, Simple(2, 1));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.failure().message.find("deadlock"), std::string::npos) << r.failure().message;
  EXPECT_NE(r.failure().message.find("rank 0 op 0 Recv"), std::string::npos) << r.failure().message;
  auto m = Simulate(b.s, Simple(1, 2));
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.failure().message.find("does not match"), std::string::npos);
  Builder w(1, 1);
  Op wait;
  wait.kind = OpKind::kWait;
  wait.counter = "never";
  wait.count = 1;
  w.Add(0, wait);
  EXPECT_FALSE(Simulate(w.s, Simple(1, 1)).ok());
}

// Mixed transport (puts within machines, NCCL between them): the simulator runs it; the bytes
// per link are those of the other transports, and only the intra-machine link carries signals.
TEST(Simulator, IntraOneSidedInterTwoSided) {
  AttentionShape shape;
  shape.seq_tokens = 4096;
  shape.text_tokens = 64;
  shape.heads = 8;
  shape.head_dim = 64;
  for (Strategy st : kAllStrategies) {
    for (SpMesh mesh : {SpMesh{2, 2}, SpMesh{2, 4}, SpMesh{3, 2}}) {
      const Topology t = Simple(mesh.machines, mesh.gpus_per_machine);
      SpConfig c;
      c.strategy = st;
      c.torus_chunks = st == Strategy::kTorus ? 2 : 1;
      c.one_sided = true;
      c.one_sided_inter = false;
      const Schedule mixed = BuildSchedule(mesh, c, shape).ValueOrThrow();
      c.one_sided = false;
      const Schedule two = BuildSchedule(mesh, c, shape).ValueOrThrow();
      Result<SimResult> a = Simulate(mixed, t);
      ASSERT_TRUE(a.ok()) << st << ": " << a.failure().ToString();
      SimResult b = Simulate(two, t).ValueOrThrow();
      EXPECT_GT(a->layer_s, 0);
      for (size_t r = 0; r < a->ranks.size(); ++r) {
        EXPECT_EQ(a->ranks[r].sent_inter_bytes, b.ranks[r].sent_inter_bytes) << st;
        EXPECT_EQ(a->ranks[r].sent_intra_bytes, b.ranks[r].sent_intra_bytes) << st;
      }
    }
  }
}

TEST(Simulator, PredictStep) {
  SimResult r;
  r.layer_s = 0.01;
  Workload wl = MakeWorkload("flux", {4096, 4096}).value();
  Topology t = Simple(2, 8);
  StepPrediction p = PredictStep(r, wl, t);
  double linear = (65536.0 + 512) * 24.0 * 3072 * 3072 / 16 / 200e12;
  EXPECT_NEAR(p.linear_layer_s, linear, 1e-15);
  EXPECT_NEAR(p.step_s, 57 * (0.01 + linear), 1e-12);
}

}  // namespace
}  // namespace ditscale::sp
