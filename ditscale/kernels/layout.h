// Pack / unpack of [B, T, H, D] activations around transfers: copies of token x head regions
// between strided buffers and contiguous staging buffers, including the Ulysses all-to-all
// layouts (scatter heads to per-destination chunks, gather sequence chunks back, and the reverse).
//
// Every buffer is a [B, T, H, D] tensor with D contiguous; all copies are bit-exact (bytes are
// moved, never converted), so the element type only matters through its size. The semantics are
// those of the CPU reference executor of the sp schedules (ditscale/sp/ref_executor.cc): a
// BufferRegion {token_begin, tokens, head_begin, heads} of a dense row-major buffer, all batches
// and all of D, is packed into a staging buffer laid out as a dense [B, tokens, heads, D] tensor
// (Pack / Send), and unpacked from one (Unpack / Recv).
//
// One launch performs up to kMaxLayoutCopies independent region copies (one per all-to-all peer,
// for instance), each a strided [B, tokens_i, heads_i, D] -> [B, tokens_i, heads_i, D] copy.
// A copy uses 16-byte vector loads/stores when its pointers are 16-byte aligned and its strides
// and D * elem_size are multiples of 16 bytes; otherwise an element-wise path.
//
// Memory traffic: 2 * sum_i B * tokens_i * heads_i * D * elem_size bytes (one read, one write).
#pragma once

#include <cstdint>
#include <vector>

#include "ditscale/kernels/dtype.h"

namespace ditscale::kernels {

// Largest number of region copies one layout_copy call performs.
inline constexpr int kMaxLayoutCopies = 32;

// One strided region copy. Element (b, t, h, d), t < tokens, h < heads, d < head_dim, goes from
// src + b * src_stride_b + t * src_stride_t + h * src_stride_h + d to the same expression on dst
// (strides in elements). Source and destination must not overlap.
struct LayoutCopy {
  const void* src = nullptr;
  std::int64_t src_stride_b = 0, src_stride_t = 0, src_stride_h = 0;
  void* dst = nullptr;
  std::int64_t dst_stride_b = 0, dst_stride_t = 0, dst_stride_h = 0;
  std::int64_t tokens = 0;  // >= 0
  std::int64_t heads = 0;   // >= 0 (a copy with tokens == 0 or heads == 0 does nothing)
};

struct LayoutCopyParams {
  DType dtype = DType::kBFloat16;  // element size only (any of the four types, fp64 included)
  std::int64_t batch = 0;          // B >= 1, shared by every copy
  std::int64_t head_dim = 0;       // D >= 1, shared by every copy
  int num_copies = 0;              // 0 <= n <= kMaxLayoutCopies
  LayoutCopy copies[kMaxLayoutCopies];
};

// A dense row-major [batch, tokens, heads, head_dim] buffer (batch, head_dim >= 1; tokens,
// heads >= 0: a rank may own no heads when H < ranks; data may be null only when empty).
struct DenseBuffer {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  std::int64_t batch = 0, tokens = 0, heads = 0, head_dim = 0;
};

// A token range x head range of a DenseBuffer (all batches, all of head_dim); mirrors
// ditscale::sp::Region without its buffer index.
struct BufferRegion {
  std::int64_t token_begin = 0;
  std::int64_t tokens = 0;
  std::int64_t head_begin = 0;
  std::int64_t heads = 0;
};

// Which dimension an all-to-all splits: the staging chunk i holds a slice [offsets[i],
// offsets[i + 1]) of that dimension and everything of the other.
enum class SplitAxis : int { kTokens = 0, kHeads = 1 };

// ---- Params builders (host arithmetic only, no CUDA call; validate and throw ditscale::Error
// naming the argument on bad input) ----

// (Staging pointers may be null only when nothing is copied.)
// Pack: `region` of `src` -> `staging`, a dense [B, region.tokens, region.heads, D] buffer of
// src.dtype (the Pack/Send of the reference executor).
LayoutCopyParams pack_region_params(const DenseBuffer& src, const BufferRegion& region,
                                    void* staging);

// Unpack: dense [B, region.tokens, region.heads, D] `staging` -> `region` of `dst`.
LayoutCopyParams unpack_region_params(const void* staging, const DenseBuffer& dst,
                                      const BufferRegion& region);

// All-to-all send side. `offsets` (n + 1 non-decreasing values from 0 to the size of `axis` of
// `src`; n <= kMaxLayoutCopies) splits `axis` into n chunks of uneven sizes. Chunk i = the slice
// [offsets[i], offsets[i + 1]) of `axis` with everything of the other dimension, written as a
// dense tensor at element offset chunk_offset(i) of `staging`; chunks are back to back in i order
// (what ncclSend per peer or an all-to-all with split sizes expects).
//   Ulysses before attention (sequence-sharded -> head-sharded): axis = kHeads: src
//   [B, T/N, H, D] -> chunk i = [B, T/N, h_i, D] for destination rank i.
//   Ulysses after attention: axis = kTokens: src [B, T, H/N, D] -> chunk i = [B, t_i, H/N, D].
LayoutCopyParams split_params(const DenseBuffer& src, SplitAxis axis,
                              const std::vector<std::int64_t>& offsets, void* staging);

// All-to-all receive side, the inverse layout: chunk i of `staging` (dense, back to back, sized
// by `offsets` over `axis` of `dst`) -> the slice [offsets[i], offsets[i + 1]) of `axis` of `dst`.
//   Ulysses before attention: axis = kTokens: chunk j = [B, t_j, H_local, D] from source rank j
//   -> tokens [offsets[j], offsets[j + 1]) of dst [B, T, H_local, D].
//   Ulysses after attention: axis = kHeads: chunk j = [B, T/N, h_j, D] -> heads of dst.
LayoutCopyParams join_params(const void* staging, SplitAxis axis,
                             const std::vector<std::int64_t>& offsets, const DenseBuffer& dst);

// Element offset of chunk i in a staging buffer split by `offsets` over `axis` of a [B, T, H, D]
// buffer: B * (the other dimension) * D * offsets[i].
std::int64_t chunk_offset(const DenseBuffer& shape, SplitAxis axis,
                          const std::vector<std::int64_t>& offsets, int i);

// Throws ditscale::Error naming the field (e.g. "LayoutCopyParams.copies[3].dst: null") on
// sizes out of range, null pointers of non-empty copies or negative strides.
void layout_copy_check(const LayoutCopyParams& p);

// Total bytes read (= bytes written) by `p`.
std::int64_t layout_copy_bytes(const LayoutCopyParams& p);

// CUDA launcher (defined only when the library is built with CUDA): device pointers,
// asynchronous on `stream` (a cudaStream_t; nullptr = legacy default stream); every copy of
// `p` in one kernel launch. Throws ditscale::Error on invalid params or a launch error.
void layout_copy_cuda(const LayoutCopyParams& p, void* stream);

// CPU reference (always built): the same copies on host pointers.
void layout_copy_ref(const LayoutCopyParams& p);

}  // namespace ditscale::kernels
