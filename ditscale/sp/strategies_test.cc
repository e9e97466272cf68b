// Every strategy, run by the reference executor, equals dense attention (joint text, uneven
// heads, uneven shards, several meshes and chunk counts, both transports).
#include "ditscale/sp/strategies.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "ditscale/sp/ref_executor.h"

namespace ditscale::sp {
namespace {

struct Case {
  SpMesh mesh;
  SpConfig config;
  AttentionShape shape;
};

std::string Describe(const Case& c) {
  std::ostringstream os;
  os << c.config.strategy << " mesh " << c.mesh.machines << "x" << c.mesh.gpus_per_machine
     << " U=" << c.config.ulysses_degree << " R=" << c.config.ring_degree
     << " chunks=" << c.config.torus_chunks << " ulysses_chunks=" << c.config.ulysses_chunks << " "
     << TransportDescription(c.config) << " b=" << c.shape.batch << " S=" << c.shape.seq_tokens
     << " T=" << c.shape.text_tokens << " H=" << c.shape.heads
     << " Hkv=" << c.shape.kv_heads_or_heads();
  return os.str();
}

// Builds, validates, executes and compares; returns the relative error.
double RunCase(const Case& c, uint64_t seed) {
  SCOPED_TRACE(Describe(c));
  Result<Schedule> s = BuildSchedule(c.mesh, c.config, c.shape);
  EXPECT_TRUE(s.ok()) << (s.ok() ? "" : s.failure().ToString());
  if (!s.ok()) return 1e9;
  const ValidationReport rep = ValidateSchedule(*s);
  EXPECT_TRUE(rep.ok()) << rep.ToString();
  const DenseInputs in = RandomInputs(c.shape, seed);
  ExecutorOptions opt;
  opt.seed = seed;
  opt.validate = false;
  Result<std::vector<RankOutput>> out = ExecuteSchedule(*s, in, opt);
  EXPECT_TRUE(out.ok()) << (out.ok() ? "" : out.failure().ToString());
  if (!out.ok()) return 1e9;
  const Comparison cmp = CompareWithDense(*s, DenseAttention(in), *out);
  EXPECT_LT(cmp.max_rel_error, 1e-5) << cmp.ToString();
  EXPECT_EQ(cmp.text_replica_diff, 0.0) << cmp.ToString();
  return cmp.max_rel_error;
}

AttentionShape Shape(int64_t seq, int64_t text, int64_t heads, int64_t kv_heads = 0) {
  AttentionShape a;
  a.batch = 2;
  a.seq_tokens = seq;
  a.text_tokens = text;
  a.heads = heads;
  a.kv_heads = kv_heads;
  a.head_dim = 8;
  a.dtype_bytes = 2;
  return a;
}

const SpMesh kMeshes[] = {{1, 2}, {2, 2}, {2, 4}};

void SweepStrategy(Strategy strategy, const std::vector<int>& chunk_counts) {
  uint64_t seed = std::hash<std::string_view>{}(StrategyName(strategy)) % 1000;
  for (const SpMesh& mesh : kMeshes) {
    for (int chunks : chunk_counts) {
      for (bool one_sided : {false, true}) {
        for (int64_t text : {0, 8}) {
          for (int64_t heads : {6, 10}) {
            // Alternate divisible and uneven sequence lengths.
            const int64_t seq = (heads + text) % 4 == 2 ? 48 : 53;
            Case c{mesh, SpConfig{}, Shape(seq, text, heads)};
            c.config.strategy = strategy;
            c.config.one_sided = one_sided;
            c.config.torus_chunks = chunks;
            Result<SpConfig> rc = ResolveConfig(mesh, c.config, c.shape);
            if (!rc.ok()) {  // only infeasible: more Ulysses ranks than heads
              EXPECT_EQ(rc.failure().column, "ulysses_degree") << Describe(c);
              EXPECT_GT(mesh.ranks(), heads);
              continue;
            }
            c.config = *rc;
            RunCase(c, ++seed);
          }
        }
      }
    }
  }
}

TEST(Strategies, UlyssesMatchesDense) { SweepStrategy(Strategy::kUlysses, {1}); }
TEST(Strategies, RingMatchesDense) { SweepStrategy(Strategy::kRing, {1}); }
TEST(Strategies, UspMatchesDense) { SweepStrategy(Strategy::kUsp, {1}); }
TEST(Strategies, TasMatchesDense) { SweepStrategy(Strategy::kSwiftFusionTas, {1}); }
TEST(Strategies, TorusMatchesDense) { SweepStrategy(Strategy::kTorus, {1, 2, 3, 4}); }

TEST(Strategies, UlyssesOverlapMatchesDense) { SweepStrategy(Strategy::kUlyssesOverlap, {1}); }

// The three calls of ulysses-overlap on every rank: local rows x local kv before the first wait,
// the rest x all kv, then local rows x remote kv (the one merge), the out back leaving before
// that last call; the first call's rows are whole waves. Waves of 4 CTAs x 3 rows make the
// alignment bite at test sizes (6 or 3 heads per rank -> 6 or 12 rows per whole wave, batch 2).
TEST(Strategies, UlyssesOverlapCutsOnWholeWaves) {
  uint64_t seed = 900;
  for (const SpMesh& mesh : kMeshes) {
    for (bool one_sided : {false, true}) {
      for (int64_t text : {0, 8}) {
        for (const auto& [heads, kv] : {std::pair<int64_t, int64_t>{12, 0}, {10, 0}, {12, 6}}) {
          Case c{mesh, SpConfig{}, Shape(heads == 10 ? 101 : 96, text, heads, kv)};
          c.config.strategy = Strategy::kUlyssesOverlap;
          c.config.one_sided = one_sided;
          c.config.attention_slots = 4;
          c.config.attention_tile_tokens = 3;
          Result<SpConfig> rc = ResolveConfig(mesh, c.config, c.shape);
          if (!rc.ok()) {  // more Ulysses ranks than kv heads
            EXPECT_EQ(rc.failure().column, "ulysses_degree") << Describe(c);
            continue;
          }
          c.config = *rc;
          RunCase(c, ++seed);
          const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
          for (const RankProgram& p : s.ranks) {
            SCOPED_TRACE(Describe(c) + " rank " + std::to_string(p.rank));
            std::vector<int> calls;
            int merges = 0, first_wait = -1, back = -1;
            for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
              const Op& op = p.ops[i];
              if (op.kind == OpKind::kAttention) calls.push_back(i);
              merges += op.kind == OpKind::kMerge;
              const bool in = op.label.find("a2a.in") != std::string::npos;
              if ((op.kind == OpKind::kWait || op.kind == OpKind::kRecv) && in && first_wait < 0) {
                first_wait = i;
              }
              if ((op.kind == OpKind::kSend || op.kind == OpKind::kPut) &&
                  op.label.find("a2a.out") != std::string::npos && back < 0) {
                back = i;
              }
            }
            ASSERT_EQ(calls.size(), 3u);
            EXPECT_EQ(merges, 1);
            const Op& c1 = p.ops[calls[0]];
            const Op& c2 = p.ops[calls[1]];
            const Op& c3 = p.ops[calls[2]];
            // Call 1 needs nothing remote: it comes before any wait for the all-to-all in (a
            // Recv's group sits on the link stream; its consumer depends on it instead).
            if (one_sided) EXPECT_LT(calls[0], first_wait);
            const int64_t hq = c1.src.heads, wave = 3 * (4 / std::gcd<int64_t>(4, 2 * hq));
            const int64_t local = (text > 0 ? text : 0) + p.image_token_count;
            const int64_t whole = local / wave * wave;
            EXPECT_EQ(c1.src.tokens, whole > 0 ? whole : local) << "wave " << wave;
            EXPECT_EQ(c1.key.tokens, (text > 0 ? text : 0) + p.image_token_count);
            EXPECT_EQ(c2.src.token_begin, c1.src.tokens);
            EXPECT_EQ(c3.src.tokens, c1.src.tokens);
            EXPECT_EQ(c1.key.tokens + c3.key.tokens, c2.key.tokens);
            EXPECT_LT(back, calls[2]);
            EXPECT_GT(back, calls[1]);
            // One-sided: the q, k, v packs (the all-to-all's only SM work) come first on their
            // stream, before any signal or wait, and the first call waits for them (an attention
            // call holds every SM until it ends). Two-sided: the call does not wait for them.
            std::vector<int> packs;
            for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
              if (p.ops[i].kind == OpKind::kPack &&
                  p.ops[i].label.find("a2a.in") != std::string::npos) {
                packs.push_back(i);
              }
            }
            for (int k : packs) {
              const bool waits = std::count(c1.deps.begin(), c1.deps.end(), k) > 0;
              EXPECT_EQ(waits, one_sided) << p.ops[k].label;
              if (!one_sided) continue;
              for (int i = 0; i < k; ++i) {
                if (p.ops[i].stream != p.ops[k].stream) continue;
                EXPECT_NE(p.ops[i].kind, OpKind::kWait) << p.ops[i].label;
                EXPECT_NE(p.ops[i].kind, OpKind::kSignal) << p.ops[i].label;
              }
            }
          }
        }
      }
    }
  }
  // Same bytes and FLOPs as plain Ulysses.
  Case plain{SpMesh{1, 4}, SpConfig{}, Shape(96, 8, 12)};
  plain.config.strategy = Strategy::kUlysses;
  Case overlap = plain;
  overlap.config.strategy = Strategy::kUlyssesOverlap;
  const std::vector<RankCommVolume> va =
      CommVolumePerRank(BuildSchedule(plain.mesh, plain.config, plain.shape).ValueOrThrow());
  const std::vector<RankCommVolume> vb =
      CommVolumePerRank(BuildSchedule(overlap.mesh, overlap.config, overlap.shape).ValueOrThrow());
  ASSERT_EQ(va.size(), vb.size());
  for (size_t r = 0; r < va.size(); ++r) {
    EXPECT_EQ(va[r].sent_bytes(), vb[r].sent_bytes()) << "rank " << r;
    EXPECT_EQ(va[r].recv_bytes(), vb[r].recv_bytes()) << "rank " << r;
    EXPECT_DOUBLE_EQ(va[r].attention_flops, vb[r].attention_flops) << "rank " << r;
  }
  // Flux at 4096^2 on 2 H200s (132 SMs, 128-row tiles, 12 heads per rank: 1408 rows per wave):
  // 512 text + 32,768 own rows -> call 1 on 23 waves (32,384 rows), call 2 the other 33,664.
  AttentionShape flux;
  flux.seq_tokens = 65536;
  flux.text_tokens = 512;
  flux.heads = 24;
  flux.head_dim = 128;
  SpConfig fc;
  fc.strategy = Strategy::kUlyssesOverlap;
  fc.attention_slots = 132;
  const Schedule fs = BuildSchedule(SpMesh{1, 2}, fc, flux).ValueOrThrow();
  for (const RankProgram& p : fs.ranks) {
    std::vector<int64_t> rows;
    for (const Op& op : p.ops) {
      if (op.kind == OpKind::kAttention) rows.push_back(op.src.tokens);
    }
    EXPECT_EQ(rows, (std::vector<int64_t>{32384, 33664, 32384})) << "rank " << p.rank;
  }
}

