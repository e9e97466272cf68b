// DS_CHECK_CUDA(expr): throws ditscale::Error("file:line: CUDA error <name>: <text> in <expr>")
// when a CUDA runtime call does not return cudaSuccess. After every kernel launch write
// DS_CHECK_CUDA(cudaGetLastError()). Defined here unless core already provides it.
#pragma once

#include <cuda_runtime_api.h>

#include "ditscale/core/error.h"

#ifndef DS_CHECK_CUDA
#define DS_CHECK_CUDA(expr)                                           \
  do {                                                                \
    const cudaError_t ds_cuda_status_ = (expr);                       \
    if (ds_cuda_status_ != cudaSuccess) [[unlikely]] {                \
      DS_FAIL("CUDA error ", cudaGetErrorName(ds_cuda_status_), ": ", \
              cudaGetErrorString(ds_cuda_status_), " in ", #expr);    \
    }                                                                 \
  } while (0)
#endif
