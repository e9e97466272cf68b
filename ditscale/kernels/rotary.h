// Rotary position embedding on interleaved pairs, the convention of diffusers' Wan attention
// (WanAttnProcessor's apply_rotary_emb), forward and its inverse (the backward), in one pass.
//
// Shapes: x [B, S, H, Dh] strided (its last dimension contiguous, even strides: a permuted view
// such as the gradient SDPA returns is read in place), y [B, S, H, Dh] contiguous (Dh even);
// cos, sin [Bf, S, Dh] float32 contiguous with
// Bf = 1 (shared by the batch: freq_stride_b = 0) or B (freq_stride_b = S * Dh). For each pair
// j < Dh / 2 of a head, with a = x[2j], b = x[2j + 1], c = cos[2j], s = sin[2j + 1]:
//   forward:  y[2j] = a*c - b*s        y[2j + 1] = a*s + b*c
//   inverse:  y[2j] = a*c + b*s        y[2j + 1] = b*c - a*s     (= the forward's transpose:
//             the gradient of x from the gradient of y)
// computed in float32 (float64 for float64 x, CPU only) with each product and each sum rounded
// to float32 on its own (no fused multiply-add), and y rounded once to x's dtype: the forward
// gives the bits diffusers' formula gives (its products and sums are separate float32 kernels,
// then one copy into x's dtype). Bytes moved: 2 * B * S * H * Dh * sizeof(dtype) plus cos/sin.
//
// Division of labour: the caller allocates y; rotary_check validates the params (throwing
// ditscale::Error naming the field), rotary_cuda launches on `stream`, rotary_ref runs on host
// pointers.
#pragma once

#include <cstdint>

#include "ditscale/kernels/dtype.h"

namespace ditscale::kernels {

struct RotaryParams {
  const void* x = nullptr;  // [B, S, H, Dh] of `dtype`, strides below
  std::int64_t x_stride_b = 0, x_stride_s = 0, x_stride_h = 0;  // elements, even, >= 0
  void* y = nullptr;        // [B, S, H, Dh] of `dtype`; may not overlap x
  DType dtype = DType::kBFloat16;
  std::int64_t batch = 0;     // B >= 1
  std::int64_t seq_len = 0;   // S >= 1
  std::int64_t heads = 0;     // H >= 1
  std::int64_t head_dim = 0;  // Dh >= 2, even
  const float* cos = nullptr;      // [Bf, S, Dh]
  const float* sin = nullptr;      // [Bf, S, Dh]
  std::int64_t freq_stride_b = 0;  // 0 (Bf = 1) or S * Dh (Bf = B)
  bool inverse = false;            // true: the inverse rotation (the backward)
};

// Throws ditscale::Error naming the first invalid field of `p` ("rotary: p.head_dim ...").
// `for_gpu`: float64 is refused (the CUDA kernel has no float64 path).
void rotary_check(const RotaryParams& p, bool for_gpu);

// The rotation on the GPU, on `stream` (a cudaStream_t). Checks `p` first.
void rotary_cuda(const RotaryParams& p, void* stream);

// The rotation on the CPU (host pointers). Checks `p` first.
void rotary_ref(const RotaryParams& p);

}  // namespace ditscale::kernels
