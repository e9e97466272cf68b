// Fused adaptive LayerNorm (AdaLN): normalisation + shift/scale modulation, optionally fused with
// the gated residual of an AdaLN-Zero DiT block, forward and backward.
//
// Math (per row r = (b, n) of D features, all statistics in fp32 on the GPU, fp64 in the CPU
// reference):
//   LayerNorm: mean = sum_d x[d] / D;  var = sum_d (x[d] - mean)^2 / D;  rstd = 1/sqrt(var + eps)
//              xhat = (x - mean) * rstd
//   RMSNorm:   mean = 0 (written as 0);  rstd = 1/sqrt(sum_d x[d]^2 / D + eps);  xhat = x * rstd
//   xn = xhat * weight + bias          (weight = 1 and bias = 0 when the pointer is null)
//   y  = xn * (1 + scale) + shift      (scale/shift per sample [B, D] or per token [B, N, D])
// Gated residual variant (AdaLN-Zero, `gate.data != nullptr`):
//   h = residual + gate * branch       (rounded once to `dtype`), then y = AdaLN(h) as above.
// Backward (g = (1 + scale) * weight, dxhat = dy * g):
//   dshift = dy                  dscale = dy * xn        (summed over n when per sample)
//   dbias  = sum_{b,n} dy * (1 + scale)                 dweight = sum_{b,n} dy * (1 + scale) * xhat
//   LayerNorm: dx = rstd * (dxhat - mean_d(dxhat) - xhat * mean_d(dxhat * xhat))
//   RMSNorm:   dx = rstd * (dxhat - xhat * mean_d(dxhat * xhat))
//   gated: dh = dh_out + dx (dh_out may be absent); dresidual = dh; dbranch = dh * gate;
//          dgate = dh * branch (summed over n when the gate is per sample)
//   The gated backward does not read a saved h: it recomputes h = residual + gate * branch from
//   the forward's inputs with the forward's arithmetic and rounding (the same bits), so a
//   training step keeps no copy of h for this op (it reads branch for dgate anyway: the same
//   bytes as reading h).
//
// Layout conventions. Every [B, N, D] input is a strided view (RowsView): element (b, n, d) is at
// `data + b * stride_b + n * stride_n + d` in ELEMENTS of its dtype; the last dimension is
// contiguous. A per-sample modulation is a view with stride_n == 0 (e.g. a [B, D] tensor or a
// chunk of [B, 6, D] / [B, 6*D]); a per-token one has stride_n != 0 (e.g. a chunk of [B, N, 6*D]:
// stride_n = 6*D). stride_b == 0 broadcasts over the batch in the forward; the backward still
// writes per-batch gradients ([B, D] / [B, N, D]) and the caller reduces broadcast dimensions.
// Every output buffer is contiguous. Reductions are deterministic: no float atomics; the same
// inputs on the same GPU give the same bits.
//
// Division of labour (docs/architecture.md, Conventions): the caller (the torch layer)
// allocates every output and the backward workspace (size from adaln_backward_workspace_bytes)
// and passes device pointers; these functions validate the params (throwing ditscale::Error
// naming the field) and launch on `stream`. The *_ref functions run the same math on host
// pointers in fp64.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ditscale/kernels/dtype.h"

namespace ditscale::kernels {

enum class NormType : int {
  kLayerNorm = 0,  // LayerNorm without affine: (x - mean) * rstd
  kRMSNorm = 1,    // x * rstd, rstd from the mean of squares
};

// A strided view of a [B, N, D] tensor (or [B, D] broadcast over N when stride_n == 0) whose
// last dimension is contiguous. Strides are in elements of `dtype`. data == nullptr means absent.
struct RowsView {
  const void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::int64_t stride_b = 0;  // elements between (b, n, d) and (b + 1, n, d)
  std::int64_t stride_n = 0;  // elements between (b, n, d) and (b, n + 1, d); 0 = per sample
};

// True when `view` varies along N (per-token modulation / gate).
inline bool is_per_token(const RowsView& view) { return view.stride_n != 0; }

// Fields shared by the forward and the backward.
struct AdaLNConfig {
  std::int64_t batch = 0;    // B >= 1
  std::int64_t seq_len = 0;  // N >= 1 (tokens per sample)
  std::int64_t dim = 0;      // D >= 1 (features; any value; D % 8 == 0 takes the fast path)
  NormType norm = NormType::kLayerNorm;
  float eps = 1e-6f;  // added to the variance (LayerNorm) / mean square (RMSNorm); > 0
  // Element type of x, residual, branch, y, h, dy, dh_out, dx, dbranch. bf16, fp16, fp32 on the
  // GPU; also fp64 in the CPU reference.
  DType dtype = DType::kBFloat16;

  // Optional elementwise affine of the norm, [D] contiguous each; null = absent.
  const void* weight = nullptr;
  const void* bias = nullptr;
  DType affine_dtype = DType::kFloat32;  // dtype of weight/bias/dweight/dbias: `dtype` or fp32

  // Modulation, required: y = xn * (1 + scale) + shift. dtype: `dtype` or fp32 (each on its own).
  RowsView scale;
  RowsView shift;

