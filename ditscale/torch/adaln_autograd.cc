// Autograd of the fused AdaLN forward ops (schemas in adaln_ops.cc), in C++: one kernel per
// forward op for the Autograd dispatch key, and one autograd Node per op for the backward.
//
// A forward kernel calls the op below autograd (redispatch past the Autograd keys, with
// AutoDispatchBelowADInplaceOrView so that the body's own ATen calls skip autograd too). When
// grad mode is on and an input requires grad it then records the call the way PyTorch's generated
// kernels do: a Node whose next edges are the tensor inputs' gradient edges, the differentiable
// outputs (y; gated: h, y) attached to it, and the tensors the backward op reads saved as
// SavedVariables (version-checked, visible to saved_tensors_hooks, released after backward). mean
// and rstd get no history (not differentiable). The Node's apply calls the backward op through
// the dispatcher, so AOTAutograd (torch.compile) traces the same ops as eager runs them; the
// fake kernels stay in Python (python/ditscale/_fake_kernels.py).
//
//   adaln_fwd: edges x, scale, shift, weight?, bias?; saves x, scale, shift, weight, bias, mean,
//     rstd; backward adaln_bwd.
//   adaln_mod_fwd: edges x, mod, weight?, bias?; saves x, mod, weight, bias, mean, rstd (and the
//     row indices); backward adaln_mod_bwd.
//   adaln_gated_fwd: edges residual, gate, branch, scale, shift, weight?, bias?; saves residual,
//     gate, branch, scale, shift, weight, bias, mean, rstd; backward adaln_gated_bwd.
//   adaln_gated_mod_fwd: edges residual, branch, mod, weight?, bias?; saves residual, branch,
//     mod, weight, bias, mean, rstd (and the row indices); backward adaln_gated_mod_bwd.
// (absent weight / bias saved as nothing). The gated nodes save no output: their backward
// recomputes h = residual + gate * branch (adaln.h), so h is freed as soon as nothing downstream
// holds it, and the residual (a block's input, most often held for another backward anyway) is
// kept instead.
//
// Unused outputs: a plain op whose y gets no gradient returns none; a gated op whose y gets none
// passes dy = zeros (dh may be absent), and one whose h and y get none returns none. Absent
// weight / bias get no gradient (the ops' [0] placeholders are dropped). The backward ops have no
// autograd (no double backward), as before.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "ditscale/torch/autograd_util.h"

namespace ditscale::torch_ext {
namespace {

using at::Tensor;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using OptTensor = std::optional<Tensor>;
using Tensor3 = std::tuple<Tensor, Tensor, Tensor>;
using Tensor4 = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Tensor5 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;
using Tensor7 = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

OptTensor as_optional(const Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// The gradient of an optional affine input: none when it was absent (the op's placeholder).
Tensor affine_grad(bool present, Tensor grad) { return present ? std::move(grad) : Tensor(); }

// State every AdaLN node keeps besides its tensors: the norm, eps, and which affine inputs exist.
struct NormState {
  std::string norm;
  double eps = 0.0;
  bool has_weight = false, has_bias = false;
  SavedVariable weight, bias, mean, rstd;

  void save(const OptTensor& w, const OptTensor& b, const Tensor& m, const Tensor& r) {
    has_weight = w.has_value() && w->defined();
    has_bias = b.has_value() && b->defined();
    weight = SavedVariable(w, false);
    bias = SavedVariable(b, false);
    mean = SavedVariable(m, false);
    rstd = SavedVariable(r, false);
  }
  void release() {
    weight.reset_data();
    bias.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

// A Node with the AdaLN ops' common state; T::backward(grads) does the op-specific part.
template <typename T>
struct AdaLNNode : Node {
  NormState s;
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<T*>(this)->backward(grads);
  }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    s.release();
    static_cast<T*>(this)->release_own();
  }
};

// ---- adaln_fwd ----

using AdaLNBwdSig = Tensor5(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const OptTensor&, const OptTensor&, const Tensor&, const Tensor&,
                            c10::string_view, double);

struct AdaLNBackward : AdaLNNode<AdaLNBackward> {
  SavedVariable x, scale, shift;
  std::string name() const override { return "DitscaleAdaLNBackward"; }
  void release_own() {
    x.reset_data();
    scale.reset_data();
    shift.reset_data();
  }
  variable_list backward(const variable_list& grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(5);
    static const auto op = typed_op<AdaLNBwdSig>("ditscale::adaln_bwd");
    auto [dx, dscale, dshift, dweight, dbias] =
        op.call(dy, x.unpack(), scale.unpack(), shift.unpack(), as_optional(s.weight.unpack()),
                as_optional(s.bias.unpack()), s.mean.unpack(), s.rstd.unpack(), s.norm, s.eps);
    return {std::move(dx), std::move(dscale), std::move(dshift),
            affine_grad(s.has_weight, std::move(dweight)),
            affine_grad(s.has_bias, std::move(dbias))};
  }
};

Tensor3 adaln_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const Tensor& scale,
                           const Tensor& shift, const OptTensor& weight, const OptTensor& bias,
                           c10::string_view norm, double eps) {
  static const auto op =
      typed_op<Tensor3(const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                       const OptTensor&, c10::string_view, double)>("ditscale::adaln_fwd");
  const bool grad = torch::autograd::compute_requires_grad(x, scale, shift, weight, bias);
  Tensor3 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.redispatch(ks & c10::after_autograd_keyset, x, scale, shift, weight, bias, norm, eps);
  }
  if (!grad) return out;
  auto node = new_node<AdaLNBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, scale, shift, weight, bias));
  torch::autograd::set_history(std::get<0>(out), node);
  node->x = SavedVariable(x, false);
  node->scale = SavedVariable(scale, false);
  node->shift = SavedVariable(shift, false);
  node->s.save(weight, bias, std::get<1>(out), std::get<2>(out));
  node->s.norm = std::string(norm);
  node->s.eps = eps;
  return out;
}

