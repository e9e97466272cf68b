// Log-sum-exp merge of partial attention outputs (ring / torus / chunked attention).
//
// Each input i is a partial attention result over a disjoint block of keys: an output o_i
// [B, T, H, D] (softmax-normalised over its block) and its log-sum-exp l_i [B, H, T] or
// [B, T, H] (natural log of the sum over the block of exp(score)). For every (b, t, h):
//   m   = max_i l_i                              (over the inputs whose l_i != -inf)
//   w_i = exp(l_i - m)                           (inputs with l_i == -inf are skipped: their o_i
//                                                 is never read, so it may hold garbage or NaN)
//   out = sum_i w_i * o_i / sum_i w_i
//   lse = m + log(sum_i w_i)
// When every l_i is -inf (no key anywhere, e.g. all masked or zero-length kv blocks) the result
// is out = 0, lse = -inf, which is exactly the partial of an empty block; never NaN.
// A NaN lse among the inputs makes that row's output and lse NaN (errors are not hidden).
// For K = 2 with o_0 = the accumulator and o_1 = a new partial this is the pairwise merge of the
// CPU reference executor (ditscale/sp/attention_ref.h, MergeRef). The K-way form merges up to
// kMaxMergeInputs partials in one pass (one read of each, one write), instead of K - 1 passes of
// the pairwise merge that each re-read and re-write the accumulator.
//
// Arithmetic: fp32 on the GPU (inputs converted to float, one rounding of the output to `dtype`),
// fp64 in the CPU reference (attn_merge_ref).
//
// Layouts. Outputs are strided [B, T, H, D] views with the last dimension (D) contiguous: element
// (b, t, h, d) is at `data + b * stride_b + t * stride_t + h * stride_h + d` in ELEMENTS of `dtype`
// (a slice of a bigger buffer, e.g. a head range or a token range, is a view with the buffer's
// strides). The log-sum-exp is fp32 with its own strides; two layouts are common:
//   [B, H, T]  what cuDNN's SDPA returns (ATen's _scaled_dot_product_cudnn_attention gives
//              logsumexp as a [B, H, T] fp32 tensor): lse_view_bht. The merge assumes natural
//              logs (as the flash backend's softmax_lse); the GPU executor's test of a split
//              attention against the full one is what confirms the base of cuDNN's stats.
//   [B, T, H]  the layout of the CPU reference executor's lse buffers: lse_view_bth.
// Any other strides are accepted. Strides may be 0 only for inputs (broadcast).
//
// Aliasing: the output (and out_lse) may alias one input exactly (same pointer and same strides):
// that is the in-place accumulator update. Each element is read before it is written by the same
// thread. Partial overlap of the output with any input is not allowed (not detected either).
//
// Memory traffic (the kernel is memory-bound): per (b, t, h) row it reads K * D elements of
// `dtype` and K fp32 lse values and writes D elements and (optionally) one fp32 lse value:
//   bytes = B * T * H * ((K + 1) * D * sizeof(dtype) + (K + 1) * 4).
#pragma once

#include <cstdint>

#include "ditscale/kernels/dtype.h"

