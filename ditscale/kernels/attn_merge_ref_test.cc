// Tests of the log-sum-exp merge CPU reference (attn_merge_ref) against attention computed
// directly in double: merging the partials of disjoint key blocks must give the softmax over all
// keys; -inf (empty) blocks, in-place aliasing, lse layouts and parameter validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/attn_merge.h"

namespace ditscale::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Problem {
  std::int64_t b, t, h, d, s;   // batch, query tokens, heads, head dim, key tokens
  std::vector<double> q, k, v;  // q [b, t, h, d]; k, v [b, s, h, d]
};

Problem random_problem(std::mt19937_64& rng, std::int64_t b, std::int64_t t, std::int64_t h,
                       std::int64_t d, std::int64_t s, double scale = 1.0) {
  Problem p{b, t, h, d, s, {}, {}, {}};
  std::normal_distribution<double> n(0.0, scale);
  p.q.resize(b * t * h * d);
  p.k.resize(b * s * h * d);
  p.v.resize(b * s * h * d);
  for (double& x : p.q) x = n(rng);
  for (double& x : p.k) x = n(rng);
  for (double& x : p.v) x = n(rng);
  return p;
}

// Attention of every query over keys [k0, k1), in double: out [b, t, h, d] and lse in [b, h, t]
// (bht) or [b, t, h] layout. An empty range gives out = 0 and lse = -inf.
void block_attention(const Problem& p, std::int64_t k0, std::int64_t k1, bool bht,
                     std::vector<double>* out, std::vector<double>* lse) {
  out->assign(p.b * p.t * p.h * p.d, 0.0);
  lse->assign(p.b * p.t * p.h, -kInf);
  const double scale = 1.0 / std::sqrt(static_cast<double>(p.d));
  for (std::int64_t b = 0; b < p.b; ++b) {
    for (std::int64_t t = 0; t < p.t; ++t) {
      for (std::int64_t h = 0; h < p.h; ++h) {
        std::vector<double> s;
        double m = -kInf;
        for (std::int64_t j = k0; j < k1; ++j) {
          double dot = 0;
          for (std::int64_t e = 0; e < p.d; ++e) {
            dot +=
                p.q[((b * p.t + t) * p.h + h) * p.d + e] * p.k[((b * p.s + j) * p.h + h) * p.d + e];
          }
          s.push_back(dot * scale);
          m = std::max(m, dot * scale);
        }
        if (s.empty()) continue;
        double sum = 0;
        double* o = out->data() + ((b * p.t + t) * p.h + h) * p.d;
        for (std::int64_t j = k0; j < k1; ++j) {
          const double w = std::exp(s[j - k0] - m);
          sum += w;
          for (std::int64_t e = 0; e < p.d; ++e)
            o[e] += w * p.v[((b * p.s + j) * p.h + h) * p.d + e];
        }
        for (std::int64_t e = 0; e < p.d; ++e) o[e] /= sum;
        (*lse)[bht ? (b * p.h + h) * p.t + t : (b * p.t + t) * p.h + h] = m + std::log(sum);
      }
    }
  }
}

std::vector<float> to_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(a[i] - b[i]);
    e = std::max(e, std::isnan(d) ? kInf : d);
  }
  return e;
}

