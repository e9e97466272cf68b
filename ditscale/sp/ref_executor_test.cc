// The reference executor and attention_ref: exact math, deadlock reports, and that the executor
// notices schedules whose dependencies are incomplete.
#include "ditscale/sp/ref_executor.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "ditscale/sp/attention_ref.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.5f);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

TEST(AttentionRef, MatchesTextbookSoftmaxWithGqa) {
  const int64_t B = 2, Tq = 5, Tk = 7, H = 6, Hk = 2, d = 4;
  std::vector<float> q = Random(B * Tq * H * d, 1), k = Random(B * Tk * Hk * d, 2),
                     v = Random(B * Tk * Hk * d, 3), o(B * Tq * H * d), l(B * Tq * H);
  const double scale = 0.37;
  AttentionRef(TensorView::Dense(q.data(), B, Tq, H, d), TensorView::Dense(k.data(), B, Tk, Hk, d),
               TensorView::Dense(v.data(), B, Tk, Hk, d), TensorView::Dense(o.data(), B, Tq, H, d),
               TensorView::Dense(l.data(), B, Tq, H, 1), scale);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < Tq; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kh = h / (H / Hk);
        long double z = 0, out[4] = {0, 0, 0, 0};
        for (int64_t j = 0; j < Tk; ++j) {
          long double s = 0;
          for (int64_t w = 0; w < d; ++w) {
            s += (long double)q[((b * Tq + t) * H + h) * d + w] *
                 k[((b * Tk + j) * Hk + kh) * d + w];
          }
          const long double p = std::exp(s * scale);
          z += p;
          for (int64_t w = 0; w < d; ++w) out[w] += p * v[((b * Tk + j) * Hk + kh) * d + w];
        }
        EXPECT_NEAR(l[(b * Tq + t) * H + h], (double)std::log(z), 1e-5);
        for (int64_t w = 0; w < d; ++w) {
          EXPECT_NEAR(o[((b * Tq + t) * H + h) * d + w], (double)(out[w] / z), 1e-5);
        }
      }
    }
  }
}

TEST(AttentionRef, MergeOfBlocksEqualsWhole) {
  const int64_t B = 1, Tq = 3, Tk = 11, H = 2, d = 8;
  std::vector<float> q = Random(B * Tq * H * d, 4), k = Random(B * Tk * H * d, 5),
                     v = Random(B * Tk * H * d, 6);
  auto view = [&](std::vector<float>& x, int64_t t, int64_t w) {
    return TensorView::Dense(x.data(), B, t, H, w);
  };
  std::vector<float> whole(B * Tq * H * d), whole_lse(B * Tq * H);
  AttentionRef(view(q, Tq, d), view(k, Tk, d), view(v, Tk, d), view(whole, Tq, d),
               view(whole_lse, Tq, 1), 0.5);
  // Blocks [7, 11), [0, 3), [3, 7) and an empty one, merged into an empty accumulator.
  std::vector<float> acc(whole.size(), 123.f),
      acc_lse(whole_lse.size(), -std::numeric_limits<float>::infinity());
  for (auto [a, e] : {std::pair<int64_t, int64_t>{7, 11}, {0, 3}, {5, 5}, {3, 7}}) {
    std::vector<float> part(whole.size()), part_lse(whole_lse.size());
    AttentionRef(view(q, Tq, d), view(k, Tk, d).Sub(a, e - a, 0, H),
                 view(v, Tk, d).Sub(a, e - a, 0, H), view(part, Tq, d), view(part_lse, Tq, 1), 0.5);
    MergeRef(view(part, Tq, d), view(part_lse, Tq, 1), view(acc, Tq, d), view(acc_lse, Tq, 1));
  }
  for (size_t i = 0; i < whole.size(); ++i) EXPECT_NEAR(acc[i], whole[i], 1e-6);
  for (size_t i = 0; i < whole_lse.size(); ++i) EXPECT_NEAR(acc_lse[i], whole_lse[i], 1e-6);
}

Schedule Build(SpMesh mesh, Strategy strategy, AttentionShape shape, bool one_sided,
               int chunks = 1) {
  SpConfig c;
  c.strategy = strategy;
  c.one_sided = one_sided;
  c.torus_chunks = chunks;
  return BuildSchedule(mesh, c, shape).ValueOrThrow();
}

AttentionShape Shape(int64_t seq, int64_t text, int64_t heads) {
  AttentionShape a;
  a.batch = 2;
  a.seq_tokens = seq;
  a.text_tokens = text;
  a.heads = heads;
  a.head_dim = 8;
  return a;
}

