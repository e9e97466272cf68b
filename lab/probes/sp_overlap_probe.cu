// Which transfer primitives make progress while a persistent kernel holds every SM?
//
// cuDNN's fused attention on Hopper behaves as a persistent kernel: a kernel launched on another
// stream after it, even at the highest stream priority, starts only when the attention call ends
// (lab/results/sp-overlap_h200_2026-12/). This probe asks the same of each primitive the GPU
// executor could move data or signal with, on one GPU: a "blocker" kernel takes every SM for
// --block-ms (one CTA per SM, all shared memory, a clock64 spin: what cuDNN's attention does to the
// SMs), and each primitive is enqueued on a high-priority stream 1 ms after the blocker started.
// The primitive's time from enqueue to completion is compared with its time alone: ~ the same = it
// runs beside the blocker (copy engines, stream memory operations); ~ the blocker's remaining time
// = it needed an SM.
//
//   sp_overlap_probe [--block-ms 50] [--bytes 67108864] [--json FILE]
//
// NVSHMEM puts and signals go to this PE itself (one GPU, one PE): NVSHMEM may move data to a
// peer GPU by another path than to itself, so the puts' row is a lower bound on what a P2P put
// needs (the signal and wait rows do not depend on the peer).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/core/cuda_check.h"

namespace {

// Spins for `cycles` SM clocks; with all shared memory per CTA and one CTA per SM it holds every
// SM for the whole time (no other kernel's CTA fits beside it).
__global__ void Blocker(long long cycles, int* sink) {
  extern __shared__ int smem[];
  const long long t0 = clock64();
  int acc = 0;
  while (clock64() - t0 < cycles) acc += smem[threadIdx.x % 32];
  if (acc == 42 && threadIdx.x == 0) *sink = acc;
}

__global__ void Scale(float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    x[i] *= 1.0000001f;
  }
}

struct Row {
  std::string name;
  double alone_ms = 0;
  double beside_ms = 0;
};

