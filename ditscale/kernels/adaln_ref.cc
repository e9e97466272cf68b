// CPU reference of the fused AdaLN forward and backward: fp64 accumulation, one rounding to the
// output dtype. Written for clarity, not speed.
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels {
namespace {

// Element (b, n, d) of a view, as double.
double at(const RowsView& v, std::int64_t b, std::int64_t n, std::int64_t d) {
  return load_as_double(v.data, v.dtype, b * v.stride_b + n * v.stride_n + d);
}

// Rounds `value` to `dtype` and back (what a store followed by a load gives).
double round_to(DType dtype, double value) {
  switch (dtype) {
    case DType::kFloat64:
      return value;
    case DType::kFloat32:
      return static_cast<float>(value);
    case DType::kFloat16:
      return fp16_bits_to_float(float_to_fp16_bits(static_cast<float>(value)));
    case DType::kBFloat16:
      return bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(value)));
  }
  return value;
}

struct RowStats {
  double mean = 0.0;
  double rstd = 0.0;
};

// LayerNorm: two-pass mean and centred variance; RMSNorm: mean square, mean = 0.
RowStats row_stats(const std::vector<double>& v, NormType norm, double eps) {
  const double dim = static_cast<double>(v.size());
  RowStats st;
  if (norm == NormType::kLayerNorm) {
    double sum = 0.0;
    for (double e : v) sum += e;
    st.mean = sum / dim;
    double sq = 0.0;
    for (double e : v) sq += (e - st.mean) * (e - st.mean);
    st.rstd = 1.0 / std::sqrt(sq / dim + eps);
  } else {
    double sq = 0.0;
    for (double e : v) sq += e * e;
    st.rstd = 1.0 / std::sqrt(sq / dim + eps);
  }
  return st;
}

double affine_at(const void* data, DType dtype, std::int64_t d, double absent) {
  return data == nullptr ? absent : load_as_double(data, dtype, d);
}

// h = residual + gate * branch at (b, n, d) in fp64, before its rounding to the dtype: the
// forward stores it, the backward recomputes it (the gated variants of both param structs).
template <typename Params>
double gated_h(const Params& p, std::int64_t b, std::int64_t n, std::int64_t d) {
  return at(p.residual, b, n, d) + at(p.gate, b, n, d) * at(p.branch, b, n, d);
}

}  // namespace

void adaln_forward_ref(const AdaLNFwdParams& p) {
  adaln_check(p, /*for_gpu=*/false);
  const bool gated = p.gate.data != nullptr;
  const std::int64_t B = p.batch, N = p.seq_len, D = p.dim;
  std::vector<double> v(static_cast<std::size_t>(D));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t row = b * N + n;
      for (std::int64_t d = 0; d < D; ++d) {
        if (gated) {
          const double h = gated_h(p, b, n, d);
          store_from_double(p.h, p.dtype, row * D + d, h);
          v[d] = round_to(p.dtype, h);
        } else {
          v[d] = at(p.x, b, n, d);
        }
      }
      const RowStats st = row_stats(v, p.norm, p.eps);
      if (p.mean != nullptr) {
        p.mean[row] = static_cast<float>(st.mean);
        p.rstd[row] = static_cast<float>(st.rstd);
      }
      for (std::int64_t d = 0; d < D; ++d) {
        const double xhat = (v[d] - st.mean) * st.rstd;
        const double xn = xhat * affine_at(p.weight, p.affine_dtype, d, 1.0) +
                          affine_at(p.bias, p.affine_dtype, d, 0.0);
        const double y = xn * (1.0 + at(p.scale, b, n, d)) + at(p.shift, b, n, d);
        store_from_double(p.y, p.dtype, row * D + d, y);
      }
    }
  }
}

