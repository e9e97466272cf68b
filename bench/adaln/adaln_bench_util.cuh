// Pieces shared by the AdaLN CUDA benchmarks (adaln_kernel_bench.cu, adaln_probe.cu): CUDA error
// check, a zero-filled device buffer, a deterministic bf16 fill and comma-separated lists.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace ditscale::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// A zero-filled device allocation (at least 16 bytes), freed on scope exit.
struct Buf {
  void* p = nullptr;
  explicit Buf(std::size_t bytes) {
    const std::size_t n = bytes == 0 ? 16 : bytes;
    check(cudaMalloc(&p, n), "cudaMalloc");
    check(cudaMemset(p, 0, n), "cudaMemset");
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

// n bf16 values from a cheap deterministic pattern (uniform-ish in [-2, 2]); salt picks the stream.
static __global__ void fill_pattern(std::uint16_t* p, std::size_t n, std::uint32_t salt) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 2654435761u ^ salt;
    h ^= h >> 15;
    const float v = static_cast<float>(h & 0xffff) / 16384.f - 2.f;
    p[i] = static_cast<std::uint16_t>(__float_as_uint(v) >> 16);
  }
}

// "a,b,,c" -> {"a", "b", "c"}.
inline std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> v;
  for (std::size_t pos = 0; pos <= s.size();) {
    const std::size_t c = std::min(s.find(',', pos), s.size());
    if (c > pos) v.push_back(s.substr(pos, c - pos));
    pos = c + 1;
  }
  return v;
}

}  // namespace ditscale::bench