// Head-chunked Ulysses: every mesh, 2-3 head chunks (uneven chunks and groups: 10 heads on 4
// ranks -> groups 3, 3, 2, 2 -> chunks of 2 + 1 and 1 + 1), GQA, joint text, both transports;
// more chunks than the smallest group's kv heads is refused, naming ulysses_chunks.
TEST(Strategies, UlyssesHeadChunksMatchDense) {
  uint64_t seed = 700;
  for (const SpMesh& mesh : kMeshes) {
    for (int chunks : {2, 3}) {
      for (bool one_sided : {false, true}) {
        for (int64_t text : {0, 8}) {
          for (const auto& [heads, kv] : {std::pair<int64_t, int64_t>{12, 0}, {10, 0}, {12, 6}}) {
            Case c{mesh, SpConfig{}, Shape(heads == 10 ? 53 : 48, text, heads, kv)};
            c.config.strategy = Strategy::kUlysses;
            c.config.one_sided = one_sided;
            c.config.ulysses_chunks = chunks;
            Result<SpConfig> rc = ResolveConfig(mesh, c.config, c.shape);
            if (!rc.ok()) {  // infeasible: more ranks than kv heads, or chunks than kv heads
              const int64_t kvh = c.shape.kv_heads_or_heads();
              if (rc.failure().column == "ulysses_degree") {
                EXPECT_GT(mesh.ranks(), kvh) << Describe(c);
              } else {
                EXPECT_EQ(rc.failure().column, "ulysses_chunks") << Describe(c);
                EXPECT_GT(chunks, kvh / mesh.ranks()) << Describe(c);
              }
              continue;
            }
            c.config = *rc;
            RunCase(c, ++seed);
            // C attention calls per rank, no merge, and the first chunk's out leaves before the
            // last chunk's attention (the pipeline), the last chunk's q/k/v arrive after the
            // first attention was issued.
            const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
            const std::vector<Op>& ops = s.ranks[0].ops;
            int attentions = 0, merges = 0, first_back = -1, last_attention = -1;
            for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
              attentions += ops[i].kind == OpKind::kAttention;
              merges += ops[i].kind == OpKind::kMerge;
              const bool back = (ops[i].kind == OpKind::kSend || ops[i].kind == OpKind::kPut) &&
                                ops[i].label.find("a2a.out") != std::string::npos;
              if (back && first_back < 0) first_back = i;
              if (ops[i].kind == OpKind::kAttention) last_attention = i;
            }
            EXPECT_EQ(attentions, chunks) << Describe(c);
            EXPECT_EQ(merges, 0) << Describe(c);
            EXPECT_GE(first_back, 0) << Describe(c);
            EXPECT_LT(first_back, last_attention) << Describe(c);
          }
        }
      }
    }
  }
  // Two-sided and one-sided volumes equal plain Ulysses (same bytes, only cut by heads).
  Case plain{SpMesh{1, 4}, SpConfig{}, Shape(48, 8, 12)};
  plain.config.strategy = Strategy::kUlysses;
  Case chunked = plain;
  chunked.config.ulysses_chunks = 3;
  const Schedule a = BuildSchedule(plain.mesh, plain.config, plain.shape).ValueOrThrow();
  const Schedule b = BuildSchedule(chunked.mesh, chunked.config, chunked.shape).ValueOrThrow();
  const std::vector<RankCommVolume> va = CommVolumePerRank(a), vb = CommVolumePerRank(b);
  ASSERT_EQ(va.size(), vb.size());
  for (size_t r = 0; r < va.size(); ++r) {
    EXPECT_EQ(va[r].sent_bytes(), vb[r].sent_bytes()) << "rank " << r;
    EXPECT_EQ(va[r].recv_bytes(), vb[r].recv_bytes()) << "rank " << r;
    EXPECT_DOUBLE_EQ(va[r].attention_flops, vb[r].attention_flops) << "rank " << r;
  }
}

