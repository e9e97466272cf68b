// Helpers shared by the CUDA GPU tests: device detection for clean skips and a host buffer with
// a device copy (RAII).
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ditscale::gpu_test {

// True when at least one CUDA device is usable.
inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Host bytes plus a device copy of at least 16 bytes (dev is null when cudaMalloc failed).
struct Buf {
  std::vector<std::uint8_t> host;
  void* dev = nullptr;
  explicit Buf(std::vector<std::uint8_t> h) : host(std::move(h)) {
    if (cudaMalloc(&dev, std::max<std::size_t>(host.size(), 16)) != cudaSuccess) dev = nullptr;
    if (dev != nullptr && !host.empty()) {
      cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice);
    }
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  ~Buf() {
    if (dev != nullptr) cudaFree(dev);
  }
  // The device copy or the host bytes, as a byte pointer.
  char* base(bool device) {
    return device ? static_cast<char*>(dev) : reinterpret_cast<char*>(host.data());
  }
  // The device copy's bytes, read back.
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> h(host.size());
    if (!h.empty()) cudaMemcpy(h.data(), dev, h.size(), cudaMemcpyDeviceToHost);
    return h;
  }
};

}  // namespace ditscale::gpu_test

// Skips the current test when there is no CUDA device.
#define SKIP_WITHOUT_GPU() \
  if (!::ditscale::gpu_test::have_gpu()) GTEST_SKIP() << "no CUDA device"
