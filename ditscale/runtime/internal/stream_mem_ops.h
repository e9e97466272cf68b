// The driver's stream memory operations of the copy-engine engine (gpu_executor_one_sided.cu),
// loaded once; gpu_executor.cu loads them at creation so a missing entry point fails there.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"

namespace ditscale::runtime::internal {

// cuStreamWriteValue64 / cuStreamWaitValue64 through the runtime's driver entry points (linking
// libcuda would keep the CPU-only test binaries from loading on machines without a driver).
struct StreamMemOps {
  PFN_cuStreamWriteValue64_v11070 write = nullptr;
  PFN_cuStreamWaitValue64_v11070 wait = nullptr;
};
inline const StreamMemOps& MemOps() {
  static const StreamMemOps ops = [] {
    StreamMemOps o;
    auto load = [](const char* name) {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e =
          cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess) (void)cudaGetLastError();
      DS_CHECK(e == cudaSuccess && q == cudaDriverEntryPointSuccess && fn != nullptr,
               "sp executor: the driver entry point ", name, " is unavailable (", CudaErrorText(e),
               ")");
      return fn;
    };
    o.write = reinterpret_cast<PFN_cuStreamWriteValue64_v11070>(load("cuStreamWriteValue64"));
    o.wait = reinterpret_cast<PFN_cuStreamWaitValue64_v11070>(load("cuStreamWaitValue64"));
    return o;
  }();
  return ops;
}

}  // namespace ditscale::runtime::internal