namespace {

// The backward's gradients reduced over n (per sample: [B, D]) and over b, n ([D]), and one
// row's scratch.
struct BwdSums {
  std::vector<double> dscale, dshift, dgate;  // [B, D]
  std::vector<double> dweight, dbias;         // [D]
  std::vector<double> v, dy, xhat, dxhat;     // the row being done, [D]
};

// Pass 1 of row (b, n): xhat, dxhat; the row's modulation and affine gradients. Returns
// (sum dxhat, sum dxhat * xhat).
std::pair<double, double> RowNormGrads(const AdaLNBwdParams& p, std::int64_t b, std::int64_t n,
                                       const RowStats& st, BwdSums& s) {
  const std::int64_t D = p.dim, row = b * p.seq_len + n;
  const bool scale_tok = is_per_token(p.scale), shift_tok = is_per_token(p.shift);
  double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
  for (std::int64_t d = 0; d < D; ++d) {
    s.xhat[d] = (s.v[d] - st.mean) * st.rstd;
    const double w = affine_at(p.weight, p.affine_dtype, d, 1.0);
    const double bias = affine_at(p.bias, p.affine_dtype, d, 0.0);
    const double one_plus_scale = 1.0 + at(p.scale, b, n, d);
    const double xn = s.xhat[d] * w + bias;
    s.dxhat[d] = s.dy[d] * one_plus_scale * w;
    sum_dxhat += s.dxhat[d];
    sum_dxhat_xhat += s.dxhat[d] * s.xhat[d];
    const double dscale = s.dy[d] * xn;
    if (p.dscale != nullptr) {
      if (scale_tok) {
        store_from_double(p.dscale, p.scale.dtype, row * D + d, dscale);
      } else {
        s.dscale[b * D + d] += dscale;
      }
    }
    if (p.dshift != nullptr) {
      if (shift_tok) {
        store_from_double(p.dshift, p.shift.dtype, row * D + d, s.dy[d]);
      } else {
        s.dshift[b * D + d] += s.dy[d];
      }
    }
    s.dweight[d] += s.dy[d] * one_plus_scale * s.xhat[d];
    s.dbias[d] += s.dy[d] * one_plus_scale;
  }
  return {sum_dxhat, sum_dxhat_xhat};
}

// Pass 2 of row (b, n): dx (+ dh_out when gated), dbranch and dgate.
void RowInputGrads(const AdaLNBwdParams& p, std::int64_t b, std::int64_t n, const RowStats& st,
                   double mean_dxhat, double mean_dxhat_xhat, BwdSums& s) {
  const bool gated = p.gate.data != nullptr;
  const bool gate_tok = gated && is_per_token(p.gate);
  const std::int64_t D = p.dim, row = b * p.seq_len + n;
  for (std::int64_t d = 0; d < D; ++d) {
    double dx = s.dxhat[d] - s.xhat[d] * mean_dxhat_xhat;
    if (p.norm == NormType::kLayerNorm) dx -= mean_dxhat;
    dx *= st.rstd;
    if (gated && p.dh_out.data != nullptr) dx += at(p.dh_out, b, n, d);
    store_from_double(p.dx, p.dtype, row * D + d, dx);
    if (!gated) continue;
    if (p.dbranch != nullptr) {
      store_from_double(p.dbranch, p.dtype, row * D + d, dx * at(p.gate, b, n, d));
    }
    if (p.dgate != nullptr) {
      const double dgate = dx * at(p.branch, b, n, d);
      if (gate_tok) {
        store_from_double(p.dgate, p.gate.dtype, row * D + d, dgate);
      } else {
        s.dgate[b * D + d] += dgate;
      }
    }
  }
}

// The reduced gradients, and zeros in the rows of the modulation gradient no output filled.
void StoreSums(const AdaLNBwdParams& p, const BwdSums& s) {
  const std::int64_t B = p.batch, D = p.dim;
  const bool scale_tok = is_per_token(p.scale), shift_tok = is_per_token(p.shift);
  const bool gate_tok = p.gate.data != nullptr && is_per_token(p.gate);
  const std::int64_t sc_sb = p.dscale_stride_b > 0 ? p.dscale_stride_b : D;
  const std::int64_t sh_sb = p.dshift_stride_b > 0 ? p.dshift_stride_b : D;
  const std::int64_t g_sb = p.dgate_stride_b > 0 ? p.dgate_stride_b : D;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t d = 0; d < D; ++d) {
      const std::int64_t i = b * D + d;
      if (p.dscale != nullptr && !scale_tok) {
        store_from_double(p.dscale, p.scale.dtype, b * sc_sb + d, s.dscale[i]);
      }
      if (p.dshift != nullptr && !shift_tok) {
        store_from_double(p.dshift, p.shift.dtype, b * sh_sb + d, s.dshift[i]);
      }
      if (p.dgate != nullptr && !gate_tok) {
        store_from_double(p.dgate, p.gate.dtype, b * g_sb + d, s.dgate[i]);
      }
    }
  }
  for (std::int64_t d = 0; d < D; ++d) {
    if (p.dweight != nullptr) store_from_double(p.dweight, p.affine_dtype, d, s.dweight[d]);
    if (p.dbias != nullptr) store_from_double(p.dbias, p.affine_dtype, d, s.dbias[d]);
  }
  for (const std::int64_t k : internal::dmod_zero_rows(p)) {
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t d = 0; d < D; ++d) {
        store_from_double(p.dmod, p.dmod_dtype, (b * p.dmod_rows + k) * D + d, 0.0);
      }
    }
  }
}

}  // namespace

void adaln_backward_ref(const AdaLNBwdParams& p) {
  adaln_check(p, /*for_gpu=*/false);
  const bool gated = p.gate.data != nullptr;
  const std::int64_t B = p.batch, N = p.seq_len, D = p.dim;
  const auto sz = static_cast<std::size_t>(D);
  BwdSums s;
  s.dscale.assign(B * sz, 0.0);
  s.dshift.assign(B * sz, 0.0);
  s.dgate.assign(B * sz, 0.0);
  s.dweight.assign(sz, 0.0);
  s.dbias.assign(sz, 0.0);
  s.v.resize(sz);
  s.dy.resize(sz);
  s.xhat.resize(sz);
  s.dxhat.resize(sz);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t n = 0; n < N; ++n) {
      for (std::int64_t d = 0; d < D; ++d) {
        s.v[d] = gated ? round_to(p.dtype, gated_h(p, b, n, d)) : at(p.x, b, n, d);
        s.dy[d] = at(p.dy, b, n, d);
      }
      const RowStats st = row_stats(s.v, p.norm, p.eps);
      const auto [sum_dxhat, sum_dxhat_xhat] = RowNormGrads(p, b, n, st, s);
      RowInputGrads(p, b, n, st, sum_dxhat / static_cast<double>(D),
                    sum_dxhat_xhat / static_cast<double>(D), s);
    }
  }
  StoreSums(p, s);
}

}  // namespace ditscale::kernels
