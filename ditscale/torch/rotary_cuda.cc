// CUDA backend of the torch op ditscale::rotary (schema in rotary_ops.cc): the launcher of
// ditscale/kernels/rotary.h on the current CUDA stream of x's device. Compiled only when
// ditscale's CUDA kernels are built and torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ditscale/kernels/rotary.h"
#include "ditscale/torch/rotary_impl.h"

namespace ditscale::torch_ext {
namespace {

struct CudaRotary {
  static void run(const kernels::RotaryParams& p, const at::Tensor& x) {
    c10::cuda::CUDAGuard guard(x.device());
    kernels::rotary_cuda(
        p, static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.device().index()).stream()));
  }
};

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_IMPL(ditscale, CUDA, m) {
  m.impl("rotary", TORCH_FN(ditscale::torch_ext::rotary_op<ditscale::torch_ext::CudaRotary>));
}
