// CPU reference of the fused AdaLN forward and backward: fp64 accumulation, one rounding to the
// output dtype. Written for clarity, not speed.
#include <cmath>
#include <cstdint>
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

void adaln_backward_ref(const AdaLNBwdParams& p) {
  adaln_check(p, /*for_gpu=*/false);
  const bool gated = p.gate.data != nullptr;
  const std::int64_t B = p.batch, N = p.seq_len, D = p.dim;
  const bool scale_tok = is_per_token(p.scale);
  const bool shift_tok = is_per_token(p.shift);
  const bool gate_tok = gated && is_per_token(p.gate);
  const auto sz = static_cast<std::size_t>(D);
  // Accumulators of the gradients reduced over n (per sample: [B, D]) and over b, n ([D]).
  std::vector<double> acc_dscale(B * sz, 0.0), acc_dshift(B * sz, 0.0), acc_dgate(B * sz, 0.0);
  std::vector<double> acc_dweight(sz, 0.0), acc_dbias(sz, 0.0);
  std::vector<double> v(sz), dy(sz), xhat(sz), dxhat(sz);
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t row = b * N + n;
      for (std::int64_t d = 0; d < D; ++d) {
        v[d] = gated ? round_to(p.dtype, gated_h(p, b, n, d)) : at(p.x, b, n, d);
        dy[d] = at(p.dy, b, n, d);
      }
      const RowStats st = row_stats(v, p.norm, p.eps);
      double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
      for (std::int64_t d = 0; d < D; ++d) {
        xhat[d] = (v[d] - st.mean) * st.rstd;
        const double w = affine_at(p.weight, p.affine_dtype, d, 1.0);
        const double bias = affine_at(p.bias, p.affine_dtype, d, 0.0);
        const double one_plus_scale = 1.0 + at(p.scale, b, n, d);
        const double xn = xhat[d] * w + bias;
        dxhat[d] = dy[d] * one_plus_scale * w;
        sum_dxhat += dxhat[d];
        sum_dxhat_xhat += dxhat[d] * xhat[d];
        const double dscale = dy[d] * xn;
        if (p.dscale != nullptr) {
          if (scale_tok) {
            store_from_double(p.dscale, p.scale.dtype, row * D + d, dscale);
          } else {
            acc_dscale[b * D + d] += dscale;
          }
        }
        if (p.dshift != nullptr) {
          if (shift_tok) {
            store_from_double(p.dshift, p.shift.dtype, row * D + d, dy[d]);
          } else {
            acc_dshift[b * D + d] += dy[d];
          }
        }
        acc_dweight[d] += dy[d] * one_plus_scale * xhat[d];
        acc_dbias[d] += dy[d] * one_plus_scale;
      }
      const double mean_dxhat = sum_dxhat / static_cast<double>(D);
      const double mean_dxhat_xhat = sum_dxhat_xhat / static_cast<double>(D);
      for (std::int64_t d = 0; d < D; ++d) {
        double dx = dxhat[d] - xhat[d] * mean_dxhat_xhat;
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
            acc_dgate[b * D + d] += dgate;
          }
        }
      }
    }
  }
  const std::int64_t sc_sb = p.dscale_stride_b > 0 ? p.dscale_stride_b : D;
  const std::int64_t sh_sb = p.dshift_stride_b > 0 ? p.dshift_stride_b : D;
  const std::int64_t g_sb = p.dgate_stride_b > 0 ? p.dgate_stride_b : D;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t d = 0; d < D; ++d) {
      const std::int64_t i = b * D + d;
      if (p.dscale != nullptr && !scale_tok) {
        store_from_double(p.dscale, p.scale.dtype, b * sc_sb + d, acc_dscale[i]);
      }
      if (p.dshift != nullptr && !shift_tok) {
        store_from_double(p.dshift, p.shift.dtype, b * sh_sb + d, acc_dshift[i]);
      }
      if (p.dgate != nullptr && !gate_tok) {
        store_from_double(p.dgate, p.gate.dtype, b * g_sb + d, acc_dgate[i]);
      }
    }
  }
  for (std::int64_t d = 0; d < D; ++d) {
    if (p.dweight != nullptr) store_from_double(p.dweight, p.affine_dtype, d, acc_dweight[d]);
    if (p.dbias != nullptr) store_from_double(p.dbias, p.affine_dtype, d, acc_dbias[d]);
  }
  // The rows of the modulation gradient that no output filled.
  for (const std::int64_t k : internal::dmod_zero_rows(p)) {
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t d = 0; d < D; ++d) {
        store_from_double(p.dmod, p.dmod_dtype, (b * p.dmod_rows + k) * D + d, 0.0);
      }
    }
  }
}

}  // namespace ditscale::kernels
