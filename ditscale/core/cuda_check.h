// Checks of CUDA runtime, CUDA driver, NCCL and NVSHMEM calls: the one place that turns their
// status codes into ditscale::Error (error.h) or into the text of a Failure (result.h).
//
//   DS_CHECK_CUDA(expr)     expr returns cudaError_t; throws unless cudaSuccess. After a kernel
//                           launch write DS_CHECK_CUDA(cudaGetLastError()).
//   DS_CHECK_CU(expr)       expr returns CUresult (driver API, e.g. through a driver entry
//                           point); throws unless CUDA_SUCCESS.
//   DS_CHECK_NCCL(expr)     expr returns ncclResult_t; throws unless ncclSuccess (ncclInProgress
//                           of a non-blocking communicator is an error here: poll it yourself).
//   DS_CHECK_NVSHMEM(expr)  expr returns an NVSHMEM host status (int); throws unless 0.
//
// Each throws ditscale::Error("file:line: <library> error <name>: <text> in <expr>"), e.g.
//   "gpu_executor.cu:88: CUDA error cudaErrorMemoryAllocation: out of memory in cudaMalloc(&p, n)".
// CudaErrorText / CuErrorText give the "<name>: <text>" part for Result-returning code.
//
// Header-only, for CUDA-aware translation units: it includes the CUDA runtime and driver headers
// (the core library itself builds without CUDA and does not include this). DS_CHECK_NCCL and
// DS_CHECK_NVSHMEM name NCCL's and NVSHMEM's symbols only when expanded, so they need nccl.h /
// nvshmem_host.h only where used. Nothing here links libcuda: the driver's error strings come
// through the runtime's driver entry points (CuErrorText falls back to the number without a
// driver).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <string>

#include "ditscale/core/error.h"

namespace ditscale {

// "<name>: <description>" of a CUDA runtime status, e.g. "cudaErrorInvalidValue: invalid argument".
inline std::string CudaErrorText(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// "<name>: <description>" of a CUDA driver status, e.g. "CUDA_ERROR_OUT_OF_MEMORY: out of
// memory"; "CUresult <n>" when the driver cannot be asked (no driver, or it lacks the strings).
inline std::string CuErrorText(CUresult r) {
  using TextFn = CUresult (*)(CUresult, const char**);
  auto load = [](const char* symbol) -> TextFn {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(symbol, &fn, 6000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();  // the query's own error, not the caller's
      return nullptr;
    }
    return reinterpret_cast<TextFn>(fn);
  };
  static const TextFn name_fn = load("cuGetErrorName");
  static const TextFn text_fn = load("cuGetErrorString");
  const char* name = nullptr;
  const char* text = nullptr;
  if (name_fn == nullptr || name_fn(r, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
  std::string s = name;
  if (text_fn != nullptr && text_fn(r, &text) == CUDA_SUCCESS && text != nullptr) {
    s += std::string(": ") + text;
  }
  return s;
}

}  // namespace ditscale

#define DS_CHECK_CUDA(expr)                                                              \
  do {                                                                                   \
    const cudaError_t ds_cuda_status_ = (expr);                                          \
    if (ds_cuda_status_ != cudaSuccess) [[unlikely]] {                                   \
      DS_FAIL("CUDA error ", ::ditscale::CudaErrorText(ds_cuda_status_), " in ", #expr); \
    }                                                                                    \
  } while (0)

#define DS_CHECK_CU(expr)                                                                   \
  do {                                                                                      \
    const CUresult ds_cu_status_ = (expr);                                                  \
    if (ds_cu_status_ != CUDA_SUCCESS) [[unlikely]] {                                       \
      DS_FAIL("CUDA driver error ", ::ditscale::CuErrorText(ds_cu_status_), " in ", #expr); \
    }                                                                                       \
  } while (0)

#define DS_CHECK_NCCL(expr)                                           \
  do {                                                                \
    const auto ds_nccl_status_ = (expr);                              \
    if (ds_nccl_status_ != ncclSuccess) [[unlikely]] {                \
      DS_FAIL("NCCL error ", static_cast<int>(ds_nccl_status_), ": ", \
              ncclGetErrorString(ds_nccl_status_), " in ", #expr);    \
    }                                                                 \
  } while (0)

#define DS_CHECK_NVSHMEM(expr)                                             \
  do {                                                                     \
    const int ds_nvshmem_status_ = (expr);                                 \
    if (ds_nvshmem_status_ != 0) [[unlikely]] {                            \
      DS_FAIL("NVSHMEM error: status ", ds_nvshmem_status_, " in ", #expr, \
              " (NVSHMEM_DEBUG=WARN tells more)");                         \
    }                                                                      \
  } while (0)