// ---- adaln_mod_fwd ----

using AdaLNModBwdSig = Tensor4(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                               const OptTensor&, const OptTensor&, const Tensor&, const Tensor&,
                               c10::string_view, double);

struct AdaLNModBackward : AdaLNNode<AdaLNModBackward> {
  SavedVariable x, mod;
  int64_t scale_index = 0, shift_index = 0;
  std::string name() const override { return "DitscaleAdaLNModBackward"; }
  void release_own() {
    x.reset_data();
    mod.reset_data();
  }
  variable_list backward(const variable_list& grads) {
    const Tensor& dy = grads[0];
    if (!dy.defined()) return variable_list(4);
    static const auto op = typed_op<AdaLNModBwdSig>("ditscale::adaln_mod_bwd");
    auto [dx, dmod, dweight, dbias] = op.call(
        dy, x.unpack(), mod.unpack(), scale_index, shift_index, as_optional(s.weight.unpack()),
        as_optional(s.bias.unpack()), s.mean.unpack(), s.rstd.unpack(), s.norm, s.eps);
    return {std::move(dx), std::move(dmod), affine_grad(s.has_weight, std::move(dweight)),
            affine_grad(s.has_bias, std::move(dbias))};
  }
};

Tensor3 adaln_mod_fwd_autograd(c10::DispatchKeySet ks, const Tensor& x, const Tensor& mod,
                               int64_t scale_index, int64_t shift_index, const OptTensor& weight,
                               const OptTensor& bias, c10::string_view norm, double eps) {
  static const auto op =
      typed_op<Tensor3(const Tensor&, const Tensor&, int64_t, int64_t, const OptTensor&,
                       const OptTensor&, c10::string_view, double)>("ditscale::adaln_mod_fwd");
  const bool grad = torch::autograd::compute_requires_grad(x, mod, weight, bias);
  Tensor3 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.redispatch(ks & c10::after_autograd_keyset, x, mod, scale_index, shift_index, weight,
                        bias, norm, eps);
  }
  if (!grad) return out;
  auto node = new_node<AdaLNModBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, mod, weight, bias));
  torch::autograd::set_history(std::get<0>(out), node);
  node->x = SavedVariable(x, false);
  node->mod = SavedVariable(mod, false);
  node->scale_index = scale_index;
  node->shift_index = shift_index;
  node->s.save(weight, bias, std::get<1>(out), std::get<2>(out));
  node->s.norm = std::string(norm);
  node->s.eps = eps;
  return out;
}

// ---- adaln_gated_fwd ----

using AdaLNGatedBwdSig = Tensor7(const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                                 const OptTensor&, const Tensor&, const Tensor&, c10::string_view,
                                 double);

struct AdaLNGatedBackward : AdaLNNode<AdaLNGatedBackward> {
  SavedVariable residual, gate, branch, scale, shift;
  std::string name() const override { return "DitscaleAdaLNGatedBackward"; }
  void release_own() {
    for (SavedVariable* v : {&residual, &gate, &branch, &scale, &shift}) v->reset_data();
  }
  variable_list backward(const variable_list& grads) {
    const Tensor& dh = grads[0];
    if (!dh.defined() && !grads[1].defined()) return variable_list(7);
    const Tensor res = residual.unpack();
    const Tensor dy = grads[1].defined() ? grads[1] : at::zeros_like(res);  // only h used
    static const auto op = typed_op<AdaLNGatedBwdSig>("ditscale::adaln_gated_bwd");
    auto [dres, dgate, dbranch, dscale, dshift, dweight, dbias] =
        op.call(as_optional(dh), dy, res, gate.unpack(), branch.unpack(), scale.unpack(),
                shift.unpack(), as_optional(s.weight.unpack()), as_optional(s.bias.unpack()),
                s.mean.unpack(), s.rstd.unpack(), s.norm, s.eps);
    return {std::move(dres),
            std::move(dgate),
            std::move(dbranch),
            std::move(dscale),
            std::move(dshift),
            affine_grad(s.has_weight, std::move(dweight)),
            affine_grad(s.has_bias, std::move(dbias))};
  }
};