// Splits the keys into `k` random (possibly empty) blocks, merges the blocks' partials in one
// K-way merge (fp64 outputs) and compares with the attention over all keys.
void check_kway_equals_full(std::mt19937_64& rng, int k, bool bht) {
  const Problem p = random_problem(rng, 2, 5, 3, 16, 23, 1.5);
  std::vector<std::int64_t> cuts = {0, p.s};
  std::uniform_int_distribution<std::int64_t> cut(0, p.s);
  for (int i = 1; i < k; ++i) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::vector<double>> outs(k), lses(k);
  AttnMergeParams mp;
  mp.batch = p.b, mp.tokens = p.t, mp.heads = p.h, mp.head_dim = p.d;
  mp.dtype = DType::kFloat64;
  mp.num_inputs = k;
  for (int i = 0; i < k; ++i) {
    block_attention(p, cuts[i], cuts[i + 1], bht, &outs[i], &lses[i]);
    mp.in[i] = dense_out_view(outs[i].data(), p.t, p.h, p.d);
    // lse inputs are fp32 by contract: round them (the reference reads floats).
  }
  std::vector<std::vector<float>> lse32(k);
  for (int i = 0; i < k; ++i) {
    lse32[i] = to_float(lses[i]);
    mp.in_lse[i] =
        bht ? lse_view_bht(lse32[i].data(), p.t, p.h) : lse_view_bth(lse32[i].data(), p.t, p.h);
  }
  std::vector<double> out(p.b * p.t * p.h * p.d, std::nan(""));
  std::vector<float> out_lse(p.b * p.t * p.h, std::nanf(""));
  mp.out = dense_out_dst(out.data(), p.t, p.h, p.d);
  mp.out_lse = bht ? lse_dst_bht(out_lse.data(), p.t, p.h) : lse_dst_bth(out_lse.data(), p.t, p.h);
  attn_merge_ref(mp);
  std::vector<double> full, full_lse;
  block_attention(p, 0, p.s, bht, &full, &full_lse);
  // The lse inputs were rounded to fp32 (relative 6e-8): the weights carry that error.
  EXPECT_LT(max_abs_diff(out, full), 1e-6) << "k=" << k;
  for (std::size_t i = 0; i < full_lse.size(); ++i) {
    EXPECT_NEAR(out_lse[i], full_lse[i], 1e-5 * (1 + std::fabs(full_lse[i]))) << i;
  }
}

TEST(AttnMergeRef, TwoHalvesEqualFullSoftmax) {
  std::mt19937_64 rng(11);
  for (bool bht : {true, false}) {
    const Problem p = random_problem(rng, 2, 7, 4, 32, 40, 2.0);
    std::vector<double> o0, l0, o1, l1, full, full_lse;
    block_attention(p, 0, 17, bht, &o0, &l0);
    block_attention(p, 17, 40, bht, &o1, &l1);
    block_attention(p, 0, 40, bht, &full, &full_lse);
    std::vector<float> acc = to_float(o0), part = to_float(o1);
    std::vector<float> acc_lse = to_float(l0), part_lse = to_float(l1);
    auto lv = [&](const std::vector<float>& l) {
      return bht ? lse_view_bht(l.data(), p.t, p.h) : lse_view_bth(l.data(), p.t, p.h);
    };
    const LseDst ad =
        bht ? lse_dst_bht(acc_lse.data(), p.t, p.h) : lse_dst_bth(acc_lse.data(), p.t, p.h);
    attn_merge_ref(attn_merge_pair_params(
        p.b, p.t, p.h, p.d, DType::kFloat32, dense_out_dst(acc.data(), p.t, p.h, p.d), ad,
        dense_out_view(part.data(), p.t, p.h, p.d), lv(part_lse)));
    double err = 0;
    for (std::size_t i = 0; i < full.size(); ++i) err = std::max(err, std::fabs(acc[i] - full[i]));
    EXPECT_LT(err, 2e-6);
    for (std::size_t i = 0; i < full_lse.size(); ++i) {
      EXPECT_NEAR(acc_lse[i], full_lse[i], 1e-5 * (1 + std::fabs(full_lse[i])));
    }
  }
}

TEST(AttnMergeRef, KWayEqualsFullSoftmaxForEveryK) {
  std::mt19937_64 rng(std::random_device{}());
  for (int k = 1; k <= kMaxMergeInputs; ++k) {
    check_kway_equals_full(rng, k, true);
    check_kway_equals_full(rng, k, false);
  }
}

