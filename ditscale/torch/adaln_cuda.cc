// CUDA backend of the fused AdaLN ops (schemas in adaln_ops.cc, op bodies in adaln_impl.h): the
// launchers of ditscale/kernels/adaln.h on the current CUDA stream of x's device. The backward's
// workspace (per-block partial sums of the deterministic D-tile reduction) comes from the caching
// allocator. Compiled only when ditscale's CUDA kernels are built and torch has CUDA.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstddef>

#include "ditscale/kernels/adaln.h"
#include "ditscale/torch/adaln_impl.h"

namespace ditscale::torch_ext {
namespace {

void* current_stream(const at::Tensor& x) {
  return static_cast<void*>(c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
}

struct CudaAdaLN {
  static void forward(kernels::AdaLNFwdParams& p, const at::Tensor& x) {
    c10::cuda::CUDAGuard guard(x.device());
    kernels::adaln_forward_cuda(p, current_stream(x));
  }
  static void backward(AdaLNBackwardCall& c, const at::Tensor& x) {
    c10::cuda::CUDAGuard guard(x.device());
    const std::size_t bytes = kernels::adaln_backward_workspace_bytes(c.params);
    at::Tensor workspace;
    if (bytes > 0) {
      workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
      c.params.workspace = workspace.data_ptr();
      c.params.workspace_bytes = bytes;
    }
    // The workspace returns to the caching allocator when this function ends; the allocator
    // keeps it reserved for the current stream until the kernels queued on it have run.
    kernels::adaln_backward_cuda(c.params, current_stream(x));
  }
};

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_IMPL(ditscale, CUDA, m) {
  ditscale::torch_ext::AdaLNOps<ditscale::torch_ext::CudaAdaLN>::register_all(m);
}