TEST(RefExecutor, ShuffledRunsAgreeExactly) {
  const Schedule s = Build({2, 2}, Strategy::kTorus, Shape(48, 8, 4), true, 3);
  const DenseInputs in = RandomInputs(s.shape, 9);
  std::vector<float> first;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    ExecutorOptions opt;
    opt.seed = seed;
    Result<std::vector<RankOutput>> out = ExecuteSchedule(s, in, opt);
    ASSERT_TRUE(out.ok()) << out.failure().ToString();
    if (seed == 1) first = (*out)[2].out;
    EXPECT_EQ((*out)[2].out, first);  // same ops on the same data: bitwise equal
  }
}

// Dropping the cross-stream deps of compute ops lets an attention run before its data arrived:
// the shuffled executor must notice (NaN from undefined buffers, or a wrong result).
TEST(RefExecutor, MissingDependenciesAreNoticed) {
  for (bool one_sided : {false, true}) {
    Schedule s = Build({1, 4}, Strategy::kRing, Shape(32, 0, 2), one_sided);
    for (RankProgram& p : s.ranks) {
      for (Op& op : p.ops) {
        if (op.stream == Stream::kCompute && op.kind != OpKind::kSignal) op.deps.clear();
      }
    }
    ASSERT_TRUE(ValidateSchedule(s).ok());  // structurally fine, semantically racy
    const DenseInputs in = RandomInputs(s.shape, 3);
    const std::vector<float> dense = DenseAttention(in);
    int wrong = 0;
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      ExecutorOptions opt;
      opt.seed = seed;
      Result<std::vector<RankOutput>> out = ExecuteSchedule(s, in, opt);
      if (!out.ok() || CompareWithDense(s, dense, *out).max_rel_error > 1e-3) ++wrong;
    }
    EXPECT_GT(wrong, 0) << (one_sided ? "one-sided" : "two-sided");
  }
}

TEST(RefExecutor, DeadlockIsReportedNotHung) {
  Schedule s = Build({1, 2}, Strategy::kRing, Shape(16, 0, 2), false);
  // Ungroup the ring transfers and put each rank's Recvs before its Sends on the same stream:
  // every rank then waits on a Recv whose matching Send is queued behind the peer's Recv.
  for (RankProgram& p : s.ranks) {
    for (Op& op : p.ops) op.group = -1;
    std::vector<Op>& ops = p.ops;
    for (size_t i = 0; i + 1 < ops.size(); ++i) {
      if (ops[i].kind == OpKind::kSend && ops[i + 1].kind == OpKind::kSend) {
        // order: Send k, Send v, Recv k, Recv v -> Recv k, Recv v, Send k, Send v
        std::swap(ops[i], ops[i + 2]);
        std::swap(ops[i + 1], ops[i + 3]);
        break;
      }
    }
  }
  EXPECT_FALSE(ValidateSchedule(s).ok());
  ExecutorOptions opt;
  opt.validate = false;
  opt.timeout_s = 20;
  const auto t0 = std::chrono::steady_clock::now();
  Result<std::vector<RankOutput>> out = ExecuteSchedule(s, RandomInputs(s.shape, 1), opt);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.failure().message.find("deadlock"), std::string::npos) << out.failure().message;
  EXPECT_NE(out.failure().message.find("Recv 'recv ring.s0 k"), std::string::npos)
      << out.failure().message;
  EXPECT_LT(secs, 5.0);  // detected, not timed out
}

TEST(RefExecutor, InvalidScheduleIsRefused) {
  Schedule s = Build({1, 2}, Strategy::kUlysses, Shape(16, 0, 2), false);
  s.ranks[0].ops[0].src.tokens = 999;
  Result<std::vector<RankOutput>> out = ExecuteSchedule(s, RandomInputs(s.shape, 1));
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.failure().message.find("invalid schedule"), std::string::npos);
}

TEST(RefExecutor, CompareFlagsWrongAndNanOutputs) {
  const Schedule s = Build({1, 2}, Strategy::kUlysses, Shape(16, 4, 2), false);
  const DenseInputs in = RandomInputs(s.shape, 2);
  const std::vector<float> dense = DenseAttention(in);
  std::vector<RankOutput> out = ExecuteSchedule(s, in).ValueOrThrow();
  EXPECT_LT(CompareWithDense(s, dense, out).max_rel_error, 1e-6);
  out[1].out[5] += 0.25f;
  EXPECT_NEAR(CompareWithDense(s, dense, out).max_abs_error, 0.25, 1e-6);
  out[1].text_out[3] = std::nanf("");
  const Comparison c = CompareWithDense(s, dense, out);
  EXPECT_TRUE(std::isinf(c.max_abs_error));
  EXPECT_TRUE(std::isinf(c.text_replica_diff));
}

}  // namespace
}  // namespace ditscale::sp
