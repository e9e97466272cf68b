// bench/adaln: CUDA-event timing of the fused AdaLN forward and backward (bf16, LayerNorm,
// per-sample modulation as chunks of a [B, 6, D] tensor) against a device-to-device copy of x,
// the speed-of-light of a pass that reads x and writes y. Prints one table row per shape:
//   variant B N D | copy ms GB/s | fwd ms GB/s %copy | bwd ms GB/s %copy | fwd+bwd ms
// Bytes counted: copy and forward 2 * |x|; backward 3 * |x| (reads x, dy; writes dx).
// --gated: the gated ops of a DiT block instead (h = residual + gate * branch, then the AdaLN of
// h; gate, scale and shift rows of the [B, 6, D] tensor; dgate reduced, dh_out given): forward
// 4 * |x| (reads residual, branch; writes h, y), backward 6 * |x| (reads residual, branch, dy,
// dh_out; writes dresidual, dbranch), the bytes of the fused kernels' speed-of-light.
// Times are medians of per-launch CUDA-event timings after a warm-up.
//
// Usage: adaln_kernel_bench [--quick] [--variants LIST]
//   --quick     only B = 1, N = 16384, 65536 (D = 1536, 3072, 5120)
//   --variants  comma-separated, each `auto` (the plans of ditscale/kernels/internal/adaln_plan.h),
//               `base` (the first kernels), `pipe` / `tma` / `warp` (the forward's cp.async,
//               bulk-copy or warp-per-row kernel where it applies: AdaLNTuning::fwd_kernel 1 / 2
//               / 3), or `knob=value[+knob=value...]`: the defaults with AdaLNTuning fields set by
//               name (e.g. `pdl=0`, `fwd_kernel=1+max_resident_blocks=264`). The search variants
//               of the kernel tuning (ring depths, rows per group, store and hint variants) left
//               the library: lab/adaln-kernel-notes.md, "Removed variants".
//               Default `auto,pipe`.
//   --fwd-only  skip the backward timings (columns show 0)
//   --gated     time the gated forward and backward (above)
//   --shapes    B:N:D,... instead of the default shapes (e.g. one shape under Nsight Compute)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "bench/adaln/adaln_bench_util.cuh"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_tuning.h"

