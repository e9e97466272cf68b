// The GPU executor's attention backend in ditscale._C: cuDNN attention (flash attention as the
// fallback) through ATen, on the executor's compute stream. Compiled with the CUDA ops only
// (sp_aten_attention_cuda.cc).
//
// Attention(): out [B, H, Tq, D] and lse [B, H, Tq] (natural log) of softmax(q k^T * scale) v for
// the strided [B, T, H, D] views of AttentionArgs; grouped-query kv heads are expanded; a block
// without keys gives out = 0, lse = -inf. On first use the backend checks once, against an fp32
// reference on a small case, that cuDNN runs here and in which base its log-sum-exp is; a layout
// cuDNN refuses switches it to flash attention for good (with a warning).
#pragma once

#include <c10/core/TensorOptions.h>

#include <string>

#include "ditscale/runtime/gpu_executor.h"

namespace ditscale::torch_ext {

class AtenAttention final : public runtime::AttentionBackend {
 public:
  explicit AtenAttention(int device) : device_(device) {}

  void Attention(const runtime::AttentionArgs& a, void* stream) override;

  // "cudnn" or "flash": what the next call runs.
  std::string backend() const { return use_cudnn_ ? "cudnn" : "flash"; }

 private:
  void Calibrate(const c10::TensorOptions& opts);

  int device_;
  bool checked_ = false;
  bool use_cudnn_ = true;
  double lse_scale_ = 1.0;  // cuDNN's lse times this = natural log
};

}  // namespace ditscale::torch_ext