Tensor4 adaln_gated_fwd_autograd(c10::DispatchKeySet ks, const Tensor& residual, const Tensor& gate,
                                 const Tensor& branch, const Tensor& scale, const Tensor& shift,
                                 const OptTensor& weight, const OptTensor& bias,
                                 c10::string_view norm, double eps) {
  static const auto op =
      typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                       const OptTensor&, const OptTensor&, c10::string_view, double)>(
          "ditscale::adaln_gated_fwd");
  const bool grad =
      torch::autograd::compute_requires_grad(residual, gate, branch, scale, shift, weight, bias);
  Tensor4 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.redispatch(ks & c10::after_autograd_keyset, residual, gate, branch, scale, shift,
                        weight, bias, norm, eps);
  }
  if (!grad) return out;
  auto node = new_node<AdaLNGatedBackward>();
  node->set_next_edges(
      torch::autograd::collect_next_edges(residual, gate, branch, scale, shift, weight, bias));
  torch::autograd::set_history(std::get<0>(out), node);  // h: input 0 of the node
  torch::autograd::set_history(std::get<1>(out), node);  // y: input 1
  node->residual = SavedVariable(residual, false);
  node->gate = SavedVariable(gate, false);
  node->branch = SavedVariable(branch, false);
  node->scale = SavedVariable(scale, false);
  node->shift = SavedVariable(shift, false);
  node->s.save(weight, bias, std::get<2>(out), std::get<3>(out));
  node->s.norm = std::string(norm);
  node->s.eps = eps;
  return out;
}

// ---- adaln_gated_mod_fwd ----

using AdaLNGatedModBwdSig = Tensor5(const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                                    const Tensor&, int64_t, int64_t, int64_t, const OptTensor&,
                                    const OptTensor&, const Tensor&, const Tensor&,
                                    c10::string_view, double);

struct AdaLNGatedModBackward : AdaLNNode<AdaLNGatedModBackward> {
  SavedVariable residual, branch, mod;
  int64_t gate_index = 0, scale_index = 0, shift_index = 0;
  std::string name() const override { return "DitscaleAdaLNGatedModBackward"; }
  void release_own() {
    residual.reset_data();
    branch.reset_data();
    mod.reset_data();
  }
  variable_list backward(const variable_list& grads) {
    const Tensor& dh = grads[0];
    if (!dh.defined() && !grads[1].defined()) return variable_list(5);
    const Tensor res = residual.unpack();
    const Tensor dy = grads[1].defined() ? grads[1] : at::zeros_like(res);  // only h used
    static const auto op = typed_op<AdaLNGatedModBwdSig>("ditscale::adaln_gated_mod_bwd");
    auto [dres, dbranch, dmod, dweight, dbias] =
        op.call(as_optional(dh), dy, res, branch.unpack(), mod.unpack(), gate_index, scale_index,
                shift_index, as_optional(s.weight.unpack()), as_optional(s.bias.unpack()),
                s.mean.unpack(), s.rstd.unpack(), s.norm, s.eps);
    return {std::move(dres), std::move(dbranch), std::move(dmod),
            affine_grad(s.has_weight, std::move(dweight)),
            affine_grad(s.has_bias, std::move(dbias))};
  }
};

Tensor4 adaln_gated_mod_fwd_autograd(c10::DispatchKeySet ks, const Tensor& residual,
                                     const Tensor& branch, const Tensor& mod, int64_t gate_index,
                                     int64_t scale_index, int64_t shift_index,
                                     const OptTensor& weight, const OptTensor& bias,
                                     c10::string_view norm, double eps) {
  static const auto op =
      typed_op<Tensor4(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, int64_t,
                       const OptTensor&, const OptTensor&, c10::string_view, double)>(
          "ditscale::adaln_gated_mod_fwd");
  const bool grad = torch::autograd::compute_requires_grad(residual, branch, mod, weight, bias);
  Tensor4 out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    out = op.redispatch(ks & c10::after_autograd_keyset, residual, branch, mod, gate_index,
                        scale_index, shift_index, weight, bias, norm, eps);
  }
  if (!grad) return out;
  auto node = new_node<AdaLNGatedModBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(residual, branch, mod, weight, bias));
  torch::autograd::set_history(std::get<0>(out), node);  // h: input 0 of the node
  torch::autograd::set_history(std::get<1>(out), node);  // y: input 1
  node->residual = SavedVariable(residual, false);
  node->branch = SavedVariable(branch, false);
  node->mod = SavedVariable(mod, false);
  node->gate_index = gate_index;
  node->scale_index = scale_index;
  node->shift_index = shift_index;
  node->s.save(weight, bias, std::get<2>(out), std::get<3>(out));
  node->s.norm = std::string(norm);
  node->s.eps = eps;
  return out;
}

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_IMPL(ditscale, Autograd, m) {
  using namespace ditscale::torch_ext;
  m.impl("adaln_fwd", TORCH_FN(adaln_fwd_autograd));
  m.impl("adaln_mod_fwd", TORCH_FN(adaln_mod_fwd_autograd));
  m.impl("adaln_gated_fwd", TORCH_FN(adaln_gated_fwd_autograd));
  m.impl("adaln_gated_mod_fwd", TORCH_FN(adaln_gated_mod_fwd_autograd));
}