  // Gate of the gated residual variant (per sample or per token, dtype `dtype` or fp32).
  // gate.data == nullptr selects the plain variant.
  RowsView gate;
};

// Forward. Plain: reads x, writes y, mean, rstd. Gated: reads residual, gate, branch; writes
// h, y, mean, rstd.
struct AdaLNFwdParams : AdaLNConfig {
  RowsView x;         // plain variant: input [B, N, D] (dtype == dtype); must be null when gated
  RowsView residual;  // gated variant: [B, N, D] (dtype == dtype)
  RowsView branch;    // gated variant: [B, N, D] (dtype == dtype)

  void* y = nullptr;      // out, [B, N, D] contiguous, `dtype`
  void* h = nullptr;      // out (gated only, required there): [B, N, D] contiguous, `dtype`
  float* mean = nullptr;  // out, optional: [B * N] fp32 (row b * N + n); RMSNorm writes 0
  float* rstd = nullptr;  // out, optional: [B * N] fp32 (both null: inference, nothing saved)
};

// Backward. Inputs are what the forward saw/saved; every gradient output is optional (null = not
// wanted) except dx. Gradients have the dtype of the input they belong to.
struct AdaLNBwdParams : AdaLNConfig {
  RowsView x;                   // plain variant: the norm's input; must be null when gated
  RowsView residual;            // gated variant: the forward's residual (h is recomputed)
  const float* mean = nullptr;  // [B * N] fp32 from the forward (GPU reads them; the CPU
  const float* rstd = nullptr;  //  reference recomputes the statistics in fp64 and may get null)
  RowsView dy;                  // gradient of y, [B, N, D] (dtype == dtype)
  RowsView dh_out;              // gated only, optional: gradient of h from downstream
  RowsView branch;              // gated only, required (h = residual + gate * branch)

  void* dx = nullptr;       // out, required: [B, N, D] contiguous; gated: d residual (= dh)
  void* dbranch = nullptr;  // out, gated: [B, N, D] contiguous, `dtype`
  void* dscale = nullptr;   // out: per sample [B, D], per token [B, N, D]; scale.dtype
  void* dshift = nullptr;   // out: per sample [B, D], per token [B, N, D]; shift.dtype
  void* dweight = nullptr;  // out: [D], affine_dtype (only when weight != null)
  void* dbias = nullptr;    // out: [D], affine_dtype (only when bias != null)
  void* dgate = nullptr;    // out, gated: per sample [B, D], per token [B, N, D]; gate.dtype
  // Elements between the samples of a per-sample dscale / dshift / dgate (0 = D: contiguous
  // [B, D]); e.g. K * D to write them into rows of a zeroed [B, K, D] modulation gradient.
  // Per-token outputs are contiguous (must be 0).
  std::int64_t dscale_stride_b = 0;
  std::int64_t dshift_stride_b = 0;
  std::int64_t dgate_stride_b = 0;
  // Optional: the [B, dmod_rows, D] contiguous buffer (dtype dmod_dtype) that the per-sample
  // dscale / dshift / dgate above are rows of (each points at the start of one of its rows in
  // sample 0, with stride_b = dmod_rows * D), e.g. the gradient of a [B, 6, D] modulation tensor.
  // The backward writes zeros into every other row, so the buffer needs no zero fill first.
  // null: nothing outside the outputs is written.
  void* dmod = nullptr;
  std::int64_t dmod_rows = 0;
  DType dmod_dtype = DType::kBFloat16;

  // Device scratch of at least adaln_backward_workspace_bytes(*this) bytes, 16-byte aligned;
  // no initialisation needed. May be null when that size is 0.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

// Validation shared by the launchers and the references: throws ditscale::Error naming the
// offending field (e.g. "AdaLNFwdParams.scale.dtype: float16 but dtype is bfloat16"). Checks
// sizes, eps, required/forbidden pointers per variant, dtypes and that strides are >= 0.
// `for_gpu` additionally rejects fp64.
void adaln_check(const AdaLNFwdParams& p, bool for_gpu);
void adaln_check(const AdaLNBwdParams& p, bool for_gpu);

// Bytes of device workspace adaln_backward_cuda needs for `p` (depends on B, N, D, dtype and
// which reduced gradients are requested: per-sample dscale/dshift/dgate, dweight, dbias).
// Pure host arithmetic, no CUDA call; 0 when nothing is reduced over N.
std::size_t adaln_backward_workspace_bytes(const AdaLNBwdParams& p);

// CUDA launchers (defined only when the library is built with CUDA). `stream` is a
// cudaStream_t (nullptr = legacy default stream). Asynchronous; throw ditscale::Error on invalid
// params or a launch error. Pointers are device pointers.
void adaln_forward_cuda(const AdaLNFwdParams& p, void* stream);
void adaln_backward_cuda(const AdaLNBwdParams& p, void* stream);

// CPU references (always built): same params with host pointers, fp64 accumulation, results
// rounded once to the output dtype. Single-threaded; meant for tests and the torch CPU op.
void adaln_forward_ref(const AdaLNFwdParams& p);
void adaln_backward_ref(const AdaLNBwdParams& p);

}  // namespace ditscale::kernels
