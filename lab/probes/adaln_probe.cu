// lab/probes/adaln_probe: where a row-wise forward pass loses bandwidth against a device copy.
//
// The AdaLN forward (warp-per-row kernel, internal/adaln_fwd_warp.cuh) reaches ~80% of the copy
// bandwidth for 3 KB rows (D = 1536 bf16) and ~91% for 6 KB rows (bulk-copy kernel). This probe
// times kernels that add the forward's pieces one at a time, on the same rows, so the step that
// costs the bandwidth shows up as a drop in one column:
//   copy   a warp loads its whole row into registers, then stores it unchanged
//   stats  + mean and variance by warp shuffles, mean/rstd stored, y = (x - mean) * rstd
//   coefs  + per-16-byte-vector (1 + scale) and shift loads from a [D] modulation as each vector
//          is written (as the per-sample AdaLN kernels did): y = xhat * (1 + scale) + shift
//   hoist  the same, with all of the row's scale/shift vectors loaded (packed) right after its x
//          loads, before the reduction and the first store
//   pipe   the same, the row's first two scale/shift vectors loaded with its x loads and each
//          next one two vectors ahead of the one being written (pipe1: one ahead)
//   cache  the same, the packed scale/shift vectors loaded once per warp and kept in registers
//          across the rows it walks (per-sample modulation: every row of a sample shares them)
//   cachel cache with the packed vectors made opaque in each row (the compiler would convert
//          them to floats once and hold 4x the registers)
//   lib    the library's adaln_forward_cuda with its default tuning (the same shape)
// each one-warp-per-row ("flat": grid of all rows) or persistent (a fixed number of warps per SM,
// each walking rows; "pref": the next row's loads issued before the current one is finished,
// "walk": no prefetch; "flat5" / "walk5" / "flat6" / "flat7": compiled for 5 / 5 / 6 / 7
// resident blocks of 4 warps), with or
// without streaming cache hints (ld/st .cs). Reference: cudaMemcpyAsync device-to-device of x (the
// copy limit the benchmarks use). L2 is flushed (a 256 MiB memset) before every timed launch; times
// are medians of 21 CUDA-event-timed launches. Bytes counted: 2 x |x| (read x, write y).
//
// Usage: adaln_probe [--d 1024,1536,2048,3072 (512, 1024, 1536, 2048, 3072, 4096 or 5120)]
//                    [--n 16384,65536] [--warps 8,16,24,32,48,64]
//                    [--modes copy,stats,coefs,hoist,pipe,pipe1,cache,cachel,lib]
//                    [--hints 1,0 (1: .cs loads and stores, 0: none, 2: x loads not allocated
//                    in L1)]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/adaln/adaln_bench_util.cuh"
#include "ditscale/kernels/adaln.h"

namespace {

using ditscale::bench::Buf;
using ditscale::bench::check;
using ditscale::bench::fill_pattern;
using ditscale::bench::split_commas;

enum Mode {
  kCopy = 0,
  kStats = 1,
  kCoefs = 2,
  kHoist = 3,
  kCache = 4,
  kPipe = 5,
  kCacheL = 6,
  kPipe1 = 7
};

// Coefficient vectors the pipe modes load ahead of the one they write (0: not a pipe mode).
__host__ __device__ constexpr int pipe_ahead(int mode) {
  return mode == kPipe ? 2 : mode == kPipe1 ? 1 : 0;
}

struct ProbeArgs {
  const uint4* x;
  uint4* y;
  const uint4* scale;  // [D] bf16, 16-byte vectors
  const uint4* shift;
  float* mean;
  float* rstd;
  unsigned rows;
  int nvec;  // 16-byte vectors per row
  float inv_d;
  int hints;  // 0 none, 1 streaming (.cs) loads and stores, 2 x loads not allocated in L1
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ void unpack8(const uint4& r, float (&v)[8]) {
  const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&r);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(e[i]);
}

__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
  uint4 r;
  __nv_bfloat16* e = reinterpret_cast<__nv_bfloat16*>(&r);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = __float2bfloat16_rn(v[i]);
  return r;
}

