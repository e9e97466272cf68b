// Parameter validation of the AdaLN functions and the backward workspace query (host only, built
// with or without CUDA).
#include <cmath>
#include <cstdint>
#include <utility>

#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_plan.h"

namespace ditscale::kernels {
namespace {

bool valid_dtype(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16 ||
         t == DType::kFloat64;
}

void check_config(const AdaLNConfig& p, const char* s, bool for_gpu) {
  DS_CHECK(p.batch >= 1, s, ".batch must be >= 1, got ", p.batch);
  DS_CHECK(p.seq_len >= 1, s, ".seq_len must be >= 1, got ", p.seq_len);
  DS_CHECK(p.dim >= 1, s, ".dim must be >= 1, got ", p.dim);
  DS_CHECK(p.norm == NormType::kLayerNorm || p.norm == NormType::kRMSNorm, s,
           ".norm: invalid value ", static_cast<int>(p.norm));
  DS_CHECK(std::isfinite(p.eps) && p.eps > 0.0f, s, ".eps must be finite and > 0, got ", p.eps);
  DS_CHECK(valid_dtype(p.dtype), s, ".dtype: invalid value ", static_cast<int>(p.dtype));
  DS_CHECK(!for_gpu || p.dtype != DType::kFloat64, s,
           ".dtype: float64 is supported by the CPU reference only");
  if (p.weight != nullptr || p.bias != nullptr) {
    DS_CHECK(p.affine_dtype == p.dtype || p.affine_dtype == DType::kFloat32, s,
             ".affine_dtype: ", dtype_name(p.affine_dtype), " but must be float32 or dtype (",
             dtype_name(p.dtype), ")");
  }
}

// A [B, N, D] view in `dtype` (activations) or in `dtype`/fp32 (modulation, gate).
void check_view(const RowsView& v, const char* s, const char* field, DType dtype, bool allow_fp32,
                bool required) {
  if (v.data == nullptr) {
    DS_CHECK(!required, s, ".", field, ".data is null but required");
    return;
  }
  DS_CHECK(v.dtype == dtype || (allow_fp32 && v.dtype == DType::kFloat32), s, ".", field,
           ".dtype: ", dtype_name(v.dtype), " but dtype is ", dtype_name(dtype),
           allow_fp32 ? " (float32 is also accepted)" : "");
  DS_CHECK(v.stride_b >= 0 && v.stride_n >= 0, s, ".", field, ": strides must be >= 0, got (",
           v.stride_b, ", ", v.stride_n, ")");
}

void check_absent(const RowsView& v, const char* s, const char* field, const char* why) {
  DS_CHECK(v.data == nullptr, s, ".", field, ".data must be null ", why);
}

}  // namespace

void adaln_check(const AdaLNFwdParams& p, bool for_gpu) {
  const char* s = "AdaLNFwdParams";
  check_config(p, s, for_gpu);
  check_view(p.scale, s, "scale", p.dtype, true, true);
  check_view(p.shift, s, "shift", p.dtype, true, true);
  const bool gated = p.gate.data != nullptr;
  if (gated) {
    check_view(p.gate, s, "gate", p.dtype, true, true);
    check_absent(p.x, s, "x", "in the gated variant (the input is residual + gate * branch)");
    check_view(p.residual, s, "residual", p.dtype, false, true);
    check_view(p.branch, s, "branch", p.dtype, false, true);
    DS_CHECK(p.h != nullptr, s, ".h is null but the gated variant writes h");
  } else {
    check_view(p.x, s, "x", p.dtype, false, true);
    check_absent(p.residual, s, "residual", "without a gate");
    check_absent(p.branch, s, "branch", "without a gate");
  }
  DS_CHECK(p.y != nullptr, s, ".y is null");
  DS_CHECK((p.mean == nullptr) == (p.rstd == nullptr), s,
           ".mean and .rstd must be both set or both null");
}

void adaln_check(const AdaLNBwdParams& p, bool for_gpu) {
  const char* s = "AdaLNBwdParams";
  check_config(p, s, for_gpu);
  check_view(p.scale, s, "scale", p.dtype, true, true);
  check_view(p.shift, s, "shift", p.dtype, true, true);
  check_view(p.x, s, "x", p.dtype, false, true);
  check_view(p.dy, s, "dy", p.dtype, false, true);
  DS_CHECK(p.dx != nullptr, s, ".dx is null but required");
  if (for_gpu) {
    DS_CHECK(p.mean != nullptr && p.rstd != nullptr, s,
             ".mean/.rstd are null: the GPU backward reads the forward's statistics");
  }
  DS_CHECK(p.dweight == nullptr || p.weight != nullptr, s, ".dweight is set but .weight is null");
  DS_CHECK(p.dbias == nullptr || p.bias != nullptr, s, ".dbias is set but .bias is null");
  const std::pair<std::int64_t, bool> out_strides[3] = {
      {p.dscale_stride_b, is_per_token(p.scale)},
      {p.dshift_stride_b, is_per_token(p.shift)},
      {p.dgate_stride_b, p.gate.data != nullptr && is_per_token(p.gate)}};
  for (int k = 0; k < 3; ++k) {
    const char* name =
        k == 0 ? ".dscale_stride_b" : (k == 1 ? ".dshift_stride_b" : ".dgate_stride_b");
    const auto [stride, per_token] = out_strides[k];
    DS_CHECK(stride == 0 || !per_token, s, name, ": ", stride,
             " but per-token gradients are contiguous (must be 0)");
    DS_CHECK(stride == 0 || p.batch == 1 || stride >= p.dim, s, name, ": ", stride,
             " is below dim = ", p.dim, " (samples would overlap)");
  }
  const bool gated = p.gate.data != nullptr;
  if (gated) {
    check_view(p.gate, s, "gate", p.dtype, true, true);
    check_view(p.dh_out, s, "dh_out", p.dtype, false, false);
    check_view(p.branch, s, "branch", p.dtype, false, p.dgate != nullptr);
  } else {
    check_absent(p.dh_out, s, "dh_out", "without a gate");
    check_absent(p.branch, s, "branch", "without a gate");
    DS_CHECK(p.dbranch == nullptr && p.dgate == nullptr, s,
             ".dbranch/.dgate must be null without a gate");
  }
  if (for_gpu) {
    const std::size_t need = adaln_backward_workspace_bytes(p);
    DS_CHECK(p.workspace_bytes >= need, s, ".workspace_bytes: ", p.workspace_bytes,
             " but adaln_backward_workspace_bytes() asks for ", need);
    DS_CHECK(need == 0 || p.workspace != nullptr, s, ".workspace is null but ", need,
             " bytes are needed");
    DS_CHECK(reinterpret_cast<std::uintptr_t>(p.workspace) % 16 == 0, s,
             ".workspace must be 16-byte aligned");
  }
}

std::size_t adaln_backward_workspace_bytes(const AdaLNBwdParams& p) {
  return internal::bwd_workspace_layout(p).bytes();
}

}  // namespace ditscale::kernels