TEST(Strategies, HybridDegreesAndPlacements) {
  uint64_t seed = 77;
  const SpMesh mesh{2, 4};
  for (Strategy strategy : {Strategy::kUsp, Strategy::kSwiftFusionTas, Strategy::kTorus}) {
    for (auto [u, r] : {std::pair{2, 4}, {4, 2}, {8, 1}, {1, 8}}) {
      for (Placement p : {Placement::kUlyssesInner, Placement::kUlyssesOuter}) {
        // Transports: two-sided, one-sided, one-sided within machines / two-sided between them.
        for (auto [one_sided, inter] : {std::pair{false, true}, {true, true}, {true, false}}) {
          Case c{mesh, SpConfig{}, Shape(61, 8, 8)};
          c.config.strategy = strategy;
          c.config.ulysses_degree = u;
          c.config.ring_degree = r;
          c.config.placement = p;
          c.config.one_sided = one_sided;
          c.config.one_sided_inter = inter;
          c.config.torus_chunks = strategy == Strategy::kTorus ? 3 : 1;
          RunCase(c, ++seed);
        }
      }
    }
  }
}

TEST(Strategies, TorusAcrossMachinesOnlyPipelinesBothAllToAlls) {
  uint64_t seed = 500;
  for (int chunks : {1, 2, 3, 4}) {
    for (bool one_sided : {false, true}) {
      for (int64_t text : {0, 5}) {
        Case c{SpMesh{4, 1}, SpConfig{}, Shape(70, text, 6)};  // U = 4, R = 1, heads 2,2,1,1
        c.config.strategy = Strategy::kTorus;
        c.config.torus_chunks = chunks;
        c.config.one_sided = one_sided;
        RunCase(c, ++seed);
        // Some out goes back before the last attention of the rank (chunked out all-to-all).
        const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
        const std::vector<Op>& ops = s.ranks[1].ops;
        int first_back = -1, last_attention = -1;
        for (int i = 0; i < static_cast<int>(ops.size()); ++i) {
          const bool back = (ops[i].kind == OpKind::kSend || ops[i].kind == OpKind::kPut) &&
                            ops[i].label.find("a2a.out") != std::string::npos;
          if (back && first_back < 0) first_back = i;
          if (ops[i].kind == OpKind::kAttention) last_attention = i;
        }
        ASSERT_GE(first_back, 0);
        if (chunks > 1) EXPECT_LT(first_back, last_attention) << "chunks " << chunks;
      }
    }
  }
}