// 16 bytes of x, not allocated in L1 (so streaming x does not evict the modulation there).
__device__ __forceinline__ uint4 ld_no_l1(const uint4* p) {
  uint4 r;
  asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

template <int kVecs>
__device__ __forceinline__ void load_row(const ProbeArgs& a, unsigned u, int lane,
                                         uint4 (&raw)[kVecs]) {
  const uint4* src = a.x + static_cast<std::size_t>(u) * a.nvec;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * 32 + lane;
    raw[j] = (u < a.rows && vi < a.nvec) ? (a.hints == 1   ? __ldcs(src + vi)
                                            : a.hints == 2 ? ld_no_l1(src + vi)
                                                           : src[vi])
                                         : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <int kVecs, int kCount = kVecs>
__device__ __forceinline__ void load_coefs(const ProbeArgs& a, int lane, uint4 (&sc)[kVecs],
                                           uint4 (&sh)[kVecs]) {
#pragma unroll
  for (int j = 0; j < (kCount < kVecs ? kCount : kVecs); ++j) {
    const int vi = j * 32 + lane;
    sc[j] = vi < a.nvec ? a.scale[vi] : make_uint4(0u, 0u, 0u, 0u);
    sh[j] = vi < a.nvec ? a.shift[vi] : make_uint4(0u, 0u, 0u, 0u);
  }
}

template <int kVecs, int kMode>
__device__ __forceinline__ void finish_row(const ProbeArgs& a, unsigned u, int lane,
                                           const uint4 (&raw)[kVecs], uint4 (&csc)[kVecs],
                                           uint4 (&csh)[kVecs]) {
  float mean = 0.f, rstd = 1.f;
  if constexpr (kMode >= kStats) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      float v[8];
      unpack8(raw[j], v);
#pragma unroll
      for (int e = 0; e < 8; ++e) s += v[e];
    }
    mean = warp_sum(s) * a.inv_d;
    float q = 0.f;
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      if (j * 32 + lane < a.nvec) {
        float v[8];
        unpack8(raw[j], v);
#pragma unroll
        for (int e = 0; e < 8; ++e) q = fmaf(v[e] - mean, v[e] - mean, q);
      }
    }
    rstd = rsqrtf(warp_sum(q) * a.inv_d + 1e-6f);
  }
  if (u >= a.rows) return;
  if constexpr (kMode >= kStats) {
    if (lane == 0) {
      a.mean[u] = mean;
      a.rstd[u] = rstd;
    }
  }
  uint4* dst = a.y + static_cast<std::size_t>(u) * a.nvec;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int vi = j * 32 + lane;
    if (vi >= a.nvec) continue;
    uint4 out = raw[j];
    if constexpr (kMode >= kStats) {
      float v[8];
      unpack8(raw[j], v);
      if constexpr (kMode >= kCoefs) {
        float sc[8], sh[8];
        unpack8(kMode == kCoefs ? a.scale[vi] : csc[j], sc);
        unpack8(kMode == kCoefs ? a.shift[vi] : csh[j], sh);
        constexpr int kAhead = pipe_ahead(kMode);
        if constexpr (kAhead > 0) {
          const int va = (j + kAhead) * 32 + lane;
          if (j + kAhead < kVecs && va < a.nvec) {
            csc[j + kAhead] = a.scale[va];
            csh[j + kAhead] = a.shift[va];
          }
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = fmaf((v[e] - mean) * rstd, 1.f + sc[e], sh[e]);
      } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = (v[e] - mean) * rstd;
      }
      out = pack8(v);
    }
    if (a.hints == 1) {
      __stcs(dst + vi, out);
    } else {
      dst[vi] = out;
    }
  }
}

// One warp per row (kPersist false, grid of all rows) or a persistent grid whose warps walk rows
// w, w + warps, ... (kPrefetch: the next row's loads issued before the current row is finished).
// Makes the packed coefficients opaque in each iteration, so the compiler cannot convert the
// loop-invariant vectors to floats once and keep 4x the registers (cachel mode).
template <int kVecs>
__device__ __forceinline__ void launder(uint4 (&v)[kVecs]) {
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    asm volatile("" : "+r"(v[j].x), "+r"(v[j].y), "+r"(v[j].z), "+r"(v[j].w));
  }
}

