// Schemas of the fused AdaLN ops (torch.ops.ditscale.*) and their CPU backend, which runs the
// fp64-accumulating reference of ditscale/kernels (the op bodies, shared with the CUDA backend of
// adaln_cuda.cc, are in adaln_impl.h). Autograd formulas are in adaln_autograd.cc; the fake
// kernels are registered from Python (python/ditscale/_fake_kernels.py), named below through
// set_python_module (torch imports it when it needs a fake kernel).
//
// Every op is functional: outputs are new tensors, no input is mutated or aliased, so the
// schemas carry no alias annotations ((a!) / (a)); that is what lets torch.compile and
// functionalization treat them as pure.
//
// adaln_fwd(x, scale, shift, weight?, bias?, norm, eps) -> (y, mean, rstd)
//   y = norm(x) [* weight + bias] * (1 + scale) + shift; mean, rstd: [B, N] fp32 statistics
//   (RMSNorm writes mean = 0).
// adaln_bwd(dy, x, scale, shift, weight?, bias?, mean, rstd, norm, eps)
//   -> (dx, dscale, dshift, dweight, dbias); dweight/dbias are empty [0] when weight/bias absent.
// adaln_mod_fwd(x, mod, scale_index, shift_index, weight?, bias?, norm, eps) -> (y, mean, rstd)
//   adaln_fwd with scale = mod[:, scale_index], shift = mod[:, shift_index] (mod [B, K, D]).
// adaln_mod_bwd(dy, x, mod, scale_index, shift_index, weight?, bias?, mean, rstd, norm, eps)
//   -> (dx, dmod, dweight, dbias): dmod [B, K, D] holds dscale / dshift in their rows, zeros
//   elsewhere (written by the backward's reduction directly, no select_backward copies).
// adaln_gated_fwd(residual, gate, branch, scale, shift, weight?, bias?, norm, eps)
//   -> (h, y, mean, rstd) with h = residual + gate * branch, y = adaln(h).
// adaln_gated_mod_fwd(residual, branch, mod, gate_index, scale_index, shift_index, weight?,
//   bias?, norm, eps) -> (h, y, mean, rstd): adaln_gated_fwd with gate / scale / shift as rows of
//   mod [B, K, D].
// adaln_gated_mod_bwd(dh?, dy, residual, branch, mod, gate_index, scale_index, shift_index,
//   weight?, bias?, mean, rstd, norm, eps) -> (dresidual, dbranch, dmod, dweight, dbias).
// adaln_gated_bwd(dh?, dy, residual, gate, branch, scale, shift, weight?, bias?, mean, rstd, norm,
//   eps) -> (dresidual, dgate, dbranch, dscale, dshift, dweight, dbias).
// The gated backward ops take the forward's residual, not its output h: they recompute h =
// residual + gate * branch with the forward's rounding, so autograd (and AOTAutograd's partition
// under torch.compile) keeps no copy of h for them.
// Layouts and checks: see adaln_prepare.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ditscale/kernels/adaln.h"
#include "ditscale/torch/adaln_impl.h"

namespace ditscale::torch_ext {
namespace {

struct CpuAdaLN {
  static void forward(kernels::AdaLNFwdParams& p, const at::Tensor&) {
    kernels::adaln_forward_ref(p);
  }
  static void backward(AdaLNBackwardCall& c, const at::Tensor&) {
    kernels::adaln_backward_ref(c.params);
  }
};

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY(ditscale, m) {
  m.set_python_module("ditscale._fake_kernels");
  m.def(
      "adaln_fwd(Tensor x, Tensor scale, Tensor shift, Tensor? weight, Tensor? bias, str norm, "
      "float eps) -> (Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "adaln_bwd(Tensor dy, Tensor x, Tensor scale, Tensor shift, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, str norm, float eps) -> (Tensor dx, Tensor dscale, "
      "Tensor dshift, Tensor dweight, Tensor dbias)");
  m.def(
      "adaln_mod_fwd(Tensor x, Tensor mod, int scale_index, int shift_index, Tensor? weight, "
      "Tensor? bias, str norm, float eps) -> (Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "adaln_mod_bwd(Tensor dy, Tensor x, Tensor mod, int scale_index, int shift_index, "
      "Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, str norm, float eps) -> "
      "(Tensor dx, Tensor dmod, Tensor dweight, Tensor dbias)");
  m.def(
      "adaln_gated_fwd(Tensor residual, Tensor gate, Tensor branch, Tensor scale, Tensor shift, "
      "Tensor? weight, Tensor? bias, str norm, float eps) -> (Tensor h, Tensor y, Tensor mean, "
      "Tensor rstd)");
  m.def(
      "adaln_gated_bwd(Tensor? dh, Tensor dy, Tensor residual, Tensor gate, Tensor branch, "
      "Tensor scale, Tensor shift, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "str norm, float eps) -> (Tensor dresidual, Tensor dgate, Tensor dbranch, Tensor dscale, "
      "Tensor dshift, Tensor dweight, Tensor dbias)");
  m.def(
      "adaln_gated_mod_fwd(Tensor residual, Tensor branch, Tensor mod, int gate_index, "
      "int scale_index, int shift_index, Tensor? weight, Tensor? bias, str norm, float eps) -> "
      "(Tensor h, Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "adaln_gated_mod_bwd(Tensor? dh, Tensor dy, Tensor residual, Tensor branch, Tensor mod, "
      "int gate_index, int scale_index, int shift_index, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, str norm, float eps) -> (Tensor dresidual, Tensor dbranch, "
      "Tensor dmod, Tensor dweight, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(ditscale, CPU, m) {
  ditscale::torch_ext::AdaLNOps<ditscale::torch_ext::CpuAdaLN>::register_all(m);
}