// Torus with a ring inside the machine: every kv piece (stationary + each chunk) circulates the
// ring on its own, no ring buffer is reused (no flow control), and query chunks' outs go back
// before the rank's last attention.
TEST(Strategies, TorusForwardsRingPiecesAndSendsOutEarly) {
  uint64_t seed = 900;
  for (int chunks : {2, 3, 4}) {
    for (bool one_sided : {false, true}) {
      for (int64_t text : {0, 5}) {
        Case c{SpMesh{2, 4}, SpConfig{}, Shape(96, text, 6)};  // U = 2 across, R = 4 within
        c.config.strategy = Strategy::kTorus;
        c.config.torus_chunks = chunks;
        c.config.one_sided = one_sided;
        RunCase(c, ++seed);
        const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
        for (const RankProgram& p : s.ranks) {
          std::set<std::string> ring_phases;
          int first_back = -1, last_attention = -1;
          for (int i = 0; i < static_cast<int>(p.ops.size()); ++i) {
            const Op& op = p.ops[i];
            const bool xfer = op.kind == OpKind::kSend || op.kind == OpKind::kPut;
            if (xfer && op.label.rfind("put ring.p", 0) == 0) {
              ring_phases.insert(op.label.substr(4, op.label.find(".s") - 4));
            }
            if (xfer && op.label.rfind("send ring.p", 0) == 0) {
              ring_phases.insert(op.label.substr(5, op.label.find(".s") - 5));
            }
            if (xfer && op.label.find("a2a.out") != std::string::npos && first_back < 0) {
              first_back = i;
            }
            if (op.kind == OpKind::kAttention) last_attention = i;
            EXPECT_NE(op.counter, "ring.free") << op.label;
          }
          // 96 tokens / 8 ranks = 12 per shard: every chunk piece holds data.
          EXPECT_EQ(ring_phases.size(), static_cast<size_t>(chunks + 1)) << Describe(c);
          ASSERT_GE(first_back, 0);
          EXPECT_LT(first_back, last_attention) << Describe(c);
        }
      }
    }
  }
}