namespace ditscale::kernels {

// Largest number of inputs one attn_merge call takes.
inline constexpr int kMaxMergeInputs = 8;

// A read-only strided [B, T, H, D] attention output (D contiguous); strides in elements.
struct AttnOutView {
  const void* data = nullptr;
  std::int64_t stride_b = 0;  // elements between (b, t, h, d) and (b + 1, t, h, d)
  std::int64_t stride_t = 0;  // ... and (b, t + 1, h, d)
  std::int64_t stride_h = 0;  // ... and (b, t, h + 1, d)
};

// A writable strided [B, T, H, D] attention output (D contiguous); strides in elements.
struct AttnOutDst {
  void* data = nullptr;
  std::int64_t stride_b = 0;
  std::int64_t stride_t = 0;
  std::int64_t stride_h = 0;
};

// A read-only strided fp32 log-sum-exp indexed by (b, t, h); strides in floats.
struct LseView {
  const float* data = nullptr;
  std::int64_t stride_b = 0;
  std::int64_t stride_t = 0;
  std::int64_t stride_h = 0;
};

// A writable strided fp32 log-sum-exp indexed by (b, t, h); strides in floats.
struct LseDst {
  float* data = nullptr;
  std::int64_t stride_b = 0;
  std::int64_t stride_t = 0;
  std::int64_t stride_h = 0;
};

// Views of a dense row-major [B, tokens, heads, head_dim] output.
inline AttnOutView dense_out_view(const void* data, std::int64_t tokens, std::int64_t heads,
                                  std::int64_t head_dim) {
  return {data, tokens * heads * head_dim, heads * head_dim, head_dim};
}
inline AttnOutDst dense_out_dst(void* data, std::int64_t tokens, std::int64_t heads,
                                std::int64_t head_dim) {
  return {data, tokens * heads * head_dim, heads * head_dim, head_dim};
}

// Views of a dense [B, heads, tokens] lse (cuDNN / ATen SDPA logsumexp layout).
inline LseView lse_view_bht(const float* data, std::int64_t tokens, std::int64_t heads) {
  return {data, heads * tokens, 1, tokens};
}
inline LseDst lse_dst_bht(float* data, std::int64_t tokens, std::int64_t heads) {
  return {data, heads * tokens, 1, tokens};
}

// Views of a dense [B, tokens, heads] lse (CPU reference executor layout).
inline LseView lse_view_bth(const float* data, std::int64_t tokens, std::int64_t heads) {
  return {data, tokens * heads, heads, 1};
}
inline LseDst lse_dst_bth(float* data, std::int64_t tokens, std::int64_t heads) {
  return {data, tokens * heads, heads, 1};
}

struct AttnMergeParams {
  std::int64_t batch = 0;     // B >= 1
  std::int64_t tokens = 0;    // T >= 0 (query tokens; 0 = nothing to do)
  std::int64_t heads = 0;     // H >= 1
  std::int64_t head_dim = 0;  // D >= 1 (D * sizeof(dtype) % 16 == 0 takes the vectorised path)
  // Element type of every output view: bf16, fp16, fp32 on the GPU; also fp64 in the reference.
  DType dtype = DType::kBFloat16;

  int num_inputs = 0;               // K, 1 <= K <= kMaxMergeInputs
  AttnOutView in[kMaxMergeInputs];  // in[0 .. K): partial outputs o_i (data required)
  LseView in_lse[kMaxMergeInputs];  // in_lse[0 .. K): their lse l_i (data required)

  AttnOutDst out;  // required: merged output; may alias one input exactly (in place)
  LseDst out_lse;  // optional (data == nullptr: not written, e.g. the last merge of a layer)
};

// A pairwise in-place merge of (part, part_lse) into (acc, acc_lse): the K = 2 params with
// in[0] = acc, in[1] = part, out = acc, out_lse = acc_lse (MergeRef of the reference executor).
AttnMergeParams attn_merge_pair_params(std::int64_t batch, std::int64_t tokens, std::int64_t heads,
                                       std::int64_t head_dim, DType dtype, AttnOutDst acc,
                                       LseDst acc_lse, AttnOutView part, LseView part_lse);

// Throws ditscale::Error naming the offending field (e.g. "AttnMergeParams.in[2].data: null")
// for sizes out of range, K out of [1, kMaxMergeInputs], null required pointers, negative
// strides, a zero output stride over a dimension of size > 1, and an output that shares its
// pointer with an input but not its strides. `for_gpu` additionally rejects fp64.
void attn_merge_check(const AttnMergeParams& p, bool for_gpu);

// CUDA launcher (defined only when the library is built with CUDA): device pointers,
// asynchronous on `stream` (a cudaStream_t; nullptr = legacy default stream). Throws
// ditscale::Error on invalid params or a launch error.
void attn_merge_cuda(const AttnMergeParams& p, void* stream);

// CPU reference (always built): host pointers, fp64 arithmetic, results rounded once to dtype
// (lse to fp32). Single-threaded.
void attn_merge_ref(const AttnMergeParams& p);

}  // namespace ditscale::kernels
