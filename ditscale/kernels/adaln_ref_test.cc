// Tests of the AdaLN CPU reference against simple independent formulas, and of its backward
// against central finite differences in fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels {
namespace {

std::vector<double> random_vec(std::mt19937_64& rng, std::size_t n, double lo = -1, double hi = 1) {
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (double& e : v) e = u(rng);
  return v;
}

// ---- dtype conversions ----

TEST(HalfConvert, Bf16RoundTripsEveryFiniteValue) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const auto b = static_cast<std::uint16_t>(bits);
    const float f = bf16_bits_to_float(b);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f))));
      continue;
    }
    ASSERT_EQ(float_to_bf16_bits(f), b) << "bits " << bits;
  }
}

TEST(HalfConvert, Fp16RoundTripsEveryFiniteValue) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f = fp16_bits_to_float(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(fp16_bits_to_float(float_to_fp16_bits(f))));
      continue;
    }
    ASSERT_EQ(float_to_fp16_bits(f), h) << "bits " << bits;
  }
}

TEST(HalfConvert, RoundsToNearestEven) {
  // bf16 has 8 significant bits: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> even (1).
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 0x1p-8f)), 1.0f);
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);
  EXPECT_EQ(bf16_bits_to_float(float_to_bf16_bits(1.0f + 0x1p-8f + 0x1p-20f)), 1.0f + 0x1p-7f);
  // fp16: 11 significant bits.
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
  // Subnormals, underflow ties, overflow.
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(0x1p-24f)), 0x1p-24f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(0x1p-25f)), 0.0f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(0x1.8p-25f)), 0x1p-24f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(3 * 0x1p-25f)), 2 * 0x1p-24f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(65504.0f)), 65504.0f);
  EXPECT_EQ(fp16_bits_to_float(float_to_fp16_bits(65519.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(fp16_bits_to_float(float_to_fp16_bits(65520.0f))));
  EXPECT_TRUE(std::isinf(bf16_bits_to_float(float_to_bf16_bits(3.4e38f))));
}

// ---- forward against independent formulas ----

struct Variant {
  NormType norm = NormType::kLayerNorm;
  bool per_token = false;
  bool affine = false;
  bool gated = false;
};

// fp64 problem: x [B, N, D] (or residual/branch), modulation as chunks of a [B, N, 6D] (per
// token) or [B, 6, D] (per sample) tensor, so strides are non-trivial.
struct Problem {
  std::int64_t B, N, D;
  Variant var;
  std::vector<double> x, residual, branch, mod, weight, bias;
  std::vector<double> y, h;
  std::vector<float> mean, rstd;

  Problem(std::int64_t b, std::int64_t n, std::int64_t d, Variant v, std::mt19937_64& rng)
      : B(b), N(n), D(d), var(v) {
    const auto rows = static_cast<std::size_t>(B * N * D);
    x = random_vec(rng, rows, -2, 3);
    residual = random_vec(rng, rows, -2, 3);
    branch = random_vec(rng, rows);
    mod = random_vec(rng, static_cast<std::size_t>(B * (v.per_token ? N : 1) * 6 * D), -0.5, 0.5);
    weight = random_vec(rng, D, 0.5, 1.5);
    bias = random_vec(rng, D);
    y.assign(rows, NAN);
    h.assign(rows, NAN);
    mean.assign(B * N, NAN);
    rstd.assign(B * N, NAN);
  }
  // Chunk k of the modulation tensor (0 shift, 1 scale, 2 gate).
  RowsView chunk(int k) const {
    RowsView v{mod.data() + k * D, DType::kFloat64, 0, 0};
    if (var.per_token) {
      v.stride_n = 6 * D;
      v.stride_b = N * 6 * D;
    } else {
      v.stride_b = 6 * D;
    }
    return v;
  }
  double mod_at(int k, std::int64_t b, std::int64_t n, std::int64_t d) const {
    const RowsView v = chunk(k);
    return mod[k * D + b * v.stride_b + n * v.stride_n + d];
  }
  void fill_config(AdaLNConfig& c) const {
    c.batch = B;
    c.seq_len = N;
    c.dim = D;
    c.norm = var.norm;
    c.dtype = DType::kFloat64;
    c.affine_dtype = DType::kFloat64;
    c.shift = chunk(0);
    c.scale = chunk(1);
    if (var.gated) c.gate = chunk(2);
    if (var.affine) {
      c.weight = weight.data();
      c.bias = bias.data();
    }
  }
  AdaLNFwdParams fwd() {
    AdaLNFwdParams p;
    fill_config(p);
    const RowsView dense{nullptr, DType::kFloat64, N * D, D};
    if (var.gated) {
      p.residual = dense;
      p.residual.data = residual.data();
      p.branch = dense;
      p.branch.data = branch.data();
      p.h = h.data();
    } else {
      p.x = dense;
      p.x.data = x.data();
    }
    p.y = y.data();
    p.mean = mean.data();
    p.rstd = rstd.data();
    return p;
  }
  // Backward of the plain variant with dense dy -> dx, no gradient outputs set yet.
  AdaLNBwdParams plain_bwd(const std::vector<double>& dy, std::vector<double>& dx) const {
    AdaLNBwdParams p;
    fill_config(p);
    p.x = {x.data(), DType::kFloat64, N * D, D};
    p.dy = {dy.data(), DType::kFloat64, N * D, D};
    p.dx = dx.data();
    return p;
  }
};

TEST(AdaLNRef, ForwardMatchesIndependentFormulas) {
  std::mt19937_64 rng(1234);
  for (NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    for (int mask = 0; mask < 8; ++mask) {
      const Variant v{norm, (mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
      Problem pr(2, 3, 13, v, rng);
      AdaLNFwdParams p = pr.fwd();
      p.eps = 1e-5f;
      adaln_forward_ref(p);
      for (std::int64_t b = 0; b < pr.B; ++b) {
        for (std::int64_t n = 0; n < pr.N; ++n) {
          const std::int64_t row = b * pr.N + n;
          std::vector<double> in(pr.D);
          for (std::int64_t d = 0; d < pr.D; ++d) {
            const std::size_t i = row * pr.D + d;
            in[d] = v.gated ? pr.residual[i] + pr.mod_at(2, b, n, d) * pr.branch[i] : pr.x[i];
            if (v.gated) ASSERT_DOUBLE_EQ(pr.h[i], in[d]);
          }
          // E[x], E[x^2] - E[x]^2: a formula independent of the reference's two-pass one.
          double s = 0, s2 = 0;
          for (double e : in) {
            s += e;
            s2 += e * e;
          }
          const double mean = norm == NormType::kLayerNorm ? s / pr.D : 0.0;
          const double var = s2 / pr.D - mean * mean;
          const double rstd = 1.0 / std::sqrt(var + 1e-5);
          EXPECT_NEAR(pr.mean[row], mean, 1e-6);
          EXPECT_NEAR(pr.rstd[row], rstd, 1e-6 * rstd);
          for (std::int64_t d = 0; d < pr.D; ++d) {
            double xn = (in[d] - mean) * rstd;
            if (v.affine) xn = xn * pr.weight[d] + pr.bias[d];
            const double want = xn * (1 + pr.mod_at(1, b, n, d)) + pr.mod_at(0, b, n, d);
            ASSERT_NEAR(pr.y[row * pr.D + d], want, 1e-12) << "mask " << mask << " d " << d;
          }
        }
      }
    }
  }
}

TEST(AdaLNRef, Bf16InputsRoundOnceAndFp32ModulationIsRead) {
  std::mt19937_64 rng(7);
  const std::int64_t B = 1, N = 4, D = 24;
  std::vector<std::uint16_t> x(N * D), y(N * D);
  std::vector<double> xd(N * D);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = float_to_bf16_bits(static_cast<float>(std::normal_distribution<double>(1, 2)(rng)));
    xd[i] = bf16_bits_to_float(x[i]);
  }
  std::vector<float> scale(D), shift(D);
  for (std::int64_t d = 0; d < D; ++d) {
    scale[d] = 0.01f * static_cast<float>(d);
    shift[d] = -0.5f + 0.03f * static_cast<float>(d);
  }
  AdaLNFwdParams p;
  p.batch = B;
  p.seq_len = N;
  p.dim = D;
  p.dtype = DType::kBFloat16;
  p.x = {x.data(), DType::kBFloat16, N * D, D};
  p.scale = {scale.data(), DType::kFloat32, D, 0};
  p.shift = {shift.data(), DType::kFloat32, D, 0};
  p.y = y.data();
  adaln_forward_ref(p);
  for (std::int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (std::int64_t d = 0; d < D; ++d) m += xd[n * D + d] / D;
    for (std::int64_t d = 0; d < D; ++d) v += (xd[n * D + d] - m) * (xd[n * D + d] - m) / D;
    for (std::int64_t d = 0; d < D; ++d) {
      const double want = (xd[n * D + d] - m) / std::sqrt(v + 1e-6) * (1 + scale[d]) + shift[d];
      const double got = bf16_bits_to_float(y[n * D + d]);
      EXPECT_LE(std::abs(got - want), std::abs(want) * 0x1p-8 + 1e-30) << n << "," << d;
    }
  }
}

// ---- backward against finite differences ----

// L = sum(y * cy) + sum(h * ch) (gated). Returns L for the current buffers of `pr`.
double loss(Problem& pr, const std::vector<double>& cy, const std::vector<double>& ch) {
  AdaLNFwdParams p = pr.fwd();
  adaln_forward_ref(p);
  double l = 0;
  for (std::size_t i = 0; i < pr.y.size(); ++i) {
    l += pr.y[i] * cy[i];
    if (pr.var.gated) l += pr.h[i] * ch[i];
  }
  return l;
}

void expect_grad_fd(Problem& pr, std::vector<double>& input, const std::vector<double>& grad,
                    const std::vector<double>& cy, const std::vector<double>& ch,
                    const std::string& what, const std::vector<bool>* only = nullptr) {
  ASSERT_EQ(input.size(), grad.size()) << what;
  const double step = 1e-6;
  for (std::size_t i = 0; i < input.size(); ++i) {
    if (only != nullptr && !(*only)[i]) continue;
    const double saved = input[i];
    input[i] = saved + step;
    const double lp = loss(pr, cy, ch);
    input[i] = saved - step;
    const double lm = loss(pr, cy, ch);
    input[i] = saved;
    const double fd = (lp - lm) / (2 * step);
    ASSERT_NEAR(grad[i], fd, 1e-6 * (1 + std::abs(fd))) << what << "[" << i << "]";
  }
}

TEST(AdaLNRef, BackwardMatchesFiniteDifferences) {
  std::mt19937_64 rng(99);
  for (NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
    for (int mask = 0; mask < 8; ++mask) {
      const Variant v{norm, (mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0};
      SCOPED_TRACE("norm " + std::to_string(static_cast<int>(norm)) + " mask " +
                   std::to_string(mask));
      Problem pr(2, 3, 6, v, rng);
      const auto rows = static_cast<std::size_t>(pr.B * pr.N * pr.D);
      const std::vector<double> cy = random_vec(rng, rows), ch = random_vec(rng, rows);
      AdaLNFwdParams fp = pr.fwd();
      adaln_forward_ref(fp);

      AdaLNBwdParams p;
      pr.fill_config(p);
      const RowsView dense{nullptr, DType::kFloat64, pr.N * pr.D, pr.D};
      RowsView& in = v.gated ? p.residual : p.x;  // gated: h is recomputed from residual
      in = dense;
      in.data = v.gated ? pr.residual.data() : pr.x.data();
      p.dy = dense;
      p.dy.data = cy.data();
      const std::size_t per = v.per_token ? rows : static_cast<std::size_t>(pr.B * pr.D);
      std::vector<double> dx(rows), dbranch(rows), dscale(per), dshift(per), dgate(per);
      std::vector<double> dweight(pr.D), dbias(pr.D);
      p.dx = dx.data();
      p.dscale = dscale.data();
      p.dshift = dshift.data();
      if (v.affine) {
        p.dweight = dweight.data();
        p.dbias = dbias.data();
      }
      if (v.gated) {
        p.dh_out = dense;
        p.dh_out.data = ch.data();
        p.branch = dense;
        p.branch.data = pr.branch.data();
        p.dbranch = dbranch.data();
        p.dgate = dgate.data();
      }
      adaln_backward_ref(p);

      if (v.gated) {
        expect_grad_fd(pr, pr.residual, dx, cy, ch, "dresidual");
        expect_grad_fd(pr, pr.branch, dbranch, cy, ch, "dbranch");
      } else {
        expect_grad_fd(pr, pr.x, dx, cy, ch, "dx");
      }
      if (v.affine) {
        expect_grad_fd(pr, pr.weight, dweight, cy, ch, "dweight");
        expect_grad_fd(pr, pr.bias, dbias, cy, ch, "dbias");
      }
      // Modulation gradients: perturb the chunk elements through the packed tensor.
      const int chunks = v.gated ? 3 : 2;
      for (int k = 0; k < chunks; ++k) {
        const std::vector<double>& g = k == 0 ? dshift : (k == 1 ? dscale : dgate);
        std::vector<double> packed_grad(pr.mod.size(), 0.0);
        std::vector<bool> in_chunk(pr.mod.size(), false);
        const std::int64_t n_mod = v.per_token ? pr.N : 1;
        for (std::int64_t b = 0; b < pr.B; ++b) {
          for (std::int64_t n = 0; n < n_mod; ++n) {
            for (std::int64_t d = 0; d < pr.D; ++d) {
              const std::size_t i = ((b * n_mod + n) * 6 + k) * pr.D + d;
              packed_grad[i] = g[(b * n_mod + n) * pr.D + d];
              in_chunk[i] = true;
            }
          }
        }
        expect_grad_fd(pr, pr.mod, packed_grad, cy, ch, "dmod chunk " + std::to_string(k),
                       &in_chunk);
      }
    }
  }
}

// adaln_backward_ref(bad) throws ditscale::Error whose message contains `needle`.
void expect_bwd_throws(const AdaLNBwdParams& bad, const std::string& needle) {
  try {
    adaln_backward_ref(bad);
    ADD_FAILURE() << "no throw, expected " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Per-sample dscale / dshift written with a sample stride into rows of a [B, K, D] buffer (the
// modulation gradient of the packed ops): the same values as contiguous outputs, other rows
// untouched; per-token outputs with a stride and strides below D are rejected, naming the field.
TEST(AdaLNRef, BackwardWritesStridedPerSampleGradients) {
  std::mt19937_64 rng(7);
  Problem pr(3, 4, 8, Variant{}, rng);
  AdaLNFwdParams fp = pr.fwd();
  adaln_forward_ref(fp);
  const auto rows = static_cast<std::size_t>(pr.B * pr.N * pr.D);
  const std::vector<double> dy = random_vec(rng, rows);
  auto params = [&](std::vector<double>& dx) { return pr.plain_bwd(dy, dx); };
  std::vector<double> dx0(rows), dx1(rows);
  std::vector<double> dscale(pr.B * pr.D), dshift(pr.B * pr.D);
  AdaLNBwdParams p = params(dx0);
  p.dscale = dscale.data();
  p.dshift = dshift.data();
  adaln_backward_ref(p);

  const std::int64_t K = 3;
  std::vector<double> dmod(pr.B * K * pr.D, 0.0);
  p = params(dx1);
  p.dshift = dmod.data();             // row 0
  p.dscale = dmod.data() + 2 * pr.D;  // row 2
  p.dscale_stride_b = K * pr.D;
  p.dshift_stride_b = K * pr.D;
  adaln_backward_ref(p);
  EXPECT_EQ(dx0, dx1);
  for (std::int64_t b = 0; b < pr.B; ++b) {
    for (std::int64_t d = 0; d < pr.D; ++d) {
      EXPECT_EQ(dmod[(b * K + 0) * pr.D + d], dshift[b * pr.D + d]);
      EXPECT_EQ(dmod[(b * K + 1) * pr.D + d], 0.0) << "row 1 must stay untouched";
      EXPECT_EQ(dmod[(b * K + 2) * pr.D + d], dscale[b * pr.D + d]);
    }
  }
  AdaLNBwdParams bad = p;
  bad.dscale_stride_b = pr.D - 1;
  expect_bwd_throws(bad, "AdaLNBwdParams.dscale_stride_b");
  // Gated: dgate into row 1 of the same kind of buffer.
  Problem gp(2, 3, 8, Variant{NormType::kRMSNorm, false, false, /*gated=*/true}, rng);
  AdaLNFwdParams gfp = gp.fwd();
  adaln_forward_ref(gfp);
  auto gated_params = [&](std::vector<double>& dx, std::vector<double>& dbranch) {
    AdaLNBwdParams q;
    gp.fill_config(q);
    q.residual = {gp.residual.data(), DType::kFloat64, gp.N * gp.D, gp.D};
    q.dy = {dy.data(), DType::kFloat64, gp.N * gp.D, gp.D};
    q.branch = {gp.branch.data(), DType::kFloat64, gp.N * gp.D, gp.D};
    q.dx = dx.data();
    q.dbranch = dbranch.data();
    return q;
  };
  const std::size_t grows = static_cast<std::size_t>(gp.B * gp.N * gp.D);
  std::vector<double> gdx0(grows), gdx1(grows), gdb0(grows), gdb1(grows), dgate(gp.B * gp.D);
  AdaLNBwdParams gq = gated_params(gdx0, gdb0);
  gq.dgate = dgate.data();
  adaln_backward_ref(gq);
  std::vector<double> gmod(gp.B * K * gp.D, 0.0);
  gq = gated_params(gdx1, gdb1);
  gq.dgate = gmod.data() + gp.D;  // row 1
  gq.dgate_stride_b = K * gp.D;
  adaln_backward_ref(gq);
  EXPECT_EQ(gdx0, gdx1);
  EXPECT_EQ(gdb0, gdb1);
  for (std::int64_t b = 0; b < gp.B; ++b) {
    for (std::int64_t d = 0; d < gp.D; ++d) {
      EXPECT_EQ(gmod[(b * K + 1) * gp.D + d], dgate[b * gp.D + d]);
      EXPECT_EQ(gmod[(b * K + 0) * gp.D + d], 0.0);
      EXPECT_EQ(gmod[(b * K + 2) * gp.D + d], 0.0);
    }
  }

  Problem tok(2, 3, 8, Variant{NormType::kLayerNorm, /*per_token=*/true}, rng);
  std::vector<double> tdx(2 * 3 * 8), tds(2 * 3 * 8);
  AdaLNBwdParams tp;
  tok.fill_config(tp);
  tp.x = {tok.x.data(), DType::kFloat64, 3 * 8, 8};
  tp.dy = {dy.data(), DType::kFloat64, 3 * 8, 8};
  tp.dx = tdx.data();
  tp.dshift = tds.data();
  tp.dshift_stride_b = 3 * 8 * 2;
  expect_bwd_throws(tp, "AdaLNBwdParams.dshift_stride_b");
}

// AdaLNBwdParams::dmod: the rows of the [B, K, D] modulation gradient that no output fills are
// zeroed (the buffer starts as garbage), the filled rows hold the gradients; bad descriptions
// are rejected naming the field.
TEST(AdaLNRef, BackwardZeroesTheUnwrittenRowsOfDmod) {
  std::mt19937_64 rng(11);
  Problem pr(2, 5, 8, Variant{}, rng);
  AdaLNFwdParams fp = pr.fwd();
  adaln_forward_ref(fp);
  const auto rows = static_cast<std::size_t>(pr.B * pr.N * pr.D);
  const std::vector<double> dy = random_vec(rng, rows);
  std::vector<double> dx(rows), dscale(pr.B * pr.D), dshift(pr.B * pr.D);
  auto params = [&]() { return pr.plain_bwd(dy, dx); };
  AdaLNBwdParams p = params();
  p.dscale = dscale.data();
  p.dshift = dshift.data();
  adaln_backward_ref(p);

  const std::int64_t K = 4, D = pr.D;
  std::vector<double> dmod(pr.B * K * D, std::nan(""));
  p = params();
  p.dmod = dmod.data();
  p.dmod_rows = K;
  p.dmod_dtype = DType::kFloat64;
  p.dshift = dmod.data() + 3 * D;  // row 3
  p.dscale = dmod.data() + 1 * D;  // row 1
  p.dscale_stride_b = K * D;
  p.dshift_stride_b = K * D;
  adaln_backward_ref(p);
  for (std::int64_t b = 0; b < pr.B; ++b) {
    for (std::int64_t d = 0; d < D; ++d) {
      EXPECT_EQ(dmod[(b * K + 0) * D + d], 0.0);
      EXPECT_EQ(dmod[(b * K + 1) * D + d], dscale[b * D + d]);
      EXPECT_EQ(dmod[(b * K + 2) * D + d], 0.0);
      EXPECT_EQ(dmod[(b * K + 3) * D + d], dshift[b * D + d]);
    }
  }
  // No output in it: every row is zeroed.
  AdaLNBwdParams none = params();
  std::vector<double> zmod(pr.B * K * D, 1.0);
  none.dmod = zmod.data();
  none.dmod_rows = K;
  none.dmod_dtype = DType::kFloat64;
  adaln_backward_ref(none);
  EXPECT_EQ(zmod, std::vector<double>(zmod.size(), 0.0));

  AdaLNBwdParams bad = p;
  bad.dmod_rows = 0;
  expect_bwd_throws(bad, "AdaLNBwdParams.dmod_rows must be >= 1");
  bad = p;
  bad.dscale = dmod.data() + D + 1;  // inside row 1
  expect_bwd_throws(bad, "AdaLNBwdParams.dscale does not point at the start of one of the 4 rows");
  bad = p;
  bad.dscale = dmod.data() + K * D;  // row 0 of sample 1: outside sample 0's rows
  expect_bwd_throws(bad, "AdaLNBwdParams.dscale does not point");
  bad = p;
  bad.dshift = bad.dscale;
  expect_bwd_throws(bad, "AdaLNBwdParams.dshift is row 1 of .dmod, which another output");
  bad = p;
  bad.dscale_stride_b = 0;
  expect_bwd_throws(bad, "AdaLNBwdParams.dscale_stride_b: 8 but the samples of .dmod are");
  bad = p;
  bad.dmod_dtype = DType::kFloat32;
  expect_bwd_throws(bad, "AdaLNBwdParams.dscale has dtype float64 but .dmod_dtype is float32");
  Problem tok(2, 3, 8, Variant{NormType::kLayerNorm, /*per_token=*/true}, rng);
  std::vector<double> tdx(2 * 3 * 8), tds(2 * 3 * 8), tmod(2 * 2 * 8);
  AdaLNBwdParams tp;
  tok.fill_config(tp);
  tp.x = {tok.x.data(), DType::kFloat64, 3 * 8, 8};
  tp.dy = {dy.data(), DType::kFloat64, 3 * 8, 8};
  tp.dx = tdx.data();
  tp.dshift = tmod.data();
  tp.dmod = tmod.data();
  tp.dmod_rows = 2;
  tp.dmod_dtype = DType::kFloat64;
  expect_bwd_throws(tp, "AdaLNBwdParams.dshift is a per-token gradient");
}

// ---- validation and workspace ----

// The gated backward recomputes h from residual, gate and branch with the forward's rounding: on
// bf16 rows its dx, dscale and dshift are bit-identical to the plain backward of the forward's
// stored h (the norm's input), and it rejects an h handed in as x.
TEST(AdaLNRef, GatedBackwardRecomputesTheForwardsH) {
  std::mt19937_64 rng(13);
  const std::int64_t N = 5, D = 40;
  const auto rows = static_cast<std::size_t>(N * D);
  auto bf16_vec = [&](double lo, double hi) {
    std::vector<std::uint16_t> v(rows);
    const std::vector<double> src = random_vec(rng, rows, lo, hi);
    for (std::size_t i = 0; i < rows; ++i) v[i] = float_to_bf16_bits(static_cast<float>(src[i]));
    return v;
  };
  const std::vector<std::uint16_t> residual = bf16_vec(-2, 3), branch = bf16_vec(-1, 1);
  const std::vector<std::uint16_t> dy = bf16_vec(-1, 1);
  std::vector<float> gate(D), scale(D), shift(D);
  for (std::int64_t d = 0; d < D; ++d) {
    gate[d] = 0.37f + 0.011f * static_cast<float>(d);
    scale[d] = 0.02f * static_cast<float>(d) - 0.3f;
    shift[d] = 0.5f - 0.01f * static_cast<float>(d);
  }
  auto config = [&](AdaLNConfig& c) {
    c.batch = 1;
    c.seq_len = N;
    c.dim = D;
    c.dtype = DType::kBFloat16;
    c.scale = {scale.data(), DType::kFloat32, D, 0};
    c.shift = {shift.data(), DType::kFloat32, D, 0};
  };
  const RowsView dense{nullptr, DType::kBFloat16, N * D, D};
  auto view = [&](const std::vector<std::uint16_t>& v) {
    RowsView r = dense;
    r.data = v.data();
    return r;
  };
  std::vector<std::uint16_t> h(rows), y(rows);
  std::vector<float> mean(N), rstd(N);
  AdaLNFwdParams f;
  config(f);
  f.gate = {gate.data(), DType::kFloat32, D, 0};
  f.residual = view(residual);
  f.branch = view(branch);
  f.h = h.data();
  f.y = y.data();
  f.mean = mean.data();
  f.rstd = rstd.data();
  adaln_forward_ref(f);

  struct Grads {
    std::vector<std::uint16_t> dx, dbranch;
    std::vector<float> dscale, dshift, dgate;
  };
  auto run = [&](bool gated, Grads& g) {
    g.dx.assign(rows, 0);
    g.dbranch.assign(rows, 0);
    g.dscale.assign(D, 0.f);
    g.dshift.assign(D, 0.f);
    g.dgate.assign(D, 0.f);
    AdaLNBwdParams p;
    config(p);
    p.dy = view(dy);
    p.mean = mean.data();
    p.rstd = rstd.data();
    p.dx = g.dx.data();
    p.dscale = g.dscale.data();
    p.dshift = g.dshift.data();
    if (gated) {
      p.gate = f.gate;
      p.residual = view(residual);
      p.branch = view(branch);
      p.dbranch = g.dbranch.data();
      p.dgate = g.dgate.data();
    } else {
      p.x = view(h);
    }
    adaln_backward_ref(p);
    return p;
  };
  Grads plain, gated;
  run(false, plain);
  AdaLNBwdParams p = run(true, gated);
  EXPECT_EQ(gated.dx, plain.dx);
  EXPECT_EQ(gated.dscale, plain.dscale);
  EXPECT_EQ(gated.dshift, plain.dshift);
  for (std::size_t i = 0; i < rows; ++i) {  // dbranch = dx * gate (dh_out absent)
    const double want = bf16_bits_to_float(plain.dx[i]) * gate[i % D];
    ASSERT_NEAR(bf16_bits_to_float(gated.dbranch[i]), want, std::abs(want) * 0x1p-7 + 1e-30) << i;
  }
  AdaLNBwdParams bad = p;
  bad.x = view(h);
  expect_bwd_throws(bad, "AdaLNBwdParams.x.data must be null");
  bad = p;
  bad.residual = RowsView{};
  expect_bwd_throws(bad, "AdaLNBwdParams.residual");
  bad = p;
  bad.branch = RowsView{};
  expect_bwd_throws(bad, "AdaLNBwdParams.branch");
}

TEST(AdaLNRef, RejectsBadParamsNamingTheField) {
  std::mt19937_64 rng(5);
  Problem pr(1, 2, 8, Variant{}, rng);
  auto expect_throw = [&](AdaLNFwdParams p, const std::string& needle) {
    try {
      adaln_forward_ref(p);
      ADD_FAILURE() << "no throw, expected " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  AdaLNFwdParams p = pr.fwd();
  p.dim = 0;
  expect_throw(p, "AdaLNFwdParams.dim");
  p = pr.fwd();
  p.eps = 0.f;
  expect_throw(p, "AdaLNFwdParams.eps");
  p = pr.fwd();
  p.scale.dtype = DType::kFloat16;
  expect_throw(p, "AdaLNFwdParams.scale.dtype");
  p = pr.fwd();
  p.shift.data = nullptr;
  expect_throw(p, "AdaLNFwdParams.shift.data");
  p = pr.fwd();
  p.gate = p.scale;  // gated but x given and no residual
  expect_throw(p, "AdaLNFwdParams.x.data must be null");
  p = pr.fwd();
  p.x.stride_n = -1;
  expect_throw(p, "AdaLNFwdParams.x: strides");
  p = pr.fwd();
  EXPECT_THROW(adaln_check(p, /*for_gpu=*/true), Error);  // fp64 is CPU only
}

TEST(AdaLNRef, WorkspaceCountsOnlyReducedGradients) {
  AdaLNBwdParams p;
  p.batch = 2;
  p.seq_len = 5000;
  p.dim = 96;
  int dummy = 0;
  p.scale = {&dummy, DType::kBFloat16, 96, 0};
  p.shift = {&dummy, DType::kBFloat16, 5000 * 96, 96};  // per token: no partials
  p.dscale = &dummy;
  p.dshift = &dummy;
  const std::int64_t tiles = internal::bwd_num_tiles(2, 5000);
  EXPECT_EQ(tiles, (5000 + internal::bwd_rows_per_tile(2, 5000) - 1) /
                       internal::bwd_rows_per_tile(2, 5000));
  EXPECT_EQ(adaln_backward_workspace_bytes(p), static_cast<std::size_t>(2 * tiles * 96 * 4));
  p.weight = &dummy;
  p.dweight = &dummy;
  EXPECT_EQ(adaln_backward_workspace_bytes(p), static_cast<std::size_t>(2 * 2 * tiles * 96 * 4));
  p.dscale = nullptr;
  p.dweight = nullptr;
  EXPECT_EQ(adaln_backward_workspace_bytes(p), 0u);
}

}  // namespace
}  // namespace ditscale::kernels
