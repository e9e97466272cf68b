// Tensors of one attention layer for the GPU executor (ditscale._C's CUDA ops): their checked
// shape, their dtype and the executor's view of them.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "ditscale/kernels/dtype.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::torch_ext {

// bf16 -> kBFloat16, fp16 -> kFloat16; anything else fails naming `who` (cuDNN and flash
// attention run in 16-bit floats only).
kernels::DType DTypeOf(at::ScalarType t, const char* who);

// The layer's shape from q [B, S, H, D], k and v [B, S, H_kv, D] (one dtype; `s_name` names S in
// the messages) and the optional joint text tensors ([B, T, H, D]; [B, T, H_kv, D] for k and v),
// with `seq_total` image tokens over all ranks; fails naming `who` when the tensors do not fit
// together.
sp::AttentionShape CheckedShape(const char* who, const char* s_name, const at::Tensor& q,
                                const at::Tensor& k, const at::Tensor& v,
                                const std::optional<at::Tensor>& tq,
                                const std::optional<at::Tensor>& tk,
                                const std::optional<at::Tensor>& tv, int64_t seq_total);

// The executor's view of one layer's contiguous tensors (the text ones undefined without joint
// tokens).
runtime::LayerIo IoOf(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& tq, const at::Tensor& tk,
                      const at::Tensor& tv, const at::Tensor& tout);

}  // namespace ditscale::torch_ext
