// Schemas of the fused AdaLN ops (torch.ops.ditscale.*) and their CPU implementation, which runs
// the fp64-accumulating reference of ditscale/kernels (the CUDA implementation is in
// adaln_cuda.cc). Autograd formulas and fake kernels are registered from Python
// (python/ditscale/ops.py), which names itself below through set_python_module.
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
// adaln_gated_mod_bwd(dh?, dy, h, branch, mod, gate_index, scale_index, shift_index, weight?,
//   bias?, mean, rstd, norm, eps) -> (dresidual, dbranch, dmod, dweight, dbias).
// adaln_gated_bwd(dh?, dy, h, gate, branch, scale, shift, weight?, bias?, mean, rstd, norm, eps)
//   -> (dresidual, dgate, dbranch, dscale, dshift, dweight, dbias).
// Layouts and checks: see adaln_prepare.h.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "ditscale/kernels/adaln.h"
#include "ditscale/torch/adaln_prepare.h"

namespace ditscale::torch_ext {
namespace {

using Tensor = at::Tensor;

void check_cpu(const char* op, const Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), op, ": CPU implementation called with x on ", x.device());
}

std::tuple<Tensor, Tensor, Tensor> adaln_fwd_cpu(const Tensor& x, const Tensor& scale,
                                                 const Tensor& shift, const OptTensor& weight,
                                                 const OptTensor& bias, c10::string_view norm,
                                                 double eps) {
  const char* op = "ditscale::adaln_fwd";
  check_cpu(op, x);
  AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, scale, shift,
                                             weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_ref(c.params);
  return {c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> adaln_bwd_cpu(
    const Tensor& dy, const Tensor& x, const Tensor& scale, const Tensor& shift,
    const OptTensor& weight, const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_bwd";
  check_cpu(op, x);
  AdaLNBackwardCall c =
      prepare_adaln_backward(op, false, std::nullopt, dy, x, std::nullopt, std::nullopt, scale,
                             shift, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) kernels::adaln_backward_ref(c.params);
  return {c.dx, c.dscale, c.dshift, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor> adaln_mod_fwd_cpu(const Tensor& x, const Tensor& mod,
                                                     int64_t scale_index, int64_t shift_index,
                                                     const OptTensor& weight, const OptTensor& bias,
                                                     c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_mod_fwd";
  check_cpu(op, x);
  const ModRows m = packed_modulation(op, mod, scale_index, shift_index, x);
  AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, m.scale,
                                             m.shift, weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_ref(c.params);
  return {c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_mod_bwd_cpu(
    const Tensor& dy, const Tensor& x, const Tensor& mod, int64_t scale_index, int64_t shift_index,
    const OptTensor& weight, const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_mod_bwd";
  check_cpu(op, x);
  AdaLNBackwardCall c =
      prepare_packed_adaln_backward(op, std::nullopt, dy, x, std::nullopt, mod, std::nullopt,
                                    scale_index, shift_index, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) kernels::adaln_backward_ref(c.params);
  return {c.dx, c.dmod, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_gated_fwd_cpu(
    const Tensor& residual, const Tensor& gate, const Tensor& branch, const Tensor& scale,
    const Tensor& shift, const OptTensor& weight, const OptTensor& bias, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_fwd";
  check_cpu(op, residual);
  AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, gate, branch, scale, shift, weight,
                                             bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_ref(c.params);
  return {c.h, c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> adaln_gated_bwd_cpu(
    const OptTensor& dh, const Tensor& dy, const Tensor& h, const Tensor& gate,
    const Tensor& branch, const Tensor& scale, const Tensor& shift, const OptTensor& weight,
    const OptTensor& bias, const Tensor& mean, const Tensor& rstd, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_bwd";
  check_cpu(op, h);
  AdaLNBackwardCall c = prepare_adaln_backward(op, true, dh, dy, h, gate, branch, scale, shift,
                                               weight, bias, mean, rstd, norm, eps);
  if (!c.empty) kernels::adaln_backward_ref(c.params);
  return {c.dx, c.dgate, c.dbranch, c.dscale, c.dshift, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_gated_mod_fwd_cpu(
    const Tensor& residual, const Tensor& branch, const Tensor& mod, int64_t gate_index,
    int64_t scale_index, int64_t shift_index, const OptTensor& weight, const OptTensor& bias,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_gated_mod_fwd";
  check_cpu(op, residual);
  const ModRows m = packed_modulation(op, mod, scale_index, shift_index, residual, gate_index);
  AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, m.gate, branch, m.scale, m.shift,
                                             weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_ref(c.params);
  return {c.h, c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> adaln_gated_mod_bwd_cpu(
    const OptTensor& dh, const Tensor& dy, const Tensor& h, const Tensor& branch, const Tensor& mod,
    int64_t gate_index, int64_t scale_index, int64_t shift_index, const OptTensor& weight,
    const OptTensor& bias, const Tensor& mean, const Tensor& rstd, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_mod_bwd";
  check_cpu(op, h);
  AdaLNBackwardCall c =
      prepare_packed_adaln_backward(op, dh, dy, h, branch, mod, gate_index, scale_index,
                                    shift_index, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) kernels::adaln_backward_ref(c.params);
  return {c.dx, c.dbranch, c.dmod, c.dweight, c.dbias};
}

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY(ditscale, m) {
  m.set_python_module("ditscale.ops");
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
      "adaln_gated_bwd(Tensor? dh, Tensor dy, Tensor h, Tensor gate, Tensor branch, "
      "Tensor scale, Tensor shift, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
      "str norm, float eps) -> (Tensor dresidual, Tensor dgate, Tensor dbranch, Tensor dscale, "
      "Tensor dshift, Tensor dweight, Tensor dbias)");
  m.def(
      "adaln_gated_mod_fwd(Tensor residual, Tensor branch, Tensor mod, int gate_index, "
      "int scale_index, int shift_index, Tensor? weight, Tensor? bias, str norm, float eps) -> "
      "(Tensor h, Tensor y, Tensor mean, Tensor rstd)");
  m.def(
      "adaln_gated_mod_bwd(Tensor? dh, Tensor dy, Tensor h, Tensor branch, Tensor mod, "
      "int gate_index, int scale_index, int shift_index, Tensor? weight, Tensor? bias, "
      "Tensor mean, Tensor rstd, str norm, float eps) -> (Tensor dresidual, Tensor dbranch, "
      "Tensor dmod, Tensor dweight, Tensor dbias)");
}

TORCH_LIBRARY_IMPL(ditscale, CPU, m) {
  namespace ext = ditscale::torch_ext;
  m.impl("adaln_fwd", &ext::adaln_fwd_cpu);
  m.impl("adaln_bwd", &ext::adaln_bwd_cpu);
  m.impl("adaln_mod_fwd", &ext::adaln_mod_fwd_cpu);
  m.impl("adaln_mod_bwd", &ext::adaln_mod_bwd_cpu);
  m.impl("adaln_gated_fwd", &ext::adaln_gated_fwd_cpu);
  m.impl("adaln_gated_bwd", &ext::adaln_gated_bwd_cpu);
  m.impl("adaln_gated_mod_fwd", &ext::adaln_gated_mod_fwd_cpu);
  m.impl("adaln_gated_mod_bwd", &ext::adaln_gated_mod_bwd_cpu);
}
