// GPU tests of the fused AdaLN kernels against the fp64 CPU reference (adaln_ref.cc): every dtype,
// modulation layout and variant, on fresh random inputs (the seed is printed), with poisoned
// (NaN-filled) outputs, and bitwise determinism of the backward. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_tuning.h"
#include "tests/gpu/gpu_test_util.h"

namespace ditscale::kernels {
namespace {

// CUDA calls are checked with DS_CHECK_CUDA: an error throws, and gtest fails the test with the
// call, its file:line and CUDA's error text.

// Device buffer (RAII) poisoned with 0xFF bytes: NaN in fp32, fp16 and bf16. Null when n == 0.
struct DevBuf {
  cuda::DeviceBuffer memory;
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit DevBuf(std::size_t n)
      : memory(cuda::DeviceBuffer::Allocate(n).ValueOrThrow()), ptr(memory.data()), bytes(n) {
    if (ptr != nullptr) DS_CHECK_CUDA(cudaMemset(ptr, 0xFF, n));
  }
  void upload(const std::vector<std::uint8_t>& h) {
    if (!h.empty()) DS_CHECK_CUDA(cudaMemcpy(ptr, h.data(), h.size(), cudaMemcpyHostToDevice));
  }
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> h(bytes);
    if (bytes > 0) DS_CHECK_CUDA(cudaMemcpy(h.data(), ptr, bytes, cudaMemcpyDeviceToHost));
    return h;
  }
};

std::uint64_t run_seed() { return gpu_test::run_seed("adaln_gpu_test"); }

// Host buffer of `count` elements of `dtype` with values uniform in [lo, hi).
std::vector<std::uint8_t> random_buf(std::mt19937_64& rng, DType dtype, std::size_t count,
                                     double lo, double hi) {
  std::vector<std::uint8_t> buf(count * dtype_size(dtype));
  std::uniform_real_distribution<double> u(lo, hi);
  for (std::size_t i = 0; i < count; ++i) store_from_double(buf.data(), dtype, i, u(rng));
  return buf;
}

// ||got - want|| / ||want|| over `count` elements; every got element must be finite.
double rel_error(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want,
                 DType dtype, std::size_t count, bool* all_finite) {
  double num = 0, den = 0;
  *all_finite = true;
  for (std::size_t i = 0; i < count; ++i) {
    const double g = load_as_double(got.data(), dtype, i);
    const double w = load_as_double(want.data(), dtype, i);
    if (!std::isfinite(g)) *all_finite = false;
    num += (g - w) * (g - w);
    den += w * w;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

using gpu_test::tolerance;

struct Case {
  DType dtype = DType::kBFloat16;
  bool mod_f32 = false;  // modulation / gate / affine in fp32
  NormType norm = NormType::kLayerNorm;
  bool per_token = false;
  bool gated = false;
  bool no_dh = false;  // gated without dh_out (nothing downstream of h needs a gradient)
  bool affine = false;
  std::int64_t B = 2, N = 77, D = 1000;
  std::int64_t x_pad = 0;  // x / residual / branch / dy rows are D + x_pad apart (strided)
  std::int64_t b_pad = 0;  // ... and samples N * (D + x_pad) + b_pad elements apart
  // > 0 (per sample only): the GPU backward writes dshift / dscale / dgate into rows 0 / 1 / 2 of
  // a [B, dmod_rows, D] modulation gradient (AdaLNBwdParams::dmod) that starts as NaN; its other
  // rows must come back zero.
  std::int64_t dmod_rows = 0;
  std::string name() const {
    return std::string(dtype_name(dtype)) + (mod_f32 ? " mod=f32" : "") +
           (norm == NormType::kRMSNorm ? " RMS" : " LN") +
           (per_token ? " per-token" : " per-sample") + (gated ? " gated" : "") +
           (no_dh ? " no-dh" : "") + (affine ? " affine" : "") + " B=" + std::to_string(B) +
           " N=" + std::to_string(N) + " D=" + std::to_string(D) + " pad=" + std::to_string(x_pad) +
           "/" + std::to_string(b_pad) +
           (dmod_rows > 0 ? " dmod=" + std::to_string(dmod_rows) : "");
  }
};

// One host + one device copy of an input.
struct Input {
  std::vector<std::uint8_t> host;
  DevBuf dev;
  explicit Input(std::vector<std::uint8_t> h) : host(std::move(h)), dev(host.size()) {
    dev.upload(host);
  }
};

// `tuning`: the launchers' plan override (internal/adaln_tuning.h); the defaults by default.
void run_case(const Case& c, const internal::AdaLNTuning& tuning = {}) {
  SCOPED_TRACE(c.name());
  std::mt19937_64 rng(run_seed() ^ std::hash<std::string>{}(c.name()));
  const DType t = c.dtype;
  const DType mt = c.mod_f32 ? DType::kFloat32 : t;
  const std::int64_t B = c.B, N = c.N, D = c.D, row_stride = D + c.x_pad;
  const std::int64_t sample_stride = N * row_stride + c.b_pad;
  const std::size_t in_elems = static_cast<std::size_t>(B * sample_stride);
  const std::size_t out_elems = static_cast<std::size_t>(B * N * D);
  const std::int64_t n_mod = c.per_token ? N : 1;
  // Modulation packed as [B, n_mod, 6, D] (chunks 0 shift, 1 scale, 2 gate): strided views.
  Input mod(random_buf(rng, mt, static_cast<std::size_t>(B * n_mod * 6 * D), -0.5, 0.5));
  Input x(random_buf(rng, t, in_elems, -2.0, 3.0));
  Input branch(random_buf(rng, t, in_elems, -1.0, 1.0));
  Input dy(random_buf(rng, t, in_elems, -1.0, 1.0));
  Input dh_out(random_buf(rng, t, in_elems, -1.0, 1.0));
  Input weight(random_buf(rng, mt, D, 0.5, 1.5));
  Input bias(random_buf(rng, mt, D, -1.0, 1.0));

  auto chunk = [&](const Input& in, int k, bool device) {
    RowsView v;
    v.data = static_cast<const std::uint8_t*>(device ? in.dev.ptr : in.host.data()) +
             k * D * dtype_size(mt);
    v.dtype = mt;
    v.stride_b = n_mod * 6 * D;
    v.stride_n = c.per_token ? 6 * D : 0;
    return v;
  };
  auto rows = [&](const Input& in, bool device) {
    return RowsView{device ? in.dev.ptr : in.host.data(), t, sample_stride, row_stride};
  };
  auto config = [&](AdaLNConfig& p, bool device) {
    p.batch = B;
    p.seq_len = N;
    p.dim = D;
    p.norm = c.norm;
    p.dtype = t;
    p.affine_dtype = mt;
    p.shift = chunk(mod, 0, device);
    p.scale = chunk(mod, 1, device);
    if (c.gated) p.gate = chunk(mod, 2, device);
    if (c.affine) {
      p.weight = device ? weight.dev.ptr : weight.host.data();
      p.bias = device ? bias.dev.ptr : bias.host.data();
    }
  };

  // ---- forward ----
  const std::size_t esz = dtype_size(t);
  std::vector<std::uint8_t> y_ref(out_elems * esz), h_ref(out_elems * esz);
  std::vector<float> mean_ref(B * N), rstd_ref(B * N);
  DevBuf y(out_elems * esz), h(out_elems * esz), mean(B * N * 4), rstd(B * N * 4);
  for (bool device : {false, true}) {
    AdaLNFwdParams p;
    config(p, device);
    if (c.gated) {
      p.residual = rows(x, device);
      p.branch = rows(branch, device);
      p.h = device ? h.ptr : h_ref.data();
    } else {
      p.x = rows(x, device);
    }
    p.y = device ? y.ptr : y_ref.data();
    p.mean = device ? static_cast<float*>(mean.ptr) : mean_ref.data();
    p.rstd = device ? static_cast<float*>(rstd.ptr) : rstd_ref.data();
    if (device) {
      ASSERT_NO_THROW(internal::adaln_forward_cuda_tuned(p, nullptr, tuning));
      DS_CHECK_CUDA(cudaDeviceSynchronize());
    } else {
      adaln_forward_ref(p);
    }
  }
  bool finite = false;
  EXPECT_LT(rel_error(y.download(), y_ref, t, out_elems, &finite), tolerance(t)) << "y";
  EXPECT_TRUE(finite) << "y has unwritten (NaN) elements";
  if (c.gated) {
    EXPECT_LT(rel_error(h.download(), h_ref, t, out_elems, &finite), tolerance(t)) << "h";
    EXPECT_TRUE(finite) << "h";
  }
  std::vector<std::uint8_t> mref(B * N * 4), rref(B * N * 4);
  std::memcpy(mref.data(), mean_ref.data(), mref.size());
  std::memcpy(rref.data(), rstd_ref.data(), rref.size());
  if (c.norm == NormType::kLayerNorm) {
    EXPECT_LT(rel_error(mean.download(), mref, DType::kFloat32, B * N, &finite), 1e-5) << "mean";
    EXPECT_TRUE(finite) << "mean";
  }
  EXPECT_LT(rel_error(rstd.download(), rref, DType::kFloat32, B * N, &finite), 1e-5) << "rstd";
  EXPECT_TRUE(finite) << "rstd";

  // ---- backward (twice on the GPU: identical bits) ----
  const std::size_t mod_out = static_cast<std::size_t>(c.per_token ? B * N * D : B * D);
  const std::size_t msz = dtype_size(mt);
  struct Grads {
    std::vector<std::uint8_t> dx, dbranch, dscale, dshift, dgate, dweight, dbias;
  };
  Grads ref{std::vector<std::uint8_t>(out_elems * esz), std::vector<std::uint8_t>(out_elems * esz),
            std::vector<std::uint8_t>(mod_out * msz),   std::vector<std::uint8_t>(mod_out * msz),
            std::vector<std::uint8_t>(mod_out * msz),   std::vector<std::uint8_t>(D * msz),
            std::vector<std::uint8_t>(D * msz)};
  Grads gpu[2];
  for (int run = -1; run < 2; ++run) {
    const bool device = run >= 0;
    AdaLNBwdParams p;
    config(p, device);
    if (c.gated) {
      p.residual = rows(x, device);  // h is recomputed (from the forward's inputs)
      if (!c.no_dh) p.dh_out = rows(dh_out, device);
      p.branch = rows(branch, device);
    } else {
      p.x = rows(x, device);
    }
    p.dy = rows(dy, device);
    DevBuf dx(out_elems * esz), dbr(out_elems * esz), dsc(mod_out * msz), dsh(mod_out * msz),
        dg(mod_out * msz), dw(D * msz), db(D * msz);
    Grads& g = device ? gpu[run] : ref;
    p.dx = device ? dx.ptr : g.dx.data();
    p.dscale = device ? dsc.ptr : g.dscale.data();
    p.dshift = device ? dsh.ptr : g.dshift.data();
    if (c.gated) {
      p.dbranch = device ? dbr.ptr : g.dbranch.data();
      p.dgate = device ? dg.ptr : g.dgate.data();
    }
    if (c.affine) {
      p.dweight = device ? dw.ptr : g.dweight.data();
      p.dbias = device ? db.ptr : g.dbias.data();
    }
    if (!device) {
      adaln_backward_ref(p);
      continue;
    }
    p.mean = static_cast<const float*>(mean.ptr);
    p.rstd = static_cast<const float*>(rstd.ptr);
    const std::int64_t K = c.dmod_rows;
    DevBuf dmod(static_cast<std::size_t>(B * K * D) * msz);  // NaN bytes
    if (K > 0) {
      auto row = [&](int k) { return static_cast<std::uint8_t*>(dmod.ptr) + k * D * msz; };
      p.dshift = row(0);
      p.dscale = row(1);
      if (c.gated) p.dgate = row(2);
      p.dshift_stride_b = p.dscale_stride_b = p.dgate_stride_b = K * D;
      p.dmod = dmod.ptr;
      p.dmod_rows = K;
      p.dmod_dtype = mt;
    }
    DevBuf ws(adaln_backward_workspace_bytes(p));
    p.workspace = ws.ptr;
    p.workspace_bytes = ws.bytes;
    ASSERT_NO_THROW(internal::adaln_backward_cuda_tuned(p, nullptr, tuning));
    DS_CHECK_CUDA(cudaDeviceSynchronize());
    g = Grads{dx.download(), dbr.download(), dsc.download(), dsh.download(),
              dg.download(), dw.download(),  db.download()};
    if (K > 0) {  // rows 0-2 -> the contiguous gradients; the others must be zero bytes
      const std::vector<std::uint8_t> all = dmod.download();
      const std::size_t row_bytes = static_cast<std::size_t>(D) * msz;
      std::vector<std::uint8_t>* outs[3] = {&g.dshift, &g.dscale, &g.dgate};
      std::size_t nonzero = 0;
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t k = 0; k < K; ++k) {
          const std::uint8_t* src = all.data() + (b * K + k) * row_bytes;
          if (k < (c.gated ? 3 : 2)) {
            std::memcpy(outs[k]->data() + b * row_bytes, src, row_bytes);
          } else {
            for (std::size_t i = 0; i < row_bytes; ++i) nonzero += src[i] != 0;
          }
        }
      }
      EXPECT_EQ(nonzero, 0u) << "bytes of the unwritten dmod rows that are not zero";
    }
  }
  auto check = [&](const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want,
                   DType dt, std::size_t n, const char* what) {
    bool ok = false;
    EXPECT_LT(rel_error(got, want, dt, n, &ok), tolerance(dt == DType::kFloat32 ? t : dt)) << what;
    EXPECT_TRUE(ok) << what << " has unwritten (NaN) elements";
  };
  check(gpu[0].dx, ref.dx, t, out_elems, "dx");
  check(gpu[0].dscale, ref.dscale, mt, mod_out, "dscale");
  check(gpu[0].dshift, ref.dshift, mt, mod_out, "dshift");
  if (c.gated) {
    check(gpu[0].dbranch, ref.dbranch, t, out_elems, "dbranch");
    check(gpu[0].dgate, ref.dgate, mt, mod_out, "dgate");
  }
  if (c.affine) {
    check(gpu[0].dweight, ref.dweight, mt, D, "dweight");
    check(gpu[0].dbias, ref.dbias, mt, D, "dbias");
  }
  EXPECT_TRUE(gpu[0].dx == gpu[1].dx && gpu[0].dbranch == gpu[1].dbranch &&
              gpu[0].dscale == gpu[1].dscale && gpu[0].dshift == gpu[1].dshift &&
              gpu[0].dgate == gpu[1].dgate && gpu[0].dweight == gpu[1].dweight &&
              gpu[0].dbias == gpu[1].dbias)
      << "backward is not bitwise deterministic";
}

const DType kDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

TEST(AdaLNGpu, PlainPerSampleAndPerTokenEveryDtype) {
  SKIP_WITHOUT_GPU();
  for (DType t : kDtypes) {
    for (NormType norm : {NormType::kLayerNorm, NormType::kRMSNorm}) {
      for (bool per_token : {false, true}) {
        for (std::int64_t d : {64, 1000, 3072}) {
          Case c;
          c.dtype = t;
          c.norm = norm;
          c.per_token = per_token;
          c.D = d;
          run_case(c);
        }
      }
    }
  }
}

TEST(AdaLNGpu, Fp32ModulationAffineAndGated) {
  SKIP_WITHOUT_GPU();
  for (DType t : kDtypes) {
    for (bool mod_f32 : {false, true}) {
      for (int mask = 1; mask < 4; ++mask) {
        for (bool per_token : {false, true}) {
          Case c;
          c.dtype = t;
          c.mod_f32 = mod_f32;
          c.affine = (mask & 1) != 0;
          c.gated = (mask & 2) != 0;
          c.per_token = per_token;
          c.no_dh = c.gated && mod_f32 != per_token;  // the 3- and 4-row rings of the backward
          c.norm = mask == 2 ? NormType::kRMSNorm : NormType::kLayerNorm;
          c.D = 1536;
          c.N = 45;
          run_case(c);
        }
      }
    }
  }
}

TEST(AdaLNGpu, StridedAndUnalignedInputsTakeCorrectPaths) {
  SKIP_WITHOUT_GPU();
  for (DType t : kDtypes) {
    for (std::int64_t pad : {8, 1}) {  // 8: aligned strided rows; 1: unaligned (general path)
      for (bool gated : {false, true}) {
        Case c;
        c.dtype = t;
        c.x_pad = pad;
        c.gated = gated;
        c.affine = gated;
        c.D = 1000;
        c.N = 33;
        run_case(c);
      }
    }
    Case odd;  // D not a multiple of the vector width
    odd.dtype = t;
    odd.D = 1001;
    odd.N = 19;
    odd.gated = true;
    odd.per_token = true;
    run_case(odd);
  }
}

// The modulation gradient as rows of a [B, K, D] buffer (AdaLNBwdParams::dmod): the rows the
// backward fills match the reference, the others are zeroed by the reduction kernel (K = 6) or
// by the memset it falls back to when they outnumber its job slots (K = 24). D = 1001 takes the
// scalar reduction, 1000 / 3072 the 16-byte one; plain and gated (dgate in row 2), with affine.
TEST(AdaLNGpu, ModulationGradientRowsAndZeroedRest) {
  SKIP_WITHOUT_GPU();
  for (DType t : kDtypes) {
    for (std::int64_t d : {1000, 1001, 3072}) {
      for (int variant = 0; variant < 3; ++variant) {
        Case c;
        c.dtype = t;
        c.D = d;
        c.N = 37;
        c.gated = variant == 1;
        c.affine = variant == 2;
        c.mod_f32 = variant == 2;
        c.dmod_rows = d == 3072 && variant == 0 ? 24 : 6;
        run_case(c);
      }
    }
  }
}

TEST(AdaLNGpu, LargeRowsAndSequences) {
  SKIP_WITHOUT_GPU();
  for (std::int64_t d : {2560, 3072, 3840, 5120, 6144, 7680}) {  // the forward's vector plans
    Case c;
    c.B = 1;
    c.N = 4099;  // not a multiple of any tile
    c.D = d;
    run_case(c);
  }
  Case f32;
  f32.dtype = DType::kFloat32;
  f32.D = 5120;
  f32.N = 301;
  f32.gated = true;
  f32.affine = true;
  run_case(f32);
  Case wide;  // past the register-resident range: general kernels
  wide.D = 20000;
  wide.N = 7;
  wide.affine = true;
  run_case(wide);
}

// The kernels of every plan with tiny persistent grids (every block walks many rows, wraps its
// ring and crosses sample boundaries; the backward gets one long tile per sample), each forward
// kernel where it applies (AdaLNTuning::fwd_kernel: the cp.async one is the sm_80 default), and
// the first (non-pipelined) kernels, the fallbacks of rows whose rings do not fit.
TEST(AdaLNGpu, PipelinedKernelsSmallGridsAndBaseline) {
  SKIP_WITHOUT_GPU();
  using internal::AdaLNTuning;
  std::vector<AdaLNTuning> tunings;
  for (int kernel : {0, 1, 2}) {
    for (int grid : {0, 1, 3, 7}) {
      AdaLNTuning t;
      t.fwd_kernel = kernel;
      t.max_resident_blocks = grid;
      t.pdl = kernel == 1 && grid == 1 ? 0 : 1;  // programmatic dependent launch off once
      tunings.push_back(t);
    }
  }
  AdaLNTuning base;
  base.pipelined = false;
  tunings.push_back(base);
  for (const AdaLNTuning& t : tunings) {
    SCOPED_TRACE("kernel " + std::to_string(t.fwd_kernel) + " grid " +
                 std::to_string(t.max_resident_blocks) + " pdl " + std::to_string(t.pdl) +
                 (t.pipelined ? "" : " base"));
    for (DType dt : kDtypes) {
      Case plain;  // per sample, LN; D = 3072 takes several vectors per thread
      plain.dtype = dt;
      plain.B = 3;
      plain.N = 41;
      plain.D = 3072;
      run_case(plain, t);
      Case tok;  // per token, RMS, one warp per row (several rows per block)
      tok.dtype = dt;
      tok.norm = NormType::kRMSNorm;
      tok.per_token = true;
      tok.B = 2;
      tok.N = 37;
      tok.D = 256;
      run_case(tok, t);
      Case tok2;  // per token, RMS, 2 vectors per bf16 thread: per-thread stores (bulk copies)
      tok2.dtype = dt;
      tok2.norm = NormType::kRMSNorm;
      tok2.per_token = true;
      tok2.B = 2;
      tok2.N = 21;
      tok2.D = 2048;
      run_case(tok2, t);
      // Per sample, no affine: 4 vectors per bf16 backward thread (160 threads), the
      // register-capped candidate.
      Case lean;
      lean.dtype = dt;
      lean.B = 2;
      lean.N = 23;
      lean.D = 5120;
      run_case(lean, t);
      Case wide;  // per sample with affine, 5 vectors per bf16 thread
      wide.dtype = dt;
      wide.affine = true;
      wide.B = 3;
      wide.N = 17;
      wide.D = 5120;
      run_case(wide, t);
      Case reload;  // fp16 / fp32: coefficients recomputed per row in the bulk-copy kernel
      reload.dtype = dt;
      reload.B = 2;
      reload.N = 13;
      reload.D = 6144;
      run_case(reload, t);
      Case full;  // gated + affine with fp32 modulation
      full.dtype = dt;
      full.mod_f32 = true;
      full.gated = true;
      full.affine = true;
      full.B = 2;
      full.N = 29;
      full.D = 1536;
      run_case(full, t);
      full.no_dh = true;  // the backward's ring without dh_out
      run_case(full, t);
    }
  }
}

// The bulk-copy forward on awkward layouts: rows straddling sample ends (N = 1), padded samples,
// rows that are not contiguous (one bulk load per row), and grids small enough that each block
// wraps its ring many times.
TEST(AdaLNGpu, BulkCopyForwardLayouts) {
  SKIP_WITHOUT_GPU();
  using internal::AdaLNTuning;
  for (int grid : {0, 1, 3}) {
    AdaLNTuning t;
    t.fwd_kernel = 2;
    t.max_resident_blocks = grid;
    SCOPED_TRACE("grid " + std::to_string(grid));
    for (DType dt : kDtypes) {
      for (std::int64_t d : {1536, 1024}) {
        Case c;
        c.dtype = dt;
        c.B = 3;
        c.N = 37;
        c.D = d;
        c.affine = d == 1024;
        run_case(c, t);
        Case rms = c;  // RMS, per token, one row per sample
        rms.norm = NormType::kRMSNorm;
        rms.per_token = true;
        rms.N = 1;
        rms.B = 5;
        run_case(rms, t);
        Case rows = c;  // contiguous rows, padded samples
        rows.b_pad = 8;
        rows.N = 5;
        run_case(rows, t);
        Case strided = c;  // no two rows contiguous
        strided.x_pad = 8;
        strided.N = 19;
        run_case(strided, t);
      }
    }
  }
}

// The warp-per-row forward (the default for plain rows of <= 256 vectors), each of its plans
// through the layouts that select them (adaln_plan.h): coefficients packed ahead (per sample: 2
// vectors ahead; per token: all with the x loads) or at use (affine, fp32 modulation: with the
// bf16 prefetching persistent grid and streaming hints), grids small enough that each warp walks
// many rows and crosses sample ends, partial last lanes (D = 1000: 125 vectors; D = 64: 8 lanes),
// padded rows and samples, RMS; and a gated call, which must take another kernel.
TEST(AdaLNGpu, WarpPerRowForward) {
  SKIP_WITHOUT_GPU();
  using internal::AdaLNTuning;
  for (int grid : {0, 1, 2, 3}) {
    AdaLNTuning t;
    t.max_resident_blocks = grid;
    SCOPED_TRACE("grid " + std::to_string(grid));
    for (DType dt : kDtypes) {
      for (std::int64_t d : {64, 1000, 1536, 2048}) {
        Case c;
        c.dtype = dt;
        c.B = 3;
        c.N = 37;
        c.D = d;
        c.affine = d == 1000;
        run_case(c, t);
        Case tok = c;  // per token in x's dtype, no affine: packed, all with the x loads
        tok.per_token = true;
        tok.affine = false;
        run_case(tok, t);
        Case rms = c;  // per token fp32, one row per sample: coefficients at use
        rms.norm = NormType::kRMSNorm;
        rms.per_token = true;
        rms.mod_f32 = true;
        rms.N = 1;
        rms.B = 5;
        run_case(rms, t);
        Case padded = c;  // padded rows and samples
        padded.x_pad = 8;
        padded.b_pad = 16;
        padded.N = 19;
        padded.affine = false;
        run_case(padded, t);
      }
      Case gated;  // gated: not the warp kernel's
      gated.dtype = dt;
      gated.gated = true;
      gated.D = 1536;
      gated.N = 21;
      run_case(gated, t);
    }
  }
}

TEST(AdaLNGpu, RejectsFp64AndMissingWorkspace) {
  SKIP_WITHOUT_GPU();
  AdaLNBwdParams p;
  p.batch = 1;
  p.seq_len = 64;
  p.dim = 128;
  DevBuf buf(1 << 20);
  p.x = {buf.ptr, DType::kBFloat16, 64 * 128, 128};
  p.dy = p.x;
  p.scale = {buf.ptr, DType::kBFloat16, 128, 0};
  p.shift = p.scale;
  p.mean = static_cast<const float*>(buf.ptr);
  p.rstd = p.mean;
  p.dx = buf.ptr;
  p.dscale = buf.ptr;
  EXPECT_GT(adaln_backward_workspace_bytes(p), 0u);
  EXPECT_THROW(adaln_backward_cuda(p, nullptr), Error);  // no workspace
  p.dtype = DType::kFloat64;
  EXPECT_THROW(adaln_backward_cuda(p, nullptr), Error);
}

}  // namespace
}  // namespace ditscale::kernels
