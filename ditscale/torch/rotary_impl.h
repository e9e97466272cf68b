// The body of the torch op ditscale::rotary (schema in rotary_ops.cc), one implementation for
// every backend: the tensor checks (TORCH_CHECK messages naming the argument and its value), the
// params of ditscale/kernels/rotary.h, the output allocation, then the backend's launch. A
// backend is a type with `static void run(const kernels::RotaryParams& p, const at::Tensor& x)`,
// called only when there is work.
//
// rotary(x, cos, sin, inverse) -> y
//   x: [B, S, H, Dh] (Dh even), bf16 / fp16 / fp32 (fp64 on CPU), any strides with a contiguous
//      last dimension and even strides (else a contiguous copy is made);
//   cos, sin: float32 [Bf, S, 1, Dh] or [Bf, S, Dh] (Bf = 1 or B; diffusers' Wan rotary
//      embedding is [1, S, 1, Dh]), made contiguous when they are not; x's device;
//   y: a new contiguous [B, S, H, Dh] tensor of x's dtype.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ditscale/kernels/rotary.h"

namespace ditscale::torch_ext {

inline kernels::DType rotary_dtype(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kDouble:
      return kernels::DType::kFloat64;
    default:
      TORCH_CHECK(false, "ditscale.ops.rotary: x must be bfloat16, float16 or float32 (float64 "
                         "on the CPU), got ", x.scalar_type());
  }
}

// cos / sin as [Bf, S, Dh] contiguous float32 (a view or a copy of the argument).
inline at::Tensor rotary_freqs(const at::Tensor& f, const char* name, const at::Tensor& x) {
  const int64_t B = x.size(0), S = x.size(1), Dh = x.size(3);
  TORCH_CHECK(f.device() == x.device(), "ditscale.ops.rotary: ", name, " is on ", f.device(),
              " but x is on ", x.device());
  TORCH_CHECK(f.scalar_type() == at::kFloat, "ditscale.ops.rotary: ", name,
              " must be float32, got ", f.scalar_type());
  const bool four = f.dim() == 4 && f.size(2) == 1;
  TORCH_CHECK((four || f.dim() == 3) && (f.size(0) == 1 || f.size(0) == B) && f.size(1) == S &&
                  f.size(-1) == Dh,
              "ditscale.ops.rotary: ", name, " must be [1 or B, S, 1, Dh] or [1 or B, S, Dh] = "
              "[1 or ", B, ", ", S, ", (1,) ", Dh, "] for x of shape ", x.sizes(), ", got ",
              f.sizes());
  return (four ? f.squeeze(2) : f).contiguous();
}

template <typename Backend>
at::Tensor rotary_op(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                     bool inverse) {
  TORCH_CHECK(x_in.dim() == 4, "ditscale.ops.rotary: x must be [B, S, H, Dh], got shape ",
              x_in.sizes());
  TORCH_CHECK(x_in.size(3) >= 2 && x_in.size(3) % 2 == 0,
              "ditscale.ops.rotary: x's head dim (its last) must be even and >= 2, got ",
              x_in.size(3));
  const kernels::DType dtype = rotary_dtype(x_in);
  const bool strided_ok = x_in.stride(3) == 1 && x_in.stride(0) % 2 == 0 &&
                          x_in.stride(1) % 2 == 0 && x_in.stride(2) % 2 == 0 &&
                          x_in.storage_offset() % 2 == 0;
  const at::Tensor x = strided_ok ? x_in : x_in.contiguous();
  const at::Tensor cos = rotary_freqs(cos_in, "cos", x), sin = rotary_freqs(sin_in, "sin", x);
  TORCH_CHECK(cos.size(0) == sin.size(0), "ditscale.ops.rotary: cos and sin must have the same "
              "batch size, got ", cos.size(0), " and ", sin.size(0));
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return y;
  kernels::RotaryParams p;
  p.x = x.data_ptr();
  p.x_stride_b = x.stride(0);
  p.x_stride_s = x.stride(1);
  p.x_stride_h = x.stride(2);
  p.y = y.data_ptr();
  p.dtype = dtype;
  p.batch = x.size(0);
  p.seq_len = x.size(1);
  p.heads = x.size(2);
  p.head_dim = x.size(3);
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.freq_stride_b = cos.size(0) == 1 ? 0 : x.size(1) * x.size(3);
  p.inverse = inverse;
  Backend::run(p, x);
  return y;
}

}  // namespace ditscale::torch_ext
