// CUDA implementation of the fused AdaLN ops (schemas in adaln_ops.cc): tensor checks and
// allocation through adaln_prepare.h, then the launchers of ditscale/kernels/adaln.h on the
// current CUDA stream of x's device. The backward's workspace (per-block partial sums of the
// deterministic D-tile reduction) comes from the caching allocator.
// Compiled only when ditscale's CUDA kernels are built and torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "ditscale/kernels/adaln.h"
#include "ditscale/torch/adaln_prepare.h"

namespace ditscale::torch_ext {
namespace {

using Tensor = at::Tensor;

void* current_stream(const Tensor& x) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

void check_cuda(const char* op, const Tensor& x) {
  TORCH_CHECK(x.is_cuda(), op, ": CUDA implementation called with x on ", x.device());
}

void launch_backward(AdaLNBackwardCall& c, const Tensor& x) {
  const std::size_t bytes = kernels::adaln_backward_workspace_bytes(c.params);
  Tensor workspace;
  if (bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
    c.params.workspace = workspace.data_ptr();
    c.params.workspace_bytes = bytes;
  }
  // The workspace returns to the caching allocator when this function ends; the allocator
  // keeps it reserved for the current stream until the kernels queued on it have run.
  kernels::adaln_backward_cuda(c.params, current_stream(x));
}

std::tuple<Tensor, Tensor, Tensor> adaln_fwd_cuda(const Tensor& x, const Tensor& scale,
                                                  const Tensor& shift, const OptTensor& weight,
                                                  const OptTensor& bias, c10::string_view norm,
                                                  double eps) {
  const char* op = "ditscale::adaln_fwd";
  check_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, scale, shift,
                                             weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_cuda(c.params, current_stream(x));
  return {c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> adaln_bwd_cuda(
    const Tensor& dy, const Tensor& x, const Tensor& scale, const Tensor& shift,
    const OptTensor& weight, const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_bwd";
  check_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  AdaLNBackwardCall c =
      prepare_adaln_backward(op, false, std::nullopt, dy, x, std::nullopt, std::nullopt, scale,
                             shift, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) launch_backward(c, x);
  return {c.dx, c.dscale, c.dshift, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor> adaln_mod_fwd_cuda(const Tensor& x, const Tensor& mod,
                                                      int64_t scale_index, int64_t shift_index,
                                                      const OptTensor& weight,
                                                      const OptTensor& bias, c10::string_view norm,
                                                      double eps) {
  const char* op = "ditscale::adaln_mod_fwd";
  check_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  const ModRows m = packed_modulation(op, mod, scale_index, shift_index, x);
  AdaLNForwardCall c = prepare_adaln_forward(op, false, x, std::nullopt, std::nullopt, m.scale,
                                             m.shift, weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_cuda(c.params, current_stream(x));
  return {c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_mod_bwd_cuda(
    const Tensor& dy, const Tensor& x, const Tensor& mod, int64_t scale_index, int64_t shift_index,
    const OptTensor& weight, const OptTensor& bias, const Tensor& mean, const Tensor& rstd,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_mod_bwd";
  check_cuda(op, x);
  c10::cuda::CUDAGuard guard(x.device());
  AdaLNBackwardCall c =
      prepare_packed_adaln_backward(op, std::nullopt, dy, x, std::nullopt, mod, std::nullopt,
                                    scale_index, shift_index, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) launch_backward(c, x);
  return {c.dx, c.dmod, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_gated_fwd_cuda(
    const Tensor& residual, const Tensor& gate, const Tensor& branch, const Tensor& scale,
    const Tensor& shift, const OptTensor& weight, const OptTensor& bias, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_fwd";
  check_cuda(op, residual);
  c10::cuda::CUDAGuard guard(residual.device());
  AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, gate, branch, scale, shift, weight,
                                             bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_cuda(c.params, current_stream(residual));
  return {c.h, c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> adaln_gated_bwd_cuda(
    const OptTensor& dh, const Tensor& dy, const Tensor& h, const Tensor& gate,
    const Tensor& branch, const Tensor& scale, const Tensor& shift, const OptTensor& weight,
    const OptTensor& bias, const Tensor& mean, const Tensor& rstd, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_bwd";
  check_cuda(op, h);
  c10::cuda::CUDAGuard guard(h.device());
  AdaLNBackwardCall c = prepare_adaln_backward(op, true, dh, dy, h, gate, branch, scale, shift,
                                               weight, bias, mean, rstd, norm, eps);
  if (!c.empty) launch_backward(c, h);
  return {c.dx, c.dgate, c.dbranch, c.dscale, c.dshift, c.dweight, c.dbias};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> adaln_gated_mod_fwd_cuda(
    const Tensor& residual, const Tensor& branch, const Tensor& mod, int64_t gate_index,
    int64_t scale_index, int64_t shift_index, const OptTensor& weight, const OptTensor& bias,
    c10::string_view norm, double eps) {
  const char* op = "ditscale::adaln_gated_mod_fwd";
  check_cuda(op, residual);
  c10::cuda::CUDAGuard guard(residual.device());
  const ModRows m = packed_modulation(op, mod, scale_index, shift_index, residual, gate_index);
  AdaLNForwardCall c = prepare_adaln_forward(op, true, residual, m.gate, branch, m.scale, m.shift,
                                             weight, bias, norm, eps);
  if (!c.empty) kernels::adaln_forward_cuda(c.params, current_stream(residual));
  return {c.h, c.y, c.mean, c.rstd};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> adaln_gated_mod_bwd_cuda(
    const OptTensor& dh, const Tensor& dy, const Tensor& h, const Tensor& branch, const Tensor& mod,
    int64_t gate_index, int64_t scale_index, int64_t shift_index, const OptTensor& weight,
    const OptTensor& bias, const Tensor& mean, const Tensor& rstd, c10::string_view norm,
    double eps) {
  const char* op = "ditscale::adaln_gated_mod_bwd";
  check_cuda(op, h);
  c10::cuda::CUDAGuard guard(h.device());
  AdaLNBackwardCall c =
      prepare_packed_adaln_backward(op, dh, dy, h, branch, mod, gate_index, scale_index,
                                    shift_index, weight, bias, mean, rstd, norm, eps);
  if (!c.empty) launch_backward(c, h);
  return {c.dx, c.dbranch, c.dmod, c.dweight, c.dbias};
}

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_IMPL(ditscale, CUDA, m) {
  namespace ext = ditscale::torch_ext;
  m.impl("adaln_fwd", &ext::adaln_fwd_cuda);
  m.impl("adaln_bwd", &ext::adaln_bwd_cuda);
  m.impl("adaln_mod_fwd", &ext::adaln_mod_fwd_cuda);
  m.impl("adaln_mod_bwd", &ext::adaln_mod_bwd_cuda);
  m.impl("adaln_gated_fwd", &ext::adaln_gated_fwd_cuda);
  m.impl("adaln_gated_bwd", &ext::adaln_gated_bwd_cuda);
  m.impl("adaln_gated_mod_fwd", &ext::adaln_gated_mod_fwd_cuda);
  m.impl("adaln_gated_mod_bwd", &ext::adaln_gated_mod_bwd_cuda);
}