// Coefficient loads issued with the row's x loads (before its reduction) by each mode.
template <int kVecs, int kMode>
__device__ __forceinline__ void row_coefs(const ProbeArgs& a, int lane, uint4 (&sc)[kVecs],
                                          uint4 (&sh)[kVecs]) {
  if constexpr (kMode == kHoist) load_coefs<kVecs>(a, lane, sc, sh);
  if constexpr (pipe_ahead(kMode) > 0) load_coefs<kVecs, pipe_ahead(kMode)>(a, lane, sc, sh);
  if constexpr (kMode == kCacheL) {
    launder<kVecs>(sc);
    launder<kVecs>(sh);
  }
}

template <int kVecs, int kMode, bool kPersist, bool kPrefetch, int kMinBlocks>
__global__ void __launch_bounds__(128, kMinBlocks) probe_kernel(const ProbeArgs a) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  const unsigned warps = gridDim.x * (blockDim.x / 32);
  unsigned u = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  constexpr bool kCached = kMode == kCache || kMode == kCacheL;
  uint4 raw[kVecs];
  uint4 sc[kVecs], sh[kVecs];
  if constexpr (kCached) load_coefs<kVecs>(a, lane, sc, sh);
  if constexpr (!kPersist) {
    load_row<kVecs>(a, u, lane, raw);
    if constexpr (!kCached) row_coefs<kVecs, kMode>(a, lane, sc, sh);
    finish_row<kVecs, kMode>(a, u, lane, raw, sc, sh);
  } else if constexpr (kPrefetch) {
    load_row<kVecs>(a, u, lane, raw);
    for (; u < a.rows; u += warps) {
      uint4 next[kVecs];
      load_row<kVecs>(a, u + warps, lane, next);
      row_coefs<kVecs, kMode>(a, lane, sc, sh);
      finish_row<kVecs, kMode>(a, u, lane, raw, sc, sh);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) raw[j] = next[j];
    }
  } else {
    for (; u < a.rows; u += warps) {
      load_row<kVecs>(a, u, lane, raw);
      row_coefs<kVecs, kMode>(a, lane, sc, sh);
      finish_row<kVecs, kMode>(a, u, lane, raw, sc, sh);
    }
  }
}

using KernelFn = void (*)(ProbeArgs);

// grid: 0 flat, 1 persistent with prefetch, 2 persistent without, 3 / 4: flat / persistent
// without prefetch compiled for 5 resident blocks (<= 102 registers), 5 / 6: flat for 6 / 7
// (<= 85 / 73 registers).
template <int kVecs, int kMode>
KernelFn pick_grid(int grid) {
  switch (grid) {
    case 0:
      return probe_kernel<kVecs, kMode, false, false, 1>;
    case 1:
      return probe_kernel<kVecs, kMode, true, true, 1>;
    case 2:
      return probe_kernel<kVecs, kMode, true, false, 1>;
    case 3:
      return probe_kernel<kVecs, kMode, false, false, 5>;
    case 4:
      return probe_kernel<kVecs, kMode, true, false, 5>;
    case 5:
      return probe_kernel<kVecs, kMode, false, false, 6>;
    default:
      return probe_kernel<kVecs, kMode, false, false, 7>;
  }
}

template <int kVecs>
KernelFn pick_kernel(int mode, int grid) {
  switch (mode) {
    case kCopy:
      return pick_grid<kVecs, kCopy>(grid);
    case kStats:
      return pick_grid<kVecs, kStats>(grid);
    case kCoefs:
      return pick_grid<kVecs, kCoefs>(grid);
    case kHoist:
      return pick_grid<kVecs, kHoist>(grid);
    case kCache:
      return pick_grid<kVecs, kCache>(grid);
    case kPipe:
      return pick_grid<kVecs, kPipe>(grid);
    case kPipe1:
      return pick_grid<kVecs, kPipe1>(grid);
    default:
      return pick_grid<kVecs, kCacheL>(grid);
  }
}

KernelFn kernel_for(int vecs_per_lane, int mode, int grid) {
  switch (vecs_per_lane) {
    case 2:
      return pick_kernel<2>(mode, grid);
    case 4:
      return pick_kernel<4>(mode, grid);
    case 6:
      return pick_kernel<6>(mode, grid);
    case 8:
      return pick_kernel<8>(mode, grid);
    case 12:
      return pick_kernel<12>(mode, grid);
    case 16:
      return pick_kernel<16>(mode, grid);
    case 20:
      return pick_kernel<20>(mode, grid);
    default:
      std::fprintf(stderr, "adaln_probe: no kernel for %d vectors per lane (D = %d)\n",
                   vecs_per_lane, vecs_per_lane * 256);
      std::exit(2);
  }
}