TEST(Strategies, CogVideoXHeadsOnFourMachines) {  // 30 heads on 4 Ulysses ranks: 8, 8, 7, 7
  const SpMesh mesh{4, 2};
  for (Strategy strategy : {Strategy::kSwiftFusionTas, Strategy::kTorus, Strategy::kUlysses}) {
    if (strategy == Strategy::kUlysses) continue;  // U = 8 here: covered below with a 4x1 mesh
    Case c{mesh, SpConfig{}, Shape(64, 8, 30)};
    c.shape.batch = 1;
    c.config.strategy = strategy;
    c.config.torus_chunks = strategy == Strategy::kTorus ? 2 : 1;
    c.config.one_sided = true;
    Result<Schedule> s = BuildSchedule(c.mesh, c.config, c.shape);
    ASSERT_TRUE(s.ok()) << s.failure().ToString();
    EXPECT_EQ(s->head_group_size, (std::vector<int64_t>{8, 8, 7, 7}));
    EXPECT_EQ(s->head_group_begin, (std::vector<int64_t>{0, 8, 16, 23}));
    RunCase(c, 5);
  }
  Case c{SpMesh{4, 1}, SpConfig{}, Shape(40, 4, 30)};
  c.config.strategy = Strategy::kUlysses;
  RunCase(c, 6);
}

TEST(Strategies, GroupedQueryAttention) {
  uint64_t seed = 300;
  for (Strategy strategy : kAllStrategies) {
    Case c{SpMesh{2, 2}, SpConfig{}, Shape(50, 8, 12, 4)};  // 3 query heads per kv head
    c.config.strategy = strategy;
    c.config.torus_chunks = strategy == Strategy::kTorus ? 2 : 1;
    for (bool one_sided : {false, true}) {
      c.config.one_sided = one_sided;
      RunCase(c, ++seed);
    }
  }
}

TEST(Strategies, TextTokensLargerThanShardsAndFewerThanRing) {
  for (int64_t text : {1, 3, 40}) {
    Case c{SpMesh{2, 4}, SpConfig{}, Shape(16, text, 4)};
    c.config.strategy = Strategy::kRing;  // R = 8: some ranks compute no text query row when T < 8
    RunCase(c, 10 + text);
    c.config.strategy = Strategy::kTorus;
    c.config.torus_chunks = 4;  // 2 tokens per shard, 4 chunks: empty chunks
    c.config.one_sided = true;
    RunCase(c, 20 + text);
  }
}

// Joint text: the rank's text rows share the gathered buffers (U == 1: the "ring.*" work
// buffers), so step 0 is ONE attention over [text; image] queries x [image; text] keys and every
// later ring step one attention + one merge; the text inputs are read only by copies (never by
// an attention). With U == 1 the caller's q, k, v are only read, by the copies into ring.q/k/v
// (so the runtime may bind them), and out is written once, by the copy of acc's image rows.
// Covers uneven head groups, GQA, text split unevenly over the ring (T < R: ranks without text
// rows), batch 2 and the three transports (one-sided within machines only where there are two).
TEST(Strategies, JointTextIsOneAttentionPerKvBlock) {
  uint64_t seed = 6000;
  struct Hybrid {
    Strategy strategy;
    SpMesh mesh;
    int ulysses_degree = 0;  // 0 = the strategy's default
  };
  const Hybrid hybrids[] = {{Strategy::kUlysses, {1, 4}},
                            {Strategy::kUsp, {2, 2}},
                            {Strategy::kUsp, {2, 4}},
                            {Strategy::kSwiftFusionTas, {2, 4}},
                            {Strategy::kSwiftFusionTas, {4, 2}},
                            {Strategy::kTorus, {2, 4}},
                            // U == 1: the pure ring.
                            {Strategy::kRing, {1, 2}},
                            {Strategy::kRing, {1, 4}},
                            {Strategy::kRing, {4, 1}},
                            {Strategy::kRing, {2, 2}},
                            {Strategy::kSwiftFusionTas, {1, 4}},
                            {Strategy::kUsp, {2, 2}, 1},
                            {Strategy::kTorus, {2, 2}, 1}};
  for (const Hybrid& h : hybrids) {
    for (auto [one_sided, inter] : {std::pair{false, true}, {true, true}, {true, false}}) {
      if (!inter && h.mesh.machines == 1) continue;  // same as fully one-sided
      for (int64_t text : {3, 8}) {
        for (auto [heads, kv_heads] : {std::pair<int64_t, int64_t>{6, 0}, {12, 4}}) {
          Case c{h.mesh, SpConfig{}, Shape(53, text, heads, kv_heads)};
          c.config.strategy = h.strategy;
          c.config.ulysses_degree = h.ulysses_degree;
          c.config.one_sided = one_sided;
          c.config.one_sided_inter = inter;
          c.config.torus_chunks = h.strategy == Strategy::kTorus ? 2 : 1;
          c.config = ResolveConfig(c.mesh, c.config, c.shape).ValueOrThrow();
          const bool pure_ring = c.config.ulysses_degree == 1;
          ASSERT_EQ(pure_ring,
                    h.strategy == Strategy::kRing || h.ulysses_degree == 1 ||
                        (h.mesh.machines == 1 && h.strategy == Strategy::kSwiftFusionTas));
          RunCase(c, ++seed);
          const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
          SCOPED_TRACE(Describe(c));
          for (const RankProgram& p : s.ranks) {
            int attentions = 0, merges = 0, out_writes = 0;
            for (const Op& op : p.ops) {
              if (op.kind == OpKind::kMerge) ++merges;
              if (op.dst.buffer == p.out || op.dst_lse.buffer == p.out) ++out_writes;
              if (pure_ring && op.kind != OpKind::kPut && op.kind != OpKind::kSend &&
                  op.kind != OpKind::kSignal) {
                for (int input : {p.q, p.k, p.v}) EXPECT_NE(op.dst.buffer, input) << op.label;
              }
              if (op.kind != OpKind::kAttention) continue;
              ++attentions;
              for (const Region& r : {op.src, op.key, op.value}) {
                EXPECT_NE(r.buffer, p.text_q) << op.label;
                EXPECT_NE(r.buffer, p.text_k) << op.label;
                EXPECT_NE(r.buffer, p.text_v) << op.label;
                if (pure_ring) {
                  EXPECT_NE(r.buffer, p.q) << op.label;
                  EXPECT_NE(r.buffer, p.k) << op.label;
                  EXPECT_NE(r.buffer, p.v) << op.label;
                }
              }
            }
            if (pure_ring) EXPECT_EQ(out_writes, 1) << "rank " << p.rank;
            if (h.strategy == Strategy::kTorus && !pure_ring) continue;  // pipelined: counts vary
            const int R = c.config.ring_degree;
            EXPECT_EQ(attentions, R) << "rank " << p.rank;
            EXPECT_EQ(merges, R - 1) << "rank " << p.rank;
          }
        }
      }
    }
  }
}

