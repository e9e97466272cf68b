// The layer tensors' shape, dtype and executor view (sp_layer_io.h).
#include "ditscale/torch/sp_layer_io.h"

namespace ditscale::torch_ext {

using at::Tensor;

runtime::LayerIo IoOf(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& tout) {
  runtime::LayerIo io;
  io.q = q.data_ptr();
  io.k = k.data_ptr();
  io.v = v.data_ptr();
  io.out = out.data_ptr();
  if (tq.defined()) {
    io.text_q = tq.data_ptr();
    io.text_k = tk.data_ptr();
    io.text_v = tv.data_ptr();
    io.text_out = tout.data_ptr();
  }
  return io;
}

kernels::DType DTypeOf(at::ScalarType t, const char* who) {
  switch (t) {
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kHalf:
      return kernels::DType::kFloat16;
    default:
      // cuDNN and flash attention run in 16-bit floats only.
      TORCH_CHECK(false, who, ": dtype ", t, " is not supported (bf16, fp16)");
  }
}

sp::AttentionShape CheckedShape(const char* who, const char* s_name, const Tensor& q,
                                const Tensor& k, const Tensor& v, const std::optional<Tensor>& tq,
                                const std::optional<Tensor>& tk, const std::optional<Tensor>& tv,
                                int64_t seq_total) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who, ": q, k, v must be [B, ", s_name,
              ", H, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3),
              who, ": k and v must be [B, ", s_name, ", H_kv, D] like q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), who,
              ": q, k, v must share a dtype");
  const bool joint = tq.has_value() && tq->defined();
  const int64_t T = joint ? tq->size(1) : 0;
  if (joint) {
    TORCH_CHECK(tk.has_value() && tv.has_value() && tk->defined() && tv->defined(), who,
                ": joint_q, joint_k and joint_v go together");
    TORCH_CHECK(tq->dim() == 4 && tq->size(0) == q.size(0) && tq->size(2) == q.size(2) &&
                    tq->size(3) == q.size(3) && tk->sizes() == tv->sizes() && tk->size(1) == T &&
                    tk->size(2) == k.size(2),
                who, ": joint tensors must be [B, T, H, D] (H_kv for k, v)");
  }
  sp::AttentionShape shape;
  shape.batch = q.size(0);
  shape.seq_tokens = seq_total;
  shape.text_tokens = T;
  shape.heads = q.size(2);
  shape.kv_heads = k.size(2);
  shape.head_dim = q.size(3);
  shape.dtype_bytes = static_cast<int>(kernels::dtype_size(DTypeOf(q.scalar_type(), who)));
  return shape;
}

}  // namespace ditscale::torch_ext