std::vector<long> parse_list(const char* s, const char* flag) {
  std::vector<long> v;
  for (const char* p = s; *p;) {
    char* end = nullptr;
    const long x = std::strtol(p, &end, 10);
    if (end == p || x <= 0) {
      std::fprintf(stderr, "adaln_probe: bad value in %s '%s'\n", flag, s);
      std::exit(2);
    }
    v.push_back(x);
    p = *end == ',' ? end + 1 : end;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<long> ds = {1024, 1536, 2048, 3072};
  std::vector<long> ns = {16384, 65536};
  std::vector<long> warps_per_sm = {8, 12, 16, 20, 24, 32, 48, 64};
  std::vector<long> hints = {1, 0};
  std::vector<std::string> modes = {"copy", "stats", "coefs", "hoist", "cache", "lib"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--d LIST] [--n LIST] [--warps LIST] [--modes LIST] [--hints 1,0]\n",
                   argv[0]);
      return 2;
    }
    if (arg == "--d") {
      ds = parse_list(argv[++i], "--d");
    } else if (arg == "--n") {
      ns = parse_list(argv[++i], "--n");
    } else if (arg == "--warps") {
      warps_per_sm = parse_list(argv[++i], "--warps");
    } else if (arg == "--hints") {
      hints.clear();
      for (const std::string& w : split_commas(argv[++i])) hints.push_back(std::atoi(w.c_str()));
    } else if (arg == "--modes") {
      modes = split_commas(argv[++i]);
    } else {
      std::fprintf(stderr, "adaln_probe: unknown option '%s'\n", arg.c_str());
      return 2;
    }
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("adaln_probe: no CUDA device, nothing to do\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const int sms = prop.multiProcessorCount;
  std::printf("device: %s (%d SMs); bf16 rows, L2 flushed before each launch\n", prop.name, sms);
  std::printf("%-6s %-7s %-5s %6s %5s %5s %4s | %8s %6s | %8s %6s %6s\n", "mode", "grid", "hints",
              "N", "D", "w/SM", "regs", "copy_ms", "GB/s", "ms", "GB/s", "%copy");
  const std::size_t flush_bytes = 256u << 20;
  Buf flush(flush_bytes);
  auto time_ms = [&](const std::function<void()>& fn) {
    for (int i = 0; i < 3; ++i) fn();
    check(cudaDeviceSynchronize(), "warmup");
    std::vector<float> ms;
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    for (int i = 0; i < 21; ++i) {
      check(cudaMemsetAsync(flush.p, i & 0xff, flush_bytes), "flush");
      check(cudaEventRecord(e0), "record");
      fn();
      check(cudaEventRecord(e1), "record");
      check(cudaEventSynchronize(e1), "sync");
      float t = 0.f;
      check(cudaEventElapsedTime(&t, e0, e1), "elapsed");
      ms.push_back(t);
    }
    check(cudaGetLastError(), "timed launch");
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return static_cast<double>(ms[ms.size() / 2]);
  };
  for (long N : ns) {
    for (long D : ds) {
      if (D % 256 != 0) {
        std::fprintf(stderr, "adaln_probe: D = %ld is not a multiple of 256\n", D);
        return 2;
      }
      const std::size_t elems = static_cast<std::size_t>(N) * D;
      const std::size_t xbytes = elems * 2;
      Buf x(xbytes), y(xbytes), c(xbytes), mod(static_cast<std::size_t>(2 * D) * 2);
      Buf mean(static_cast<std::size_t>(N) * 4), rstd(static_cast<std::size_t>(N) * 4);
      fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(x.p), elems, 1u);
      fill_pattern<<<64, 256>>>(static_cast<std::uint16_t*>(mod.p), 2 * D, 3u);
      check(cudaGetLastError(), "fill");
      const double copy_ms = time_ms(
          [&] { check(cudaMemcpyAsync(c.p, x.p, xbytes, cudaMemcpyDeviceToDevice), "copy"); });
      const double copy_bw = 2e-6 * xbytes / copy_ms;
      auto row = [&](const char* mode, const char* grid, const char* hints, int wps, KernelFn fn,
                     double ms) {
        cudaFuncAttributes attr{};
        if (fn != nullptr) check(cudaFuncGetAttributes(&attr, fn), "cudaFuncGetAttributes");
        const double bw = 2e-6 * xbytes / ms;
        std::printf("%-6s %-7s %-5s %6ld %5ld %5d %4d | %8.4f %6.0f | %8.4f %6.0f %5.1f%%\n", mode,
                    grid, hints, N, D, wps, attr.numRegs, copy_ms, copy_bw, ms, bw,
                    100.0 * bw / copy_bw);
        std::fflush(stdout);
      };
      ProbeArgs a{};
      a.x = static_cast<const uint4*>(x.p);
      a.y = static_cast<uint4*>(y.p);
      a.scale = static_cast<const uint4*>(mod.p);
      a.shift = static_cast<const uint4*>(mod.p) + D / 8;
      a.mean = static_cast<float*>(mean.p);
      a.rstd = static_cast<float*>(rstd.p);
      a.rows = static_cast<unsigned>(N);
      a.nvec = static_cast<int>(D / 8);
      a.inv_d = 1.f / static_cast<float>(D);
      const int vecs = static_cast<int>(D / 256);
      for (const std::string& m : modes) {
        if (m == "lib") {
          using namespace ditscale::kernels;
          AdaLNFwdParams f;
          f.batch = 1;
          f.seq_len = N;
          f.dim = D;
          f.dtype = DType::kBFloat16;
          f.shift = {static_cast<std::uint16_t*>(mod.p) + D, DType::kBFloat16, 2 * D, 0};
          f.scale = {mod.p, DType::kBFloat16, 2 * D, 0};
          f.x = {x.p, DType::kBFloat16, N * D, D};
          f.y = y.p;
          f.mean = static_cast<float*>(mean.p);
          f.rstd = static_cast<float*>(rstd.p);
          row("lib", "default", "-", 0, nullptr, time_ms([&] { adaln_forward_cuda(f, nullptr); }));
          continue;
        }
        const int mi = m == "copy"     ? kCopy
                       : m == "stats"  ? kStats
                       : m == "coefs"  ? kCoefs
                       : m == "hoist"  ? kHoist
                       : m == "cache"  ? kCache
                       : m == "pipe"   ? kPipe
                       : m == "cachel" ? kCacheL
                       : m == "pipe1"  ? kPipe1
                                       : -1;
        if (mi < 0) {
          std::fprintf(stderr, "adaln_probe: unknown mode '%s'\n", m.c_str());
          return 2;
        }
        for (long h : hints) {
          a.hints = static_cast<int>(h);
          const char* hs = h == 1 ? "cs" : h == 2 ? "nol1" : "none";
          const bool cached = mi == kCache || mi == kCacheL;
          for (int g = 0; g <= 6; ++g) {
            const bool flat = g == 0 || g == 3 || g >= 5;
            if (flat && cached) continue;  // a flat grid is hoist
            KernelFn fn = kernel_for(vecs, mi, g);
            const char* gname = g == 0   ? "flat"
                                : g == 1 ? "pref"
                                : g == 2 ? "walk"
                                : g == 3 ? "flat5"
                                : g == 4 ? "walk5"
                                : g == 5 ? "flat6"
                                         : "flat7";
            if (flat) {
              const unsigned flat_blocks = static_cast<unsigned>((N + 3) / 4);
              row(m.c_str(), gname, hs, 0, fn, time_ms([&] { fn<<<flat_blocks, 128>>>(a); }));
              continue;
            }
            int resident = 0;
            check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, fn, 128, 0),
                  "occupancy");
            for (long w : warps_per_sm) {
              const int blocks_per_sm = static_cast<int>(w / 4);
              if (blocks_per_sm < 1 || blocks_per_sm > resident) continue;
              const unsigned grid = static_cast<unsigned>(blocks_per_sm * sms);
              row(m.c_str(), gname, hs, static_cast<int>(w), fn,
                  time_ms([&] { fn<<<grid, 128>>>(a); }));
            }
          }
        }
      }
    }
  }
  return 0;
}
