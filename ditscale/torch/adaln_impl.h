// The bodies of the fused AdaLN torch ops (schemas in adaln_ops.cc), one implementation for every
// backend: the device check of all tensor arguments, then the checks and output allocation of
// adaln_prepare.h, then the backend's launch. A backend is a type with
//   static void forward(kernels::AdaLNFwdParams& p, const at::Tensor& x);
//   static void backward(AdaLNBackwardCall& c, const at::Tensor& x);
// called only when there is work (B * N > 0); `x` is the op's activation tensor (x, residual or
// h), whose device the call runs on. CpuAdaLN (adaln_ops.cc) runs the fp64 reference, CudaAdaLN
// (adaln_cuda.cc) the CUDA launchers. AdaLNOps<Backend>::register_all(m) registers the eight ops
// for one dispatch key.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "ditscale/torch/adaln_prepare.h"

namespace ditscale::torch_ext {

template <typename Backend>
struct AdaLNOps {
  using Tensor = at::Tensor;
  using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
  using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
  using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
  using Tensor7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

  static void forward(AdaLNForwardCall& c, const Tensor& x) {
    if (!c.empty) Backend::forward(c.params, x);
  }
  static void backward(AdaLNBackwardCall& c, const Tensor& x) {
    if (!c.empty) Backend::backward(c, x);
  }

  static Tensor3 adaln_fwd(const Tensor& x, const Tensor& scale, const Tensor& shift,
                           const OptTensor& weight, const OptTensor& bias, c10::string_view norm,
                           double eps) {
    const char* op = "ditscale::adaln_fwd";
    check_same_device(
        op, {{"x", x}, {"scale", scale}, {"shift", shift}, {"weight", weight}, {"bias", bias}});
    AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, scale,
                                               shift, weight, bias, norm, eps);
    forward(c, x);
    return {c.y, c.mean, c.rstd};
  }

  static Tensor5 adaln_bwd(const Tensor& dy, const Tensor& x, const Tensor& scale,
                           const Tensor& shift, const OptTensor& weight, const OptTensor& bias,
                           const Tensor& mean, const Tensor& rstd, c10::string_view norm,
                           double eps) {
    const char* op = "ditscale::adaln_bwd";
    check_same_device(op, {{"dy", dy},
                           {"x", x},
                           {"scale", scale},
                           {"shift", shift},
                           {"weight", weight},
                           {"bias", bias},
                           {"mean", mean},
                           {"rstd", rstd}});
    AdaLNBackwardCall c =
        prepare_adaln_backward(op, false, std::nullopt, dy, x, std::nullopt, std::nullopt, scale,
                               shift, weight, bias, mean, rstd, norm, eps);
    backward(c, x);
    return {c.dx, c.dscale, c.dshift, c.dweight, c.dbias};
  }