// One-sided within machines, two-sided between them: puts never cross machines, Send / Recv
// never stay inside one, Waits count put arrivals only, the sync rounds and ring flow control
// involve only pairs linked by puts; and the result is still dense attention.
void CheckIntraOnlyTransport(const Schedule& s) {
  bool any_put = false, any_send = false;
  for (const RankProgram& p : s.ranks) {
    for (const Op& op : p.ops) {
      const std::string at = "rank " + std::to_string(p.rank) + " '" + op.label + "'";
      switch (op.kind) {
        case OpKind::kPut:
        case OpKind::kSignal:
          any_put = any_put || op.kind == OpKind::kPut;
          EXPECT_TRUE(s.mesh.same_machine(p.rank, op.peer)) << at;
          EXPECT_EQ(op.link, LinkKind::kIntraMachine) << at;
          EXPECT_EQ(op.counter.find(".inter"), std::string::npos) << at;
          break;
        case OpKind::kSend:
        case OpKind::kRecv:
          any_send = true;
          EXPECT_FALSE(s.mesh.same_machine(p.rank, op.peer)) << at;
          EXPECT_EQ(op.stream, Stream::kCommInter) << at;
          break;
        default:
          break;
      }
    }
  }
  // Every strategy on these meshes moves data both within and between machines.
  EXPECT_TRUE(any_put);
  EXPECT_TRUE(any_send);
  // Each Wait of a phase counter expects exactly the puts signalling it (no Recv counted).
  std::map<std::pair<int, std::string>, int64_t> signalled;
  for (const RankProgram& p : s.ranks) {
    for (const Op& op : p.ops) {
      if ((op.kind == OpKind::kPut || op.kind == OpKind::kSignal) && !op.counter.empty()) {
        signalled[{op.peer, op.counter}] += op.count;
      }
    }
  }
  for (const RankProgram& p : s.ranks) {
    for (const Op& op : p.ops) {
      if (op.kind != OpKind::kWait) continue;
      EXPECT_LE(op.count, (signalled[{p.rank, op.counter}])) << op.label;
    }
  }
}

TEST(Strategies, IntraOneSidedInterTwoSidedMatchesDense) {
  uint64_t seed = 4000;
  for (const SpMesh& mesh : {SpMesh{2, 2}, SpMesh{2, 4}, SpMesh{3, 2}}) {
    for (Strategy strategy : kAllStrategies) {
      const std::vector<int> chunk_counts =
          strategy == Strategy::kTorus ? std::vector<int>{1, 2, 3} : std::vector<int>{1};
      for (int chunks : chunk_counts) {
        for (int64_t text : {0, 8}) {
          Case c{mesh, SpConfig{}, Shape(text ? 53 : 48, text, text ? 10 : 8)};
          c.config.strategy = strategy;
          c.config.torus_chunks = chunks;
          c.config.one_sided = true;
          c.config.one_sided_inter = false;
          RunCase(c, ++seed);
          const Schedule s = BuildSchedule(c.mesh, c.config, c.shape).ValueOrThrow();
          SCOPED_TRACE(Describe(c));
          EXPECT_FALSE(s.config.one_sided_inter);
          CheckIntraOnlyTransport(s);
        }
      }
    }
  }
}

