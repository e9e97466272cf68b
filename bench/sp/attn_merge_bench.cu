// bench: CUDA-event timing of the log-sum-exp merge (attn_merge_cuda) and of the layout copies
// (layout_copy_cuda: Ulysses head split / token join) at Flux-like shapes, against a
// device-to-device cudaMemcpy of the same number of bytes (the speed-of-light of a pass that
// reads and writes that much). Prints one row per case:
//   case dtype B T H D | bytes MB | ms | GB/s | memcpy GB/s | %memcpy
// Bytes counted as in the headers: merge B*T*H*((K + 1)*D*sizeof(T) + (K + 1)*4); layout
// 2 * the payload. Times are medians of per-launch CUDA-event timings after a warm-up.
//
// Usage: attn_merge_bench [--quick]   (--quick: T = 16384 only)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "ditscale/core/cuda_check.h"
#include "ditscale/kernels/attn_merge.h"
#include "ditscale/kernels/layout.h"

namespace {

using namespace ditscale::kernels;

// Median milliseconds of `reps` timed launches of f after 3 warm-ups.
double time_ms(const std::function<void()>& f, int reps = 20) {
  for (int i = 0; i < 3; ++i) f();
  cudaEvent_t a, b;
  DS_CHECK_CUDA(cudaEventCreate(&a));
  DS_CHECK_CUDA(cudaEventCreate(&b));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    DS_CHECK_CUDA(cudaEventRecord(a));
    f();
    DS_CHECK_CUDA(cudaEventRecord(b));
    DS_CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    DS_CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  DS_CHECK_CUDA(cudaEventDestroy(a));
  DS_CHECK_CUDA(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void* dev_alloc(std::size_t bytes) {
  void* p = nullptr;
  DS_CHECK_CUDA(cudaMalloc(&p, bytes));
  DS_CHECK_CUDA(cudaMemset(p, 0, bytes));
  return p;
}

double memcpy_gbps(std::int64_t bytes_moved) {
  const std::size_t n = static_cast<std::size_t>(bytes_moved / 2);
  void* a = dev_alloc(n);
  void* b = dev_alloc(n);
  const double ms =
      time_ms([&] { DS_CHECK_CUDA(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice)); });
  DS_CHECK_CUDA(cudaFree(a));
  DS_CHECK_CUDA(cudaFree(b));
  return 2.0 * n / ms / 1e6;
}

void row(const std::string& name, DType dt, std::int64_t B, std::int64_t T, std::int64_t H,
         std::int64_t D, std::int64_t bytes, double ms) {
  const double gbps = bytes / ms / 1e6, ref = memcpy_gbps(bytes);
  std::printf(
      "%-22s %-8s %lld %6lld %3lld %4lld | %9.1f MB | %8.4f ms | %7.1f GB/s | %7.1f | %5.1f%%\n",
      name.c_str(), dtype_name(dt), static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(H), static_cast<long long>(D), bytes / 1e6, ms, gbps, ref,
      100.0 * gbps / ref);
}

void bench_merge(DType dt, int k, bool in_place, std::int64_t B, std::int64_t T, std::int64_t H,
                 std::int64_t D) {
  const std::size_t out_bytes = static_cast<std::size_t>(B * T * H * D) * dtype_size(dt);
  const std::size_t lse_bytes = static_cast<std::size_t>(B * T * H) * 4;
  std::vector<void*> bufs;
  AttnMergeParams p;
  p.batch = B, p.tokens = T, p.heads = H, p.head_dim = D, p.dtype = dt, p.num_inputs = k;
  for (int i = 0; i < k; ++i) {
    bufs.push_back(dev_alloc(out_bytes));
    bufs.push_back(dev_alloc(lse_bytes));
    p.in[i] = dense_out_view(bufs[bufs.size() - 2], T, H, D);
    p.in_lse[i] = lse_view_bht(static_cast<const float*>(bufs.back()), T, H);
  }
  if (in_place) {
    p.out = dense_out_dst(bufs[0], T, H, D);
    p.out_lse = lse_dst_bht(static_cast<float*>(bufs[1]), T, H);
  } else {
    bufs.push_back(dev_alloc(out_bytes));
    bufs.push_back(dev_alloc(lse_bytes));
    p.out = dense_out_dst(bufs[bufs.size() - 2], T, H, D);
    p.out_lse = lse_dst_bht(static_cast<float*>(bufs.back()), T, H);
  }
  const double ms = time_ms([&] { attn_merge_cuda(p, nullptr); });
  DS_CHECK_CUDA(cudaGetLastError());
  const std::int64_t bytes =
      B * T * H * ((k + 1) * D * static_cast<std::int64_t>(dtype_size(dt)) + (k + 1) * 4);
  row("merge K=" + std::to_string(k) + (in_place ? " in-place" : ""), dt, B, T, H, D, bytes, ms);
  for (void* b : bufs) DS_CHECK_CUDA(cudaFree(b));
}

void bench_layout(DType dt, SplitAxis axis, int n, std::int64_t B, std::int64_t T, std::int64_t H,
                  std::int64_t D) {
  const std::size_t bytes = static_cast<std::size_t>(B * T * H * D) * dtype_size(dt);
  void* src = dev_alloc(bytes);
  void* dst = dev_alloc(bytes);
  const std::int64_t size = axis == SplitAxis::kHeads ? H : T;
  std::vector<std::int64_t> offsets;
  for (int i = 0; i <= n; ++i) offsets.push_back(size * i / n);
  const LayoutCopyParams p = split_params({src, dt, B, T, H, D}, axis, offsets, dst);
  const double ms = time_ms([&] { layout_copy_cuda(p, nullptr); });
  DS_CHECK_CUDA(cudaGetLastError());
  row(std::string(axis == SplitAxis::kHeads ? "split heads" : "split tokens") +
          " n=" + std::to_string(n),
      dt, B, T, H, D, 2 * layout_copy_bytes(p), ms);
  DS_CHECK_CUDA(cudaFree(src));
  DS_CHECK_CUDA(cudaFree(dst));
}

void Run(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  std::vector<std::int64_t> tokens = {16384};
  if (!quick) tokens.push_back(33024);  // 66,048 / 2: one rank of two at the issue's size
  for (std::int64_t t : tokens) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      bench_merge(dt, 2, true, 1, t, 24, 128);
      bench_merge(dt, 4, false, 1, t, 24, 128);
      bench_merge(dt, 8, false, 1, t, 24, 128);
    }
    bench_layout(DType::kBFloat16, SplitAxis::kHeads, 2, 1, t, 24, 128);
    bench_layout(DType::kBFloat16, SplitAxis::kHeads, 8, 1, t, 24, 128);
    bench_layout(DType::kBFloat16, SplitAxis::kTokens, 8, 1, t, 24, 128);
    bench_layout(DType::kBFloat16, SplitAxis::kHeads, 5, 1, t, 24, 72);  // uneven, 144-byte rows
  }
}

}  // namespace

// A failed CUDA call (DS_CHECK_CUDA throws) prints "file:line: CUDA error <name>: <text> in
// <call>" and exits 1.
int main(int argc, char** argv) {
  try {
    Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attn_merge_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