  static Tensor3 adaln_mod_fwd(const Tensor& x, const Tensor& mod, int64_t scale_index,
                               int64_t shift_index, const OptTensor& weight, const OptTensor& bias,
                               c10::string_view norm, double eps) {
    const char* op = "ditscale::adaln_mod_fwd";
    check_same_device(op, {{"x", x}, {"mod", mod}, {"weight", weight}, {"bias", bias}});
    const ModRows m = packed_modulation(op, mod, scale_index, shift_index, x);
    AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, m.scale,
                                               m.shift, weight, bias, norm, eps);
    forward(c, x);
    return {c.y, c.mean, c.rstd};
  }

  static Tensor4 adaln_mod_bwd(const Tensor& dy, const Tensor& x, const Tensor& mod,
                               int64_t scale_index, int64_t shift_index, const OptTensor& weight,
                               const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
                               c10::string_view norm, double eps) {
    const char* op = "ditscale::adaln_mod_bwd";
    check_same_device(op, {{"dy", dy},
                           {"x", x},
                           {"mod", mod},
                           {"weight", weight},
                           {"bias", bias},
                           {"mean", mean},
                           {"rstd", rstd}});
    AdaLNBackwardCall c = prepare_packed_adaln_backward(op, std::nullopt, dy, x, std::nullopt, mod,
                                                        std::nullopt, scale_index, shift_index,
                                                        weight, bias, mean, rstd, norm, eps);
    backward(c, x);
    return {c.dx, c.dmod, c.dweight, c.dbias};
  }

  static Tensor4 adaln_gated_fwd(const Tensor& residual, const Tensor& gate, const Tensor& branch,
                                 const Tensor& scale, const Tensor& shift, const OptTensor& weight,
                                 const OptTensor& bias, c10::string_view norm, double eps) {
    const char* op = "ditscale::adaln_gated_fwd";
    check_same_device(op, {{"residual", residual},
                           {"gate", gate},
                           {"branch", branch},
                           {"scale", scale},
                           {"shift", shift},
                           {"weight", weight},
                           {"bias", bias}});
    AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, gate, branch, scale, shift,
                                               weight, bias, norm, eps);
    forward(c, residual);
    return {c.h, c.y, c.mean, c.rstd};
  }

  static Tensor7 adaln_gated_bwd(const OptTensor& dh, const Tensor& dy, const Tensor& residual,
                                 const Tensor& gate, const Tensor& branch, const Tensor& scale,
                                 const Tensor& shift, const OptTensor& weight,
                                 const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
                                 c10::string_view norm, double eps) {
    const char* op = "ditscale::adaln_gated_bwd";
    check_same_device(op, {{"dh", dh},
                           {"dy", dy},
                           {"residual", residual},
                           {"gate", gate},
                           {"branch", branch},
                           {"scale", scale},
                           {"shift", shift},
                           {"weight", weight},
                           {"bias", bias},
                           {"mean", mean},
                           {"rstd", rstd}});
    AdaLNBackwardCall c = prepare_adaln_backward(op, true, dh, dy, residual, gate, branch, scale,
                                                 shift, weight, bias, mean, rstd, norm, eps);
    backward(c, residual);
    return {c.dx, c.dgate, c.dbranch, c.dscale, c.dshift, c.dweight, c.dbias};
  }

  static Tensor4 adaln_gated_mod_fwd(const Tensor& residual, const Tensor& branch,
                                     const Tensor& mod, int64_t gate_index, int64_t scale_index,
                                     int64_t shift_index, const OptTensor& weight,
                                     const OptTensor& bias, c10::string_view norm, double eps) {
    const char* op = "ditscale::adaln_gated_mod_fwd";
    check_same_device(op, {{"residual", residual},
                           {"branch", branch},
                           {"mod", mod},
                           {"weight", weight},
                           {"bias", bias}});
    const ModRows m = packed_modulation(op, mod, scale_index, shift_index, residual, gate_index);
    AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, m.gate, branch, m.scale, m.shift,
                                               weight, bias, norm, eps);
    forward(c, residual);
    return {c.h, c.y, c.mean, c.rstd};
  }

  static Tensor5 adaln_gated_mod_bwd(const OptTensor& dh, const Tensor& dy, const Tensor& residual,
                                     const Tensor& branch, const Tensor& mod, int64_t gate_index,
                                     int64_t scale_index, int64_t shift_index,
                                     const OptTensor& weight, const OptTensor& bias,
                                     const Tensor& mean, const Tensor& rstd, c10::string_view norm,
                                     double eps) {
    const char* op = "ditscale::adaln_gated_mod_bwd";
    check_same_device(op, {{"dh", dh},
                           {"dy", dy},
                           {"residual", residual},
                           {"branch", branch},
                           {"mod", mod},
                           {"weight", weight},
                           {"bias", bias},
                           {"mean", mean},
                           {"rstd", rstd}});
    AdaLNBackwardCall c =
        prepare_packed_adaln_backward(op, dh, dy, residual, branch, mod, gate_index, scale_index,
                                      shift_index, weight, bias, mean, rstd, norm, eps);
    backward(c, residual);
    return {c.dx, c.dbranch, c.dmod, c.dweight, c.dbias};
  }

  static void register_all(torch::Library& m) {
    m.impl("adaln_fwd", &adaln_fwd);
    m.impl("adaln_bwd", &adaln_bwd);
    m.impl("adaln_mod_fwd", &adaln_mod_fwd);
    m.impl("adaln_mod_bwd", &adaln_mod_bwd);
    m.impl("adaln_gated_fwd", &adaln_gated_fwd);
    m.impl("adaln_gated_bwd", &adaln_gated_bwd);
    m.impl("adaln_gated_mod_fwd", &adaln_gated_mod_fwd);
    m.impl("adaln_gated_mod_bwd", &adaln_gated_mod_bwd);
  }
};

}  // namespace ditscale::torch_ext