TEST(AttnMergeRef, KWayEqualsRepeatedPairwise) {
  std::mt19937_64 rng(std::random_device{}());
  const std::int64_t b = 2, t = 6, h = 3, d = 8, k = 6;
  std::normal_distribution<double> n(0, 1);
  std::uniform_real_distribution<double> u(-20, 20);
  std::vector<std::vector<double>> outs(k);
  std::vector<std::vector<float>> lses(k);
  for (int i = 0; i < k; ++i) {
    for (std::int64_t e = 0; e < b * t * h * d; ++e) outs[i].push_back(n(rng));
    for (std::int64_t e = 0; e < b * t * h; ++e) lses[i].push_back(static_cast<float>(u(rng)));
  }
  // An empty block in the middle: (b, t, h) = (0, 3, 0) of input 2 (lse [B, H, T] index 3),
  // whose output row (NaN garbage) must not be read.
  lses[2][3] = -std::numeric_limits<float>::infinity();
  for (std::int64_t e = 0; e < d; ++e) outs[2][(3 * h + 0) * d + e] = std::nan("");
  AttnMergeParams kp;
  kp.batch = b, kp.tokens = t, kp.heads = h, kp.head_dim = d, kp.dtype = DType::kFloat64;
  kp.num_inputs = static_cast<int>(k);
  for (int i = 0; i < k; ++i) {
    kp.in[i] = dense_out_view(outs[i].data(), t, h, d);
    kp.in_lse[i] = lse_view_bht(lses[i].data(), t, h);
  }
  std::vector<double> kout(b * t * h * d);
  std::vector<float> klse(b * t * h);
  kp.out = dense_out_dst(kout.data(), t, h, d);
  kp.out_lse = lse_dst_bht(klse.data(), t, h);
  attn_merge_ref(kp);
  // Pairwise, in place into a copy of input 0.
  std::vector<double> acc = outs[0];
  std::vector<float> acc_lse = lses[0];
  for (int i = 1; i < k; ++i) {
    attn_merge_ref(attn_merge_pair_params(
        b, t, h, d, DType::kFloat64, dense_out_dst(acc.data(), t, h, d),
        lse_dst_bht(acc_lse.data(), t, h), dense_out_view(outs[i].data(), t, h, d),
        lse_view_bht(lses[i].data(), t, h)));
  }
  // The pairwise path rounds the intermediate lse to fp32 at each step.
  EXPECT_LT(max_abs_diff(kout, acc), 1e-5);
  for (std::size_t i = 0; i < klse.size(); ++i) EXPECT_NEAR(klse[i], acc_lse[i], 1e-5) << i;
}

TEST(AttnMergeRef, NegInfBlocksAreSkippedWithoutNaN) {
  const std::int64_t d = 4;
  const float ninf = -std::numeric_limits<float>::infinity();
  // Rows: (0) acc empty, part finite; (1) acc finite, part empty; (2) both empty.
  std::vector<float> acc = {NAN, NAN, NAN, NAN, 1, 2, 3, 4, NAN, 7, 7, 7};
  std::vector<float> part = {5, 6, 7, 8, NAN, NAN, NAN, NAN, 9, 9, 9, NAN};
  std::vector<float> acc_lse = {ninf, 0.5f, ninf};
  std::vector<float> part_lse = {2.5f, ninf, ninf};
  attn_merge_ref(attn_merge_pair_params(
      1, 3, 1, d, DType::kFloat32, dense_out_dst(acc.data(), 3, 1, d),
      lse_dst_bth(acc_lse.data(), 3, 1), dense_out_view(part.data(), 3, 1, d),
      lse_view_bth(part_lse.data(), 3, 1)));
  const std::vector<float> want = {5, 6, 7, 8, 1, 2, 3, 4, 0, 0, 0, 0};
  EXPECT_EQ(acc, want);
  EXPECT_EQ(acc_lse[0], 2.5f);
  EXPECT_EQ(acc_lse[1], 0.5f);
  EXPECT_EQ(acc_lse[2], ninf);
}

TEST(AttnMergeRef, LargeLseDoesNotOverflowAndNaNPropagates) {
  std::vector<float> a = {1, 1}, p = {3, 3}, out(2);
  std::vector<float> la = {1000.f}, lp = {1000.f + std::log(3.f)}, lo(1);
  AttnMergeParams mp;
  mp.batch = 1, mp.tokens = 1, mp.heads = 1, mp.head_dim = 2, mp.dtype = DType::kFloat32;
  mp.num_inputs = 2;
  mp.in[0] = dense_out_view(a.data(), 1, 1, 2);
  mp.in[1] = dense_out_view(p.data(), 1, 1, 2);
  mp.in_lse[0] = lse_view_bht(la.data(), 1, 1);
  mp.in_lse[1] = lse_view_bht(lp.data(), 1, 1);
  mp.out = dense_out_dst(out.data(), 1, 1, 2);
  mp.out_lse = lse_dst_bht(lo.data(), 1, 1);
  attn_merge_ref(mp);
  EXPECT_NEAR(out[0], 2.5, 1e-4);  // weights 1/4 and 3/4
  EXPECT_NEAR(lo[0], 1000.0 + std::log(4.0), 1e-3);
  lp[0] = NAN;
  attn_merge_ref(mp);
  EXPECT_TRUE(std::isnan(out[0]) && std::isnan(out[1]) && std::isnan(lo[0]));
}

