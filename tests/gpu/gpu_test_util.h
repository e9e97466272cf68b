// Helpers shared by the CUDA GPU tests: device detection for clean skips, a host buffer with a
// device copy (RAII), the run's random seed and the relative-error bound per dtype. Every CUDA
// call is checked: a failure throws ditscale::Error (DS_CHECK_CUDA, which gtest reports as the
// test's failure with the call and CUDA's error text), except in Buf's destructor, which may not
// throw and adds a test failure instead.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <utility>
#include <vector>

#include "ditscale/core/cuda_check.h"
#include "ditscale/kernels/dtype.h"

namespace ditscale::gpu_test {

// True when at least one CUDA device is usable (an error of the query, e.g. no driver, means none).
inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Host bytes plus a device copy of at least 16 bytes.
struct Buf {
  std::vector<std::uint8_t> host;
  void* dev = nullptr;
  explicit Buf(std::vector<std::uint8_t> h) : host(std::move(h)) {
    DS_CHECK_CUDA(cudaMalloc(&dev, std::max<std::size_t>(host.size(), 16)));
    if (!host.empty()) {
      const cudaError_t e = cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice);
      if (e != cudaSuccess) {
        (void)cudaFree(dev);  // the constructor throws: no destructor frees it
        DS_FAIL("CUDA error ", CudaErrorText(e), " in cudaMemcpy(dev, host.data(), ", host.size(),
                ", cudaMemcpyHostToDevice)");
      }
    }
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() {
    const cudaError_t e = cudaFree(dev);
    if (e != cudaSuccess) ADD_FAILURE() << "CUDA error " << CudaErrorText(e) << " in cudaFree(dev)";
  }
  // The device copy or the host bytes, as a byte pointer.
  char* base(bool device) {
    return device ? static_cast<char*>(dev) : reinterpret_cast<char*>(host.data());
  }
  // The device copy's bytes, read back.
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> h(host.size());
    if (!h.empty()) DS_CHECK_CUDA(cudaMemcpy(h.data(), dev, h.size(), cudaMemcpyDeviceToHost));
    return h;
  }
};

// Fresh random inputs every run: one seed per process from the clock, printed (with `test`, the
// program's name) so that a failure can be reproduced.
inline std::uint64_t run_seed(const char* test) {
  static const std::uint64_t seed = [test] {
    const auto s =
        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("%s seed: %llu\n", test, static_cast<unsigned long long>(s));
    return s;
  }();
  return seed;
}

// Relative (Frobenius) error bound of a kernel against its fp64 reference, by output dtype.
inline double tolerance(kernels::DType dtype) {
  switch (dtype) {
    case kernels::DType::kFloat32:
      return 1e-5;
    case kernels::DType::kFloat16:
      return 2e-3;
    default:
      return 1e-2;
  }
}

}  // namespace ditscale::gpu_test

// Skips the current test when there is no CUDA device.
#define SKIP_WITHOUT_GPU() \
  if (!::ditscale::gpu_test::have_gpu()) GTEST_SKIP() << "no CUDA device"
