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

struct Options {
  bool quick = false;
  bool fwd_only = false;
  bool gated = false;
  std::string variants = "auto,pipe";
  std::string shapes;
};

// argv -> options; false (after printing the usage) on an unknown argument.
bool parse_args(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--fwd-only") {
      o.fwd_only = true;
    } else if (arg == "--gated") {
      o.gated = true;
    } else if (arg == "--variants" && i + 1 < argc) {
      o.variants = argv[++i];
    } else if (arg == "--shapes" && i + 1 < argc) {
      o.shapes = argv[++i];
    } else {
      std::fprintf(
          stderr,
          "usage: %s [--quick] [--fwd-only] [--gated] [--variants auto,base,pipe,pdl=0,...] "
          "[--shapes B:N:D,...]\n",
          argv[0]);
      return false;
    }
  }
  return true;
}

struct Shape {
  std::int64_t b, n, d;
};

// The shapes timed: --shapes, else the default grid (--quick: a smaller one). False (after a
// message) on a malformed --shapes entry.
bool shapes_of(const Options& o, std::vector<Shape>& shapes) {
  if (!o.shapes.empty()) {
    for (const std::string& spec : ditscale::bench::split_commas(o.shapes)) {
      long long b = 0, n = 0, d = 0;
      if (std::sscanf(spec.c_str(), "%lld:%lld:%lld", &b, &n, &d) != 3 || b < 1 || n < 1 || d < 8 ||
          d % 8 != 0) {
        std::fprintf(stderr, "--shapes: '%s' is not B:N:D (D a multiple of 8)\n", spec.c_str());
        return false;
      }
      shapes.push_back({b, n, d});
    }
    return true;
  }
  std::vector<std::int64_t> ns = {4096, 16384, 65536};
  const std::vector<std::int64_t> ds = {1024, 1536, 3072, 5120};
  std::vector<std::int64_t> bs = {1, 2};
  if (o.quick) {
    ns = {16384, 65536};
    bs = {1};
  }
  for (std::int64_t B : bs) {
    for (std::int64_t N : ns) {
      for (std::int64_t D : ds) shapes.push_back({B, N, D});
    }
  }
  return true;
}

// The device buffers of one shape (bf16 unless noted; the gated ones empty when not gated).
struct ShapeBufs {
  ShapeBufs(const Shape& s, bool gated)
      : elems(static_cast<std::size_t>(s.b * s.n * s.d)),
        xbytes(elems * 2),
        x(xbytes),
        y(xbytes),
        dy(xbytes),
        dx(xbytes),
        copy(xbytes),
        branch(gated ? xbytes : 0),
        h(gated ? xbytes : 0),
        dh(gated ? xbytes : 0),
        dbranch(gated ? xbytes : 0),
        dgate(gated ? s.b * s.d * 2 : 0),
        mod(static_cast<std::size_t>(s.b * 6 * s.d) * 2),
        mean(s.b * s.n * 4),
        rstd(s.b * s.n * 4),  // fp32
        dscale(s.b * s.d * 2),
        dshift(s.b * s.d * 2) {}
  std::size_t elems, xbytes;
  Buf x, y, dy, dx, copy;
  Buf branch, h, dh, dbranch, dgate;
  Buf mod;  // [B, 6, D]: shift, scale, gate, ...
  Buf mean, rstd;
  Buf dscale, dshift;
};

// Deterministic inputs: x, dy, the modulation (and branch, dh_out when gated).
void fill_inputs(ShapeBufs& m, const Shape& s, bool gated) {
  fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(m.x.p), m.elems, 1u);
  fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(m.dy.p), m.elems, 2u);
  fill_pattern<<<64, 256>>>(static_cast<std::uint16_t*>(m.mod.p), s.b * 6 * s.d, 3u);
  if (gated) {
    fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(m.branch.p), m.elems, 4u);
    fill_pattern<<<1024, 256>>>(static_cast<std::uint16_t*>(m.dh.p), m.elems, 5u);
  }
  check(cudaGetLastError(), "fill_pattern");
}

// The forward's parameters: LayerNorm of x (gated: of h = residual + gate * branch), per-sample
// shift and scale (and gate) rows of mod.
ditscale::kernels::AdaLNFwdParams fwd_params(ShapeBufs& m, const Shape& s, bool gated) {
  using ditscale::kernels::DType;
  const std::int64_t N = s.n, D = s.d;
  ditscale::kernels::AdaLNFwdParams f;
  f.batch = s.b;
  f.seq_len = N;
  f.dim = D;
  f.dtype = DType::kBFloat16;
  f.shift = {m.mod.p, DType::kBFloat16, 6 * D, 0};
  f.scale = {static_cast<std::uint16_t*>(m.mod.p) + D, DType::kBFloat16, 6 * D, 0};
  f.x = {m.x.p, DType::kBFloat16, N * D, D};
  if (gated) {
    f.gate = {static_cast<std::uint16_t*>(m.mod.p) + 2 * D, DType::kBFloat16, 6 * D, 0};
    f.residual = f.x;
    f.x = {};
    f.branch = {m.branch.p, DType::kBFloat16, N * D, D};
    f.h = m.h.p;
  }
  f.y = m.y.p;
  f.mean = static_cast<float*>(m.mean.p);
  f.rstd = static_cast<float*>(m.rstd.p);
  return f;
}