TEST(AttnMergeRef, StridedHeadSliceInPlace) {
  // acc is heads [1, 3) of a [B, T, 4, D] buffer, part a dense [B, T, 2, D] tensor; the other
  // heads of the buffer must stay untouched.
  std::mt19937_64 rng(5);
  std::normal_distribution<double> n(0, 1);
  const std::int64_t b = 2, t = 3, hb = 4, h = 2, d = 6;
  std::vector<float> buf(b * t * hb * d), part(b * t * h * d), al(b * h * t), pl(b * h * t);
  for (float& x : buf) x = static_cast<float>(n(rng));
  for (float& x : part) x = static_cast<float>(n(rng));
  for (float& x : al) x = static_cast<float>(n(rng));
  for (float& x : pl) x = static_cast<float>(n(rng));
  const std::vector<float> before = buf, al0 = al;
  AttnOutDst acc{buf.data() + 1 * d, t * hb * d, hb * d, d};
  attn_merge_ref(
      attn_merge_pair_params(b, t, h, d, DType::kFloat32, acc, lse_dst_bht(al.data(), t, h),
                             dense_out_view(part.data(), t, h, d), lse_view_bht(pl.data(), t, h)));
  for (std::int64_t bb = 0; bb < b; ++bb) {
    for (std::int64_t tt = 0; tt < t; ++tt) {
      for (std::int64_t hh = 0; hh < hb; ++hh) {
        for (std::int64_t e = 0; e < d; ++e) {
          const std::int64_t i = ((bb * t + tt) * hb + hh) * d + e;
          if (hh == 0 || hh == 3) {
            EXPECT_EQ(buf[i], before[i]);
            continue;
          }
          const std::int64_t li = (bb * h + (hh - 1)) * t + tt;
          const double l0 = al0[li], l1 = pl[li], m = std::max(l0, l1);
          const double w0 = std::exp(l0 - m), w1 = std::exp(l1 - m);
          const double want =
              (w0 * before[i] + w1 * part[((bb * t + tt) * h + hh - 1) * d + e]) / (w0 + w1);
          EXPECT_NEAR(buf[i], want, 1e-6 * (1 + std::fabs(want)));
        }
      }
    }
  }
}

TEST(AttnMergeRef, ValidationNamesTheField) {
  std::vector<float> x(8), l(2);
  AttnMergeParams p;
  p.batch = 1, p.tokens = 2, p.heads = 1, p.head_dim = 4, p.dtype = DType::kFloat32;
  p.num_inputs = 2;
  p.in[0] = dense_out_view(x.data(), 2, 1, 4);
  p.in_lse[0] = lse_view_bht(l.data(), 2, 1);
  p.in_lse[1] = lse_view_bht(l.data(), 2, 1);
  p.out = dense_out_dst(x.data(), 2, 1, 4);
  auto message = [&](bool gpu) {
    try {
      attn_merge_check(p, gpu);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message(false).find("AttnMergeParams.in[1].data: null"), std::string::npos)
      << message(false);
  p.in[1] = dense_out_view(x.data(), 2, 1, 4);
  EXPECT_EQ(message(false), "");
  p.in[1].stride_t = 2;  // aliases out with other strides
  EXPECT_NE(message(false).find("in[1].data aliases out.data"), std::string::npos);
  p.in[1].stride_t = 4;
  p.num_inputs = 9;
  EXPECT_NE(message(false).find("num_inputs"), std::string::npos);
  p.num_inputs = 2;
  p.dtype = DType::kFloat64;
  EXPECT_EQ(message(false), "");
  EXPECT_NE(message(true).find("float64"), std::string::npos);
  p.dtype = DType::kFloat32;
  p.out.stride_t = 0;
  EXPECT_NE(message(false).find("AttnMergeParams.out: a zero stride"), std::string::npos);
  p.out.stride_t = 4;
  p.head_dim = 0;
  EXPECT_NE(message(false).find("head_dim"), std::string::npos);
}

}  // namespace
}  // namespace ditscale::kernels