namespace {

using ditscale::bench::Buf;
using ditscale::bench::check;
using ditscale::bench::fill_pattern;

// Median milliseconds of fn() over `iters` runs (each timed by its own pair of events) after
// `warmup` runs.
double time_ms(const std::function<void()>& fn, int warmup = 3, int iters = 25) {
  for (int i = 0; i < warmup; ++i) fn();
  check(cudaGetLastError(), "warmup launch");
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) check(cudaEventCreate(&e), "cudaEventCreate");
  for (int i = 0; i < iters; ++i) {
    check(cudaEventRecord(ev[2 * i]), "cudaEventRecord");
    fn();
    check(cudaEventRecord(ev[2 * i + 1]), "cudaEventRecord");
  }
  check(cudaEventSynchronize(ev.back()), "cudaEventSynchronize");
  check(cudaGetLastError(), "timed launch");
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) {
    check(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
  }
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

struct Variant {
  std::string name;
  ditscale::kernels::internal::AdaLNTuning tuning;
};

// "auto", "base", "pipe", "tma", "warp" or "knob=value+..." -> tuning knobs.
Variant parse_variant(const std::string& spec) {
  Variant v{spec, {}};
  if (spec == "base") {
    v.tuning.pipelined = false;
    return v;
  }
  if (spec == "auto") return v;
  if (spec.find('=') != std::string::npos) {  // knob=value[+knob=value...] on the defaults
    std::string text = spec;
    std::replace(text.begin(), text.end(), '+', ',');
    try {
      ditscale::kernels::internal::apply_adaln_tuning(v.tuning, text.c_str(), "--variants");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      std::exit(2);
    }
    return v;
  }
  const int kernel = spec == "pipe" ? 1 : (spec == "tma" ? 2 : (spec == "warp" ? 3 : 0));
  if (kernel == 0) {
    std::fprintf(stderr,
                 "unknown variant '%s' (auto, base, pipe, tma, warp or knob=value; the search "
                 "variants were removed, see lab/adaln-kernel-notes.md)\n",
                 spec.c_str());
    std::exit(2);
  }
  v.tuning.fwd_kernel = kernel;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ditscale::kernels;
  bool quick = false;
  bool fwd_only = false;
  bool gated = false;
  std::string variants = "auto,pipe";
  std::string shapes_arg;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--fwd-only") {
      fwd_only = true;
    } else if (arg == "--gated") {
      gated = true;
    } else if (arg == "--variants" && i + 1 < argc) {
      variants = argv[++i];
    } else if (arg == "--shapes" && i + 1 < argc) {
      shapes_arg = argv[++i];
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--quick] [--fwd-only] [--gated] [--variants auto,base,pipe,pdl=0,...] "
          "[--shapes B:N:D,...]\n",
          argv[0]);
      return 2;
    }
  }
  std::vector<Variant> vs;
  for (const std::string& spec : ditscale::bench::split_commas(variants)) {
    vs.push_back(parse_variant(spec));
  }
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("adaln_kernel_bench: no CUDA device, nothing to do\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s (%d SMs)%s\n", prop.name, prop.multiProcessorCount,
              gated ? ", gated ops (fwd 4 |x|, bwd 6 |x|)" : "");
  std::printf("%-10s %2s %6s %5s | %7s %6s | %7s %6s %6s | %7s %6s %6s | %7s\n", "variant", "B",
              "N", "D", "copy_ms", "GB/s", "fwd_ms", "GB/s", "%copy", "bwd_ms", "GB/s", "%copy",
              "f+b_ms");
  std::vector<std::int64_t> ns = {4096, 16384, 65536};
  std::vector<std::int64_t> ds = {1024, 1536, 3072, 5120};
  std::vector<std::int64_t> bs = {1, 2};
  if (quick) {
    ns = {16384, 65536};
    bs = {1};
  }
  struct Shape {
    std::int64_t b, n, d;
  };
  std::vector<Shape> shapes;
  for (std::int64_t B : bs) {
    for (std::int64_t N : ns) {
      for (std::int64_t D : ds) shapes.push_back({B, N, D});
    }
  }
  if (!shapes_arg.empty()) {
    shapes.clear();
    for (const std::string& spec : ditscale::bench::split_commas(shapes_arg)) {
      long long b = 0, n = 0, d = 0;
      if (std::sscanf(spec.c_str(), "%lld:%lld:%lld", &b, &n, &d) != 3 || b < 1 || n < 1 || d < 8 ||
          d % 8 != 0) {
        std::fprintf(stderr, "--shapes: '%s' is not B:N:D (D a multiple of 8)\n", spec.c_str());
        return 2;
      }
      shapes.push_back({b, n, d});
    }
  }
  for (const Shape& shape : shapes) {
    {
      {
        const std::int64_t B = shape.b, N = shape.n, D = shape.d;
        const std::size_t elems = static_cast<std::size_t>(B * N * D);
        const std::size_t xbytes = elems * 2;
        Buf x(xbytes), y(xbytes), dy(xbytes), dx(xbytes), copy(xbytes);
        Buf branch(gated ? xbytes : 0), h(gated ? xbytes : 0), dh(gated ? xbytes : 0),
            dbranch(gated ? xbytes : 0), dgate(gated ? B * D * 2 : 0);
        Buf mod(static_cast<std::size_t>(B * 6 * D) * 2);
        Buf mean(B * N * 4), rstd(B * N * 4);
        Buf dscale(B * D * 2), dshift(B * D * 2);
        fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(x.p), elems, 1u);
        fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(dy.p), elems, 2u);
        fill_pattern<<<64, 256>>>(static_cast<std::uint16_t*>(mod.p), B * 6 * D, 3u);
        if (gated) {
          fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(branch.p), elems, 4u);
          fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(dh.p), elems, 5u);
        }
        check(cudaGetLastError(), "fill_pattern");

        AdaLNFwdParams f;
        f.batch = B;
        f.seq_len = N;
        f.dim = D;
        f.dtype = DType::kBFloat16;
        f.shift = {mod.p, DType::kBFloat16, 6 * D, 0};
        f.scale = {static_cast<std::uint16_t*>(mod.p) + D, DType::kBFloat16, 6 * D, 0};
        f.x = {x.p, DType::kBFloat16, N * D, D};
        if (gated) {
          f.gate = {static_cast<std::uint16_t*>(mod.p) + 2 * D, DType::kBFloat16, 6 * D, 0};
          f.residual = f.x;
          f.x = {};
          f.branch = {branch.p, DType::kBFloat16, N * D, D};
          f.h = h.p;
        }
        f.y = y.p;
        f.mean = static_cast<float*>(mean.p);
        f.rstd = static_cast<float*>(rstd.p);

        AdaLNBwdParams b;
        static_cast<AdaLNConfig&>(b) = static_cast<const AdaLNConfig&>(f);
        b.x = f.x;
        if (gated) {
          b.residual = f.residual;
          b.branch = f.branch;
          b.dh_out = {dh.p, DType::kBFloat16, N * D, D};
          b.dbranch = dbranch.p;
          b.dgate = dgate.p;
        }
        b.mean = f.mean;
        b.rstd = f.rstd;
        b.dy = {dy.p, DType::kBFloat16, N * D, D};
        b.dx = dx.p;
        b.dscale = dscale.p;
        b.dshift = dshift.p;
        Buf ws(adaln_backward_workspace_bytes(b));
        b.workspace = ws.p;
        b.workspace_bytes = adaln_backward_workspace_bytes(b);

        const double copy_ms = time_ms(
            [&] { check(cudaMemcpyAsync(copy.p, x.p, xbytes, cudaMemcpyDeviceToDevice), "copy"); });
        const double gbps = 1e-6;  // bytes per ms -> GB/s
        const double copy_bw = 2.0 * xbytes / copy_ms * gbps;
        for (const Variant& v : vs) {
          internal::adaln_tuning() = v.tuning;
          const double fwd_ms = time_ms([&] { adaln_forward_cuda(f, nullptr); });
          const double bwd_ms = fwd_only ? 0.0 : time_ms([&] { adaln_backward_cuda(b, nullptr); });
          const double fwd_bw = (gated ? 4.0 : 2.0) * xbytes / fwd_ms * gbps;
          const double bwd_bw = fwd_only ? 0.0 : (gated ? 6.0 : 3.0) * xbytes / bwd_ms * gbps;
          std::printf(
              "%-10s %2lld %6lld %5lld | %7.3f %6.0f | %7.3f %6.0f %5.1f%% | %7.3f %6.0f %5.1f%% | "
              "%7.3f\n",
              v.name.c_str(), static_cast<long long>(B), static_cast<long long>(N),
              static_cast<long long>(D), copy_ms, copy_bw, fwd_ms, fwd_bw, 100.0 * fwd_bw / copy_bw,
              bwd_ms, bwd_bw, 100.0 * bwd_bw / copy_bw, fwd_ms + bwd_ms);
        }
        internal::adaln_tuning() = internal::AdaLNTuning{};
      }
    }
  }
  return 0;
}
