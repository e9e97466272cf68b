// Tensor checks and allocation of the fused AdaLN torch ops, shared by the CPU implementation
// (adaln_ops.cc, through the fp64 reference) and the CUDA implementation (adaln_cuda.cc).
//
// Every user-facing check lives here (devices, dtypes, shapes, strides, eps, norm), with a
// TORCH_CHECK message naming the op, the argument and its value. The device check is one call for
// all tensor arguments (check_same_device), made first by every op body (adaln_impl.h) on CPU and
// CUDA alike; the fake kernels (python/ditscale/_fake_kernels.py) raise the same text for meta /
// fake tensors. The prepared call holds a params struct of
// ditscale/kernels/adaln.h pointing into tensors it keeps alive (the outputs, and the contiguous
// copies made of inputs whose last dimension was not contiguous).
//
// Accepted layouts:
//   x / residual / branch / dy / dh: [B, N, D], any strides with a contiguous last dimension
//     (otherwise a contiguous copy is made); dtype bf16, fp16, fp32 (fp64 on CPU only).
//   scale / shift / gate: per sample [B, D] or per token [B, N, D], x's dtype or fp32, strided
//     views read in place when the last dimension is contiguous. A [B, N, D] view with stride 0
//     along N (an expanded per-sample tensor) is read in place by the forward; the backward
//     copies it (its gradient is per token).
//   weight / bias: [D], x's dtype or fp32 (the same dtype when both are given).
//   mean / rstd: [B, N] fp32 as written by the forward.
//   eps: in [kMinEps, kMaxEps] (finite, > 0, a normal float32 once rounded for the kernels).
//   norm: "layernorm" or "rmsnorm".
// Outputs are new contiguous tensors; gradients have the dtype and shape of their input. An
// absent weight/bias gets an empty [0] fp32 gradient placeholder.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include "ditscale/kernels/adaln.h"

namespace ditscale::torch_ext {

using OptTensor = std::optional<at::Tensor>;

// The documented range of eps (python/ditscale/_adaln_checks.py: EPS_RANGE): the kernels add it
// in fp32.
inline constexpr double kMinEps = 1e-30;
inline constexpr double kMaxEps = 1e30;

// One tensor argument of an op for check_same_device: its schema name and the tensor (an absent
// optional or an undefined tensor is skipped).
struct NamedTensor {
  const char* name;
  const at::Tensor* tensor;
  NamedTensor(const char* n, const at::Tensor& t) : name(n), tensor(&t) {}
  NamedTensor(const char* n, const OptTensor& t) : name(n), tensor(t ? &*t : nullptr) {}
};

// Every defined tensor must be on the device of the first one, as PyTorch's own ops require:
// otherwise a RuntimeError "<op>: expected all tensors to be on the same device, but got <name>
// on <device>, different from <first name> on <device>".
void check_same_device(const char* op, std::initializer_list<NamedTensor> tensors);

// A forward call: params ready for adaln_forward_{ref,cuda}, plus its outputs.
struct AdaLNForwardCall {
  kernels::AdaLNFwdParams params;
  at::Tensor h;                  // gated only: [B, N, D]
  at::Tensor y;                  // [B, N, D]
  at::Tensor mean;               // [B, N] fp32
  at::Tensor rstd;               // [B, N] fp32
  bool empty = false;            // B * N == 0: nothing to launch, outputs are empty
  std::vector<at::Tensor> keep;  // inputs referenced by params (contiguous copies)
};

// A backward call: params ready for adaln_backward_{ref,cuda} (workspace not yet set), plus
// its outputs.
struct AdaLNBackwardCall {
  kernels::AdaLNBwdParams params;
  at::Tensor dx;       // plain: dx; gated: d residual
  at::Tensor dbranch;  // gated only
  at::Tensor dgate;    // gated only
  at::Tensor dscale, dshift, dweight, dbias;
  at::Tensor dmod;  // packed ops only: the [B, K, D] gradient of mod that dscale / dshift / dgate
                    // are rows of
  bool empty = false;
  std::vector<at::Tensor> keep;
};

// Checks and allocates the forward. `gated` selects the variant: plain uses x; gated uses
// residual (passed as x), gate and branch.
AdaLNForwardCall prepare_adaln_forward(const char* op, bool gated, const at::Tensor& x,
                                       const OptTensor& gate, const OptTensor& branch,
                                       const at::Tensor& scale, const at::Tensor& shift,
                                       const OptTensor& weight, const OptTensor& bias,
                                       std::string_view norm, double eps);

// Checks and allocates the backward. `x` is the forward's input (plain: x, the norm's input;
// gated: residual, from which the kernels recompute h = residual + gate * branch). Gated only: dh
// (optional), gate, branch. `eps` is the forward's (the CPU reference recomputes the statistics
// from the norm's input).
AdaLNBackwardCall prepare_adaln_backward(const char* op, bool gated, const OptTensor& dh,
                                         const at::Tensor& dy, const at::Tensor& x,
                                         const OptTensor& gate, const OptTensor& branch,
                                         const at::Tensor& scale, const at::Tensor& shift,
                                         const OptTensor& weight, const OptTensor& bias,
                                         const at::Tensor& mean, const at::Tensor& rstd,
                                         std::string_view norm, double eps);

// Packed per-sample modulation (the adaln_mod_* and adaln_gated_mod_* ops): mod is [B, K, D]
// (x's dtype or fp32, any strides), scale = mod[:, scale_index], shift = mod[:, shift_index] and,
// when gate_index is given, gate = mod[:, gate_index] (distinct rows). Checks and returns the [B,
// D] views (read in place when mod's last dimension is contiguous).
struct ModRows {
  at::Tensor scale, shift, gate;
};
ModRows packed_modulation(const char* op, const at::Tensor& mod, int64_t scale_index,
                          int64_t shift_index, const at::Tensor& x,
                          std::optional<int64_t> gate_index = std::nullopt);

// The packed backward (adaln_mod_bwd; adaln_gated_mod_bwd when gate_index is given, with dh and
// branch as in prepare_adaln_backward): scale, shift (and gate) are those rows of mod, checked by
// packed_modulation. c.dmod is a new [B, K, D] gradient of mod (mod's dtype) whose rows dscale /
// dshift / dgate point at; the backward fills them and zeroes the other rows
// (AdaLNBwdParams::dmod): no fill kernel, no copy.
AdaLNBackwardCall prepare_packed_adaln_backward(
    const char* op, const OptTensor& dh, const at::Tensor& dy, const at::Tensor& x,
    const OptTensor& branch, const at::Tensor& mod, std::optional<int64_t> gate_index,
    int64_t scale_index, int64_t shift_index, const OptTensor& weight, const OptTensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::string_view norm, double eps);

}  // namespace ditscale::torch_ext
