// Autograd of the torch op ditscale::rotary (schema in rotary_ops.cc), in C++ (no Python on the
// eager path). The rotation is linear in x, so its backward is the inverse rotation of the
// gradient: dx = rotary(dy, cos, sin, !inverse). The node saves cos and sin only (not x); cos and
// sin get no gradient (a call where one requires grad is refused: the op would silently drop
// it). As for the AdaLN ops (adaln_autograd.cc), the forward kernel redispatches below autograd
// and records the node; AOTAutograd traces the same calls.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <mutex>

#include "ditscale/torch/autograd_util.h"

namespace ditscale::torch_ext {
namespace {

using at::Tensor;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;
using RotarySig = Tensor(const Tensor&, const Tensor&, const Tensor&, bool);

struct RotaryBackward : torch::autograd::Node {
  SavedVariable cos, sin;
  bool inverse = false;
  std::string name() const override { return "DitscaleRotaryBackward"; }
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!grads[0].defined()) return variable_list(3);
    static const auto op = typed_op<RotarySig>("ditscale::rotary");
    return {op.call(grads[0], cos.unpack(), sin.unpack(), !inverse), Tensor(), Tensor()};
  }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    cos.reset_data();
    sin.reset_data();
  }
};

Tensor rotary_autograd(c10::DispatchKeySet ks, const Tensor& x, const Tensor& cos,
                       const Tensor& sin, bool inverse) {
  static const auto op = typed_op<RotarySig>("ditscale::rotary");
  TORCH_CHECK(!(at::GradMode::is_enabled() && (cos.requires_grad() || sin.requires_grad())),
              "ditscale.ops.rotary: cos and sin get no gradient, but one of them requires grad "
              "(detach them, or use the reference formula for trainable frequencies)");
  const bool grad = torch::autograd::compute_requires_grad(x);
  Tensor y;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    y = op.redispatch(ks & c10::after_autograd_keyset, x, cos, sin, inverse);
  }
  if (!grad) return y;
  auto node = new_node<RotaryBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, cos, sin));
  torch::autograd::set_history(y, node);
  node->cos = SavedVariable(cos, false);
  node->sin = SavedVariable(sin, false);
  node->inverse = inverse;
  return y;
}

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_IMPL(ditscale, Autograd, m) {
  m.impl("rotary", TORCH_FN(ditscale::torch_ext::rotary_autograd));
}