TEST(Strategies, IntraOneSidedOnOneMachineIsPlainOneSided) {
  for (Strategy strategy : kAllStrategies) {
    SpConfig a;
    a.strategy = strategy;
    a.one_sided = true;
    SpConfig b = a;
    b.one_sided_inter = false;
    const Schedule sa = BuildSchedule({1, 4}, a, Shape(48, 8, 4)).ValueOrThrow();
    const Schedule sb = BuildSchedule({1, 4}, b, Shape(48, 8, 4)).ValueOrThrow();
    for (size_t r = 0; r < sa.ranks.size(); ++r) {
      ASSERT_EQ(sa.ranks[r].ops.size(), sb.ranks[r].ops.size()) << strategy;
      for (size_t i = 0; i < sa.ranks[r].ops.size(); ++i) {
        EXPECT_EQ(sa.ranks[r].ops[i].kind, sb.ranks[r].ops[i].kind);
        EXPECT_EQ(sa.ranks[r].ops[i].label, sb.ranks[r].ops[i].label);
      }
    }
  }
}

TEST(Strategies, ResolveConfigNamesTheBadField) {
  const AttentionShape shape = Shape(48, 0, 8);
  auto column = [&](SpMesh mesh, SpConfig cfg, AttentionShape sh) {
    Result<SpConfig> r = ResolveConfig(mesh, cfg, sh);
    return r.ok() ? std::string("ok") : r.failure().column;
  };
  SpConfig cfg;
  cfg.strategy = static_cast<Strategy>(99);  // not a Strategy: names are parsed at the edges
  EXPECT_EQ(column({2, 2}, cfg, shape), "strategy");
  cfg.strategy = Strategy::kUsp;
  cfg.ulysses_degree = 3;
  EXPECT_EQ(column({2, 2}, cfg, shape), "ulysses_degree");
  cfg.ulysses_degree = 0;
  cfg.torus_chunks = 2;
  EXPECT_EQ(column({2, 2}, cfg, shape), "torus_chunks");  // usp has no chunks
  SpConfig heads;
  heads.strategy = Strategy::kUlysses;
  heads.torus_chunks = 2;
  EXPECT_EQ(column({2, 2}, heads, shape), "torus_chunks");  // ulysses cuts heads, not tokens
  heads.torus_chunks = 1;
  heads.ulysses_chunks = 2;
  EXPECT_EQ(column({2, 2}, heads, shape), "ok");  // 8 heads on 4 ranks: 2 per rank, 2 chunks
  heads.ulysses_chunks = 3;
  EXPECT_EQ(column({2, 2}, heads, shape), "ulysses_chunks");
  heads.ulysses_chunks = 0;
  EXPECT_EQ(column({2, 2}, heads, shape), "ulysses_chunks");
  heads.ulysses_chunks = 2;
  EXPECT_EQ(column({1, 1}, heads, shape), "ulysses_chunks");  // one rank: no all-to-all
  SpConfig overlap;
  overlap.strategy = Strategy::kUlyssesOverlap;
  EXPECT_EQ(column({2, 2}, overlap, shape), "ok");
  overlap.torus_chunks = 2;
  EXPECT_EQ(column({2, 2}, overlap, shape), "torus_chunks");  // its cuts are not chunks
  overlap.torus_chunks = 1;
  overlap.ulysses_chunks = 2;
  EXPECT_EQ(column({2, 2}, overlap, shape), "ulysses_chunks");
  overlap.ulysses_chunks = 1;
  overlap.ring_degree = 2;
  EXPECT_EQ(column({2, 2}, overlap, shape), "ring_degree");
  overlap.ring_degree = 0;
  overlap.attention_slots = -1;
  EXPECT_EQ(column({2, 2}, overlap, shape), "attention_slots");
  overlap.attention_slots = 132;
  overlap.attention_tile_tokens = 0;
  EXPECT_EQ(column({2, 2}, overlap, shape), "attention_tile_tokens");
  cfg.strategy = Strategy::kTorus;
  cfg.torus_chunks = 0;
  EXPECT_EQ(column({2, 2}, cfg, shape), "torus_chunks");
  cfg.torus_chunks = 2;
  EXPECT_EQ(column({2, 2}, cfg, shape), "ok");
  cfg.ulysses_chunks = 2;
  EXPECT_EQ(column({2, 2}, cfg, shape), "ulysses_chunks");  // torus cuts tokens, not heads
  cfg.ulysses_chunks = 1;
  AttentionShape bad = shape;
  bad.kv_heads = 3;
  EXPECT_EQ(column({2, 2}, cfg, bad), "kv_heads");
  bad = shape;
  bad.seq_tokens = 3;
  EXPECT_EQ(column({2, 2}, cfg, bad), "seq_tokens");
  EXPECT_EQ(column({0, 2}, cfg, shape), "machines");
  cfg.strategy = Strategy::kRing;
  cfg.ulysses_degree = 2;
  EXPECT_EQ(column({2, 2}, cfg, shape), "ulysses_degree");
  Result<SpConfig> ok = ResolveConfig({2, 4}, SpConfig{Strategy::kUsp}, shape);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->ulysses_degree, 4);  // usp: Ulysses within the machine
  EXPECT_EQ(ok->placement, Placement::kUlyssesInner);
  ok = ResolveConfig({2, 4}, SpConfig{Strategy::kSwiftFusionTas}, shape);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->ulysses_degree, 2);  // tas: Ulysses across machines
  EXPECT_EQ(ok->placement, Placement::kUlyssesOuter);
}