// The backward's parameters matching forward f (workspace not set).
ditscale::kernels::AdaLNBwdParams bwd_params(ShapeBufs& m, const Shape& s, bool gated,
                                             const ditscale::kernels::AdaLNFwdParams& f) {
  using ditscale::kernels::DType;
  const std::int64_t N = s.n, D = s.d;
  ditscale::kernels::AdaLNBwdParams b;
  static_cast<ditscale::kernels::AdaLNConfig&>(b) =
      static_cast<const ditscale::kernels::AdaLNConfig&>(f);
  b.x = f.x;
  if (gated) {
    b.residual = f.residual;
    b.branch = f.branch;
    b.dh_out = {m.dh.p, DType::kBFloat16, N * D, D};
    b.dbranch = m.dbranch.p;
    b.dgate = m.dgate.p;
  }
  b.mean = f.mean;
  b.rstd = f.rstd;
  b.dy = {m.dy.p, DType::kBFloat16, N * D, D};
  b.dx = m.dx.p;
  b.dscale = m.dscale.p;
  b.dshift = m.dshift.p;
  return b;
}

// Times the copy, then every variant's forward and backward on one shape; one row each.
void bench_shape(const Shape& s, const Options& o, const std::vector<Variant>& vs) {
  using namespace ditscale::kernels;
  ShapeBufs m(s, o.gated);
  fill_inputs(m, s, o.gated);
  const AdaLNFwdParams f = fwd_params(m, s, o.gated);
  AdaLNBwdParams b = bwd_params(m, s, o.gated, f);
  Buf ws(adaln_backward_workspace_bytes(b));
  b.workspace = ws.p;
  b.workspace_bytes = adaln_backward_workspace_bytes(b);
  const double copy_ms = time_ms(
      [&] { check(cudaMemcpyAsync(m.copy.p, m.x.p, m.xbytes, cudaMemcpyDeviceToDevice), "copy"); });
  const double gbps = 1e-6;  // bytes per ms -> GB/s
  const double copy_bw = 2.0 * m.xbytes / copy_ms * gbps;
  for (const Variant& v : vs) {
    const double fwd_ms =
        time_ms([&] { internal::adaln_forward_cuda_tuned(f, nullptr, v.tuning); });
    const double bwd_ms =
        o.fwd_only ? 0.0
                   : time_ms([&] { internal::adaln_backward_cuda_tuned(b, nullptr, v.tuning); });
    const double fwd_bw = (o.gated ? 4.0 : 2.0) * m.xbytes / fwd_ms * gbps;
    const double bwd_bw = o.fwd_only ? 0.0 : (o.gated ? 6.0 : 3.0) * m.xbytes / bwd_ms * gbps;
    std::printf(
        "%-10s %2lld %6lld %5lld | %7.3f %6.0f | %7.3f %6.0f %5.1f%% | %7.3f %6.0f %5.1f%% | "
        "%7.3f\n",
        v.name.c_str(), static_cast<long long>(s.b), static_cast<long long>(s.n),
        static_cast<long long>(s.d), copy_ms, copy_bw, fwd_ms, fwd_bw, 100.0 * fwd_bw / copy_bw,
        bwd_ms, bwd_bw, 100.0 * bwd_bw / copy_bw, fwd_ms + bwd_ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_args(argc, argv, o)) return 2;
  std::vector<Variant> vs;
  for (const std::string& spec : ditscale::bench::split_commas(o.variants)) {
    vs.push_back(parse_variant(spec));
  }
  std::vector<Shape> shapes;
  if (!shapes_of(o, shapes)) return 2;
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("adaln_kernel_bench: no CUDA device, nothing to do\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  std::printf("device: %s (%d SMs)%s\n", prop.name, prop.multiProcessorCount,
              o.gated ? ", gated ops (fwd 4 |x|, bwd 6 |x|)" : "");
  std::printf("%-10s %2s %6s %5s | %7s %6s | %7s %6s %6s | %7s %6s %6s | %7s\n", "variant", "B",
              "N", "D", "copy_ms", "GB/s", "fwd_ms", "GB/s", "%copy", "bwd_ms", "GB/s", "%copy",
              "f+b_ms");
  for (const Shape& shape : shapes) bench_shape(shape, o, vs);
  return 0;
}