int Run(int argc, char** argv) {
  double block_ms = 50;
  size_t bytes = 64ull << 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--block-ms" && i + 1 < argc) {
      block_ms = std::atof(argv[++i]);
    } else if (a == "--bytes" && i + 1 < argc) {
      bytes = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--json" && i + 1 < argc) {
      json = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--block-ms MS] [--bytes N] [--json FILE]\n", argv[0]);
      return 2;
    }
  }
  DS_CHECK_CUDA(cudaSetDevice(0));
  DS_CHECK_CUDA(cudaFree(nullptr));
  DS_CHECK_CU(cuInit(0));
  cudaDeviceProp prop{};
  DS_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const int smem = int(prop.sharedMemPerBlockOptin);
  DS_CHECK_CUDA(cudaFuncSetAttribute(Blocker, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int clock_khz = 0;
  DS_CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  int lo = 0, hi = 0;
  DS_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t bs, ps;
  DS_CHECK_CUDA(cudaStreamCreateWithPriority(&bs, cudaStreamNonBlocking, lo));
  DS_CHECK_CUDA(cudaStreamCreateWithPriority(&ps, cudaStreamNonBlocking, hi));

  auto nv = ditscale::comm::Nvshmem::Init(ditscale::comm::NvshmemNewId().value(), 1, 0, 0);
  if (!nv.ok()) {
    std::fprintf(stderr, "NVSHMEM init: %s\n", nv.failure().ToString().c_str());
    return 1;
  }
  auto& shm = *nv.value();
  void* sym_dst = shm.Malloc(bytes);
  auto* sig = static_cast<std::uint64_t*>(shm.Malloc(64));
  void *src = nullptr, *dst = nullptr, *host = nullptr;
  int* sink = nullptr;
  DS_CHECK_CUDA(cudaMalloc(&src, bytes));
  DS_CHECK_CUDA(cudaMalloc(&dst, bytes));
  DS_CHECK_CUDA(cudaMalloc(&sink, sizeof(int)));
  DS_CHECK_CUDA(cudaMallocHost(&host, bytes));
  DS_CHECK_CUDA(cudaMemset(src, 0, bytes));
  CUdeviceptr flag = 0;
  DS_CHECK_CU(cuMemAlloc(&flag, 8));
  DS_CHECK_CU(cuMemsetD8(flag, 0, 8));
  std::uint64_t signals = 0;  // value of *sig after the signals enqueued so far

  std::vector<std::pair<std::string, std::function<void()>>> probes = {
      {"SM kernel (scale 64 MiB)",
       [&] { Scale<<<4 * sms, 256, 0, ps>>>(static_cast<float*>(dst), bytes / sizeof(float)); }},
      {"cudaMemcpyAsync D2D",
       [&] { DS_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ps)); }},
      {"cudaMemcpyAsync D2H (pinned)",
       [&] { DS_CHECK_CUDA(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, ps)); }},
      {"cuStreamWriteValue64", [&] { DS_CHECK_CU(cuStreamWriteValue64(ps, flag, 1, 0)); }},
      {"cuStreamWaitValue64 (met)",
       [&] { DS_CHECK_CU(cuStreamWaitValue64(ps, flag, 0, CU_STREAM_WAIT_VALUE_GEQ)); }},
      {"NVSHMEM putmem_signal (self)",
       [&] {
         shm.PutSignal(sym_dst, src, bytes, sig, 1, 0, ps);
         ++signals;
       }},
      {"NVSHMEM signal_op (self)",
       [&] {
         shm.Signal(sig, 1, 0, ps);
         ++signals;
       }},
      {"NVSHMEM signal_wait_until (met)", [&] { shm.WaitGE(sig, signals, ps); }},
  };

  const long long block_cycles = static_cast<long long>(block_ms * clock_khz);  // kHz * ms
  auto time_one = [&](const std::function<void()>& probe, bool beside) {
    cudaEvent_t e0, e1;
    DS_CHECK_CUDA(cudaEventCreate(&e0));
    DS_CHECK_CUDA(cudaEventCreate(&e1));
    DS_CHECK_CUDA(cudaDeviceSynchronize());
    if (beside) {
      Blocker<<<sms, 1024, smem, bs>>>(block_cycles, sink);
      DS_CHECK_CUDA(cudaGetLastError());
      // Let the blocker take the SMs first (what the executor sees when a transfer is issued
      // while an attention call runs).
      const auto start = std::chrono::steady_clock::now();
      while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
             1e-3) {
      }
    }
    DS_CHECK_CUDA(cudaEventRecord(e0, ps));
    probe();
    DS_CHECK_CUDA(cudaEventRecord(e1, ps));
    DS_CHECK_CUDA(cudaDeviceSynchronize());
    float ms = 0;
    DS_CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    DS_CHECK_CUDA(cudaEventDestroy(e0));
    DS_CHECK_CUDA(cudaEventDestroy(e1));
    return double(ms);
  };
  // Warm-up: every probe once, the blocker once.
  for (auto& p : probes) time_one(p.second, false);
  time_one([] {}, true);

  std::vector<Row> rows;
  for (auto& p : probes) {
    std::vector<double> a, b;
    for (int r = 0; r < 3; ++r) {
      a.push_back(time_one(p.second, false));
      b.push_back(time_one(p.second, true));
    }
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    rows.push_back({p.first, a[1], b[1]});
  }
  std::printf(
      "%s, %d SMs; blocker %.0f ms on every SM, probe enqueued ~1 ms after it on a "
      "priority-%d stream; %zu bytes moved by the copies and puts\n",
      prop.name, sms, block_ms, hi, bytes);
  std::printf("%-34s %10s %12s  %s\n", "primitive", "alone ms", "beside ms", "verdict");
  for (const Row& r : rows) {
    const bool waits = r.beside_ms > r.alone_ms + 0.5 * (block_ms - 1);
    std::printf("%-34s %10.3f %12.3f  %s\n", r.name.c_str(), r.alone_ms, r.beside_ms,
                waits ? "waits for the SMs" : "runs beside");
  }
  // The control: the SM kernel must have waited, else the blocker did not hold every SM and the
  // other rows say nothing.
  const bool control_ok = rows[0].beside_ms > rows[0].alone_ms + 0.5 * (block_ms - 1);
  if (!control_ok) {
    std::fprintf(stderr,
                 "the SM kernel ran beside the blocker: the blocker did not hold every "
                 "SM, so the rows above are not meaningful\n");
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"gpu\": \"%s\", \"sms\": %d, \"block_ms\": %.1f, \"bytes\": %zu, "
                 "\"control_ok\": %s, \"rows\": [",
                 prop.name, sms, block_ms, bytes, control_ok ? "true" : "false");
    for (size_t i = 0; i < rows.size(); ++i) {
      std::fprintf(f, "%s{\"primitive\": \"%s\", \"alone_ms\": %.4f, \"beside_ms\": %.4f}",
                   i ? ", " : "", rows[i].name.c_str(), rows[i].alone_ms, rows[i].beside_ms);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  shm.Free(sig);
  shm.Free(sym_dst);
  return control_ok ? 0 : 1;
}

}  // namespace

// A failed CUDA runtime or driver call (DS_CHECK_CUDA / DS_CHECK_CU throw) prints "file:line:
// CUDA error <name>: <text> in <call>" and exits 1.
int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sp_overlap_probe: %s\n", e.what());
    return 1;
  }
}
