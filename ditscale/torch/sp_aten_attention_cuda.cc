// AtenAttention (sp_aten_attention.h): cuDNN / flash attention through ATen for the executor.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "ditscale/torch/sp_aten_attention.h"

namespace ditscale::torch_ext {
namespace {

using at::Tensor;

at::ScalarType ScalarOf(kernels::DType d) {
  switch (d) {
    case kernels::DType::kBFloat16:
      return at::kBFloat16;
    case kernels::DType::kFloat16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

// [B, T, H, W] strided view -> a [B, H, T, W] tensor over the same memory.
Tensor AsBhtd(const runtime::StridedView& v, at::ScalarType dtype, int device) {
  return at::from_blob(v.data, {v.batch, v.heads, v.tokens, v.width},
                       {v.stride_b, v.stride_h, v.stride_t, 1},
                       at::TensorOptions().dtype(dtype).device(at::kCUDA, device));
}

}  // namespace

void AtenAttention::Attention(const runtime::AttentionArgs& a, void* stream) {
  c10::cuda::CUDAStreamGuard guard(
      c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device_));
  const at::ScalarType dt = ScalarOf(a.dtype);
  Tensor out = AsBhtd(a.out, dt, device_);
  Tensor lse = at::from_blob(a.lse.data, {a.lse.batch, a.lse.heads, a.lse.tokens},
                             {a.lse.stride_b, a.lse.stride_h, a.lse.stride_t},
                             at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
  if (a.q.tokens == 0 || a.q.heads == 0) return;
  if (a.k.tokens == 0) {  // no keys: the partial of an empty block
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return;
  }
  Tensor q = AsBhtd(a.q, dt, device_);
  Tensor k = AsBhtd(a.k, dt, device_);
  Tensor v = AsBhtd(a.v, dt, device_);
  if (k.size(1) != q.size(1)) {  // grouped queries: expand the kv heads
    const int64_t g = q.size(1) / k.size(1);
    k = k.repeat_interleave(g, 1);
    v = v.repeat_interleave(g, 1);
  }
  if (!checked_) Calibrate(q.options());
  Tensor o, l;
  if (use_cudnn_) {
    try {
      auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, true, 0.0, false,
                                                       false, a.scale);
      o = std::get<0>(r);
      l = std::get<1>(r);
      if (lse_scale_ != 1.0) l = l * lse_scale_;
    } catch (const std::exception& e) {  // a layout or size cuDNN refuses: flash from now on
      TORCH_WARN("ditscale.sp: cuDNN attention failed on q ", q.sizes(), " strides ", q.strides(),
                 " (", e.what(), "); switching to flash attention");
      use_cudnn_ = false;
    }
  }
  if (!use_cudnn_) {
    auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, false, false, a.scale);
    o = std::get<0>(r);
    l = std::get<1>(r);
  }
  out.copy_(o);
  lse.copy_(l.reshape({q.size(0), q.size(1), q.size(2)}));
}

// Once: does cuDNN attention run here, and in which base is its log-sum-exp? Compared with an
// fp32 reference on a small random case (the executor's merges need natural logs).
void AtenAttention::Calibrate(const at::TensorOptions& opts) {
  checked_ = true;
  // Deterministic inputs without touching the global RNG.
  auto pattern = [&](int64_t t, double f) {
    return (at::arange(2 * t * 128, opts.dtype(at::kFloat)).reshape({1, 2, t, 128}) * f)
        .sin()
        .to(opts.dtype());
  };
  Tensor q = pattern(64, 0.37), k = pattern(80, 0.53), v = pattern(80, 0.71);
  const double scale = 1.0 / std::sqrt(128.0);
  Tensor ref =
      at::logsumexp(at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-1, -2)) * scale, -1);
  try {
    auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, true, 0.0, false, false,
                                                     scale);
    Tensor l = std::get<1>(r).reshape({1, 2, 64}).to(at::kFloat);
    const double e_nat = (l - ref).abs().max().item<double>();
    const double e_log2 = (l * std::log(2.0) - ref).abs().max().item<double>();
    if (e_nat < 5e-2) {
      use_cudnn_ = true;
      lse_scale_ = 1.0;
    } else if (e_log2 < 5e-2) {
      use_cudnn_ = true;
      lse_scale_ = std::log(2.0);
    } else {
      use_cudnn_ = false;
      TORCH_WARN("ditscale.sp: cuDNN attention's logsumexp matches neither base (errors ", e_nat,
                 ", ", e_log2, "); using flash attention");
    }
  } catch (const std::exception& e) {
    use_cudnn_ = false;
    TORCH_WARN("ditscale.sp: cuDNN attention unavailable (", e.what(), "); using flash");
  }
}

}  // namespace ditscale::torch_ext
