// Parameter validation of the AdaLN functions and the backward workspace query (host only, built
// with or without CUDA).
#include <array>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

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

// The per-sample outputs that may be rows of AdaLNBwdParams::dmod.
struct ModOutput {
  const char* name;
  const void* data;
  const RowsView* view;
  std::int64_t stride_b;
};

std::array<ModOutput, 3> mod_outputs(const AdaLNBwdParams& p) {
  return {
      ModOutput{"dscale", p.dscale, &p.scale, p.dscale_stride_b},
      ModOutput{"dshift", p.dshift, &p.shift, p.dshift_stride_b},
      ModOutput{"dgate", p.gate.data != nullptr ? p.dgate : nullptr, &p.gate, p.dgate_stride_b}};
}

// Row of p.dmod that `out` points at the start of, or -1 when it is none.
std::int64_t dmod_row_of(const AdaLNBwdParams& p, const void* out) {
  const auto row_bytes = static_cast<std::intptr_t>(p.dim * dtype_size(p.dmod_dtype));
  const std::intptr_t off =
      reinterpret_cast<std::intptr_t>(out) - reinterpret_cast<std::intptr_t>(p.dmod);
  if (off < 0 || off % row_bytes != 0 || off / row_bytes >= p.dmod_rows) return -1;
  return static_cast<std::int64_t>(off / row_bytes);
}

void check_dmod(const AdaLNBwdParams& p, const char* s) {
  if (p.dmod == nullptr) return;
  DS_CHECK(p.dmod_rows >= 1, s, ".dmod_rows must be >= 1 with .dmod set, got ", p.dmod_rows);
  DS_CHECK(valid_dtype(p.dmod_dtype), s, ".dmod_dtype: invalid value ",
           static_cast<int>(p.dmod_dtype));
  std::int64_t used[3] = {-1, -1, -1};
  int k = 0;
  for (const ModOutput& o : mod_outputs(p)) {
    if (o.data == nullptr) continue;
    DS_CHECK(!is_per_token(*o.view), s, ".", o.name,
             " is a per-token gradient: it cannot be a row of .dmod");
    DS_CHECK(o.view->dtype == p.dmod_dtype, s, ".", o.name, " has dtype ",
             dtype_name(o.view->dtype), " but .dmod_dtype is ", dtype_name(p.dmod_dtype));
    const std::int64_t stride = o.stride_b > 0 ? o.stride_b : p.dim;
    DS_CHECK(p.batch == 1 || stride == p.dmod_rows * p.dim, s, ".", o.name, "_stride_b: ", stride,
             " but the samples of .dmod are dmod_rows * dim = ", p.dmod_rows * p.dim, " apart");
    const std::int64_t row = dmod_row_of(p, o.data);
    DS_CHECK(row >= 0, s, ".", o.name, " does not point at the start of one of the ", p.dmod_rows,
             " rows of .dmod");
    for (int q = 0; q < k; ++q) {
      DS_CHECK(used[q] != row, s, ".", o.name, " is row ", row,
               " of .dmod, which another output already writes");
    }
    used[k++] = row;
  }
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
  check_dmod(p, s);
  if (gated) {
    check_absent(p.x, s, "x", "in the gated variant (h is recomputed from residual)");
    check_view(p.residual, s, "residual", p.dtype, false, true);
    check_view(p.gate, s, "gate", p.dtype, true, true);
    check_view(p.dh_out, s, "dh_out", p.dtype, false, false);
    check_view(p.branch, s, "branch", p.dtype, false, true);
  } else {
    check_view(p.x, s, "x", p.dtype, false, true);
    check_absent(p.residual, s, "residual", "without a gate");
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

namespace internal {

std::vector<std::int64_t> dmod_zero_rows(const AdaLNBwdParams& p) {
  std::vector<std::int64_t> rows;
  if (p.dmod == nullptr) return rows;
  std::vector<bool> written(static_cast<std::size_t>(p.dmod_rows), false);
  for (const ModOutput& o : mod_outputs(p)) {
    if (o.data == nullptr) continue;
    const std::int64_t row = dmod_row_of(p, o.data);
    if (row >= 0) written[static_cast<std::size_t>(row)] = true;
  }
  for (std::int64_t k = 0; k < p.dmod_rows; ++k) {
    if (!written[static_cast<std::size_t>(k)]) rows.push_back(k);
  }
  return rows;
}

}  // namespace internal

}  // namespace ditscale::kernels