TEST(Strategies, ChunkRefusalsNameTheFieldAndValue) {
  SpConfig ring;
  ring.strategy = Strategy::kRing;
  ring.torus_chunks = 3;
  Result<SpConfig> r = ResolveConfig({1, 4}, ring, Shape(48, 0, 8));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(),
            "column 'torus_chunks': 3 token chunks: only torus cuts its all-to-all into token "
            "chunks, not ring");
  SpConfig torus;
  torus.strategy = Strategy::kTorus;
  torus.ulysses_chunks = 2;
  r = ResolveConfig({2, 2}, torus, Shape(48, 0, 8));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(),
            "column 'ulysses_chunks': 2 head chunks: only ulysses cuts its head group into "
            "chunks, not torus");
  SpConfig heads;
  heads.ulysses_chunks = 3;  // 8 heads on 4 ranks: 2 per rank
  r = ResolveConfig({1, 4}, heads, Shape(48, 0, 8));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(),
            "column 'ulysses_chunks': ulysses in 3 head chunks needs >= 3 kv heads per Ulysses "
            "rank; the smallest group has 2");
}

TEST(Strategies, EvenSplitAndCoords) {
  EXPECT_EQ(EvenSplit(30, 4), (std::vector<int64_t>{8, 8, 7, 7}));
  EXPECT_EQ(EvenSplit(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  SpConfig c{Strategy::kUsp, 4, 2};
  c.placement = Placement::kUlyssesInner;
  for (int r = 0; r < 8; ++r) {
    const RankCoords rc = CoordsOfRank(c, r);
    EXPECT_EQ(RankOfCoords(c, rc.ulysses_index, rc.ring_index), r);
    EXPECT_EQ(rc.ulysses_index, r % 4);
  }
  c.placement = Placement::kUlyssesOuter;
  for (int r = 0; r < 8; ++r) {
    const RankCoords rc = CoordsOfRank(c, r);
    EXPECT_EQ(RankOfCoords(c, rc.ulysses_index, rc.ring_index), r);
    EXPECT_EQ(rc.ring_index, r % 2);
  }
}

}  // namespace
}  // namespace ditscale::sp

namespace ditscale::sp {
namespace {

// ScheduleOpsEstimate is within a factor 2 of the built op count (the builder's guard stops at
// 2 * kMaxScheduleOps), and ResolveConfig refuses a schedule over kMaxScheduleOps unbuilt.
TEST(ScheduleLimits, EstimateTracksTheBuiltOpsAndBoundsTheSchedule) {
  AttentionShape shape;
  shape.seq_tokens = 4096;
  shape.heads = 16;
  shape.head_dim = 64;
  for (int64_t text : {0, 64}) {
    shape.text_tokens = text;
    for (Strategy st : kAllStrategies) {
      for (int m : {1, 2, 4}) {
        for (int g : {2, 4}) {
          for (int c : {1, 2, 4}) {
            for (bool one : {false, true}) {
              SpConfig cfg;
              cfg.strategy = st;
              (st == Strategy::kUlysses ? cfg.ulysses_chunks : cfg.torus_chunks) = c;
              cfg.one_sided = one;
              auto s = BuildSchedule(SpMesh{m, g}, cfg, shape);
              if (!s.ok()) continue;
              int64_t ops = 0;
              for (const RankProgram& p : s->ranks) ops += int64_t(p.ops.size());
              const int64_t est = ScheduleOpsEstimate(s->config, shape);
              EXPECT_LE(ops, 2 * est) << st << " " << m << "x" << g << " chunks " << c;
              EXPECT_LE(est, 2 * ops + 16) << st << " " << m << "x" << g << " chunks " << c;
            }
          }
        }
      }
    }
  }
  shape.text_tokens = 0;
  SpConfig ring;
  ring.strategy = Strategy::kRing;
  auto big = ResolveConfig(SpMesh{32, 8}, ring, shape);  // ~390 k ops: refused, not built
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.failure().column, "schedule");
  EXPECT_NE(big.failure().message.find("exceed the limit of 131072 ops"), std::string::npos)
      << big.failure().message;
  SpConfig chunks;
  chunks.strategy = Strategy::kTorus;
  chunks.torus_chunks = 65;
  auto c = ResolveConfig(SpMesh{2, 2}, chunks, shape);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.failure().ToString(), "column 'torus_chunks': 65 is out of range [1, 64]");
  SpConfig heads;
  heads.strategy = Strategy::kUlysses;
  heads.ulysses_chunks = 65;
  c = ResolveConfig(SpMesh{2, 2}, heads, shape);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.failure().ToString(), "column 'ulysses_chunks': 65 is out of range [1, 64]");
  shape.seq_tokens = int64_t{1} << 30;  // 2^30 tokens x 4 ranks: over kMaxRankTokens
  auto t = ResolveConfig(SpMesh{2, 2}, SpConfig{}, shape);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.failure().column, "seq_tokens");
}

}  // namespace
}  // namespace ditscale::sp
