// GPU tests of the log-sum-exp merge kernel (attn_merge.h) against the fp64 CPU reference: every
// dtype, K = 1..8, both lse layouts ([B, H, T] as cuDNN returns it, [B, T, H]), strided head
// slices, misaligned views (general path), in-place accumulation, -inf (empty) blocks whose
// outputs are NaN garbage, poisoned outputs and untouched padding. Fresh random inputs each run
// (the seed is printed). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/attn_merge.h"
#include "tests/gpu/gpu_test_util.h"

namespace ditscale::kernels {
namespace {

using gpu_test::Buf;

std::uint64_t run_seed() { return gpu_test::run_seed("attn_merge_gpu_test"); }

using gpu_test::tolerance;

struct Case {
  DType dtype = DType::kBFloat16;
  int k = 2;
  bool bht = true;  // lse layout [B, H, T] (else [B, T, H])
  std::int64_t B = 2, T = 67, H = 5, D = 128;
  std::int64_t pad_heads = 0;  // views are heads [1, 1 + H) of buffers with H + pad_heads heads
  std::int64_t elem_off = 0;   // extra element offset of every view (1: misaligned, general path)
  bool in_place = false;       // out = in[0], out_lse = in_lse[0]
  bool write_lse = true;
  std::string name() const {
    return std::string(dtype_name(dtype)) + " K=" + std::to_string(k) + (bht ? " bht" : " bth") +
           " B=" + std::to_string(B) + " T=" + std::to_string(T) + " H=" + std::to_string(H) +
           " D=" + std::to_string(D) + " pad=" + std::to_string(pad_heads) +
           " off=" + std::to_string(elem_off) + (in_place ? " in-place" : "") +
           (write_lse ? "" : " no-lse");
  }
};

void run_case(const Case& c) {
  SCOPED_TRACE(c.name());
  std::mt19937_64 rng(run_seed() ^ std::hash<std::string>{}(c.name()));
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(c.dtype));
  const std::int64_t hb = c.H + c.pad_heads, h0 = c.pad_heads > 0 ? 1 : 0;
  const std::int64_t buf_elems = c.B * c.T * hb * c.D + c.elem_off;
  const std::int64_t rows = c.B * c.T * c.H;
  std::uniform_real_distribution<double> val(-1.0, 1.0), lse(-8.0, 8.0), coin(0.0, 1.0);
  const float ninf = -std::numeric_limits<float>::infinity();

  // Inputs: random outputs and lse; ~15% of the (input, row) pairs are empty blocks (lse -inf,
  // output NaN garbage), and row 0 is empty in every input.
  std::vector<std::unique_ptr<Buf>> outs, lses;
  auto lse_index = [&](std::int64_t b, std::int64_t t, std::int64_t h) {
    return c.bht ? (b * c.H + h) * c.T + t : (b * c.T + t) * c.H + h;
  };
  for (int i = 0; i < c.k; ++i) {
    std::vector<std::uint8_t> o(buf_elems * es);
    for (std::int64_t e = 0; e < buf_elems; ++e) store_from_double(o.data(), c.dtype, e, val(rng));
    std::vector<float> l(rows);
    for (float& x : l) x = coin(rng) < 0.15 ? ninf : static_cast<float>(lse(rng));
    for (std::int64_t b = 0; b < c.B; ++b) {
      for (std::int64_t t = 0; t < c.T; ++t) {
        for (std::int64_t h = 0; h < c.H; ++h) {
          float& x = l[lse_index(b, t, h)];
          if (b == 0 && t == 0 && h == 0) x = ninf;
          if (x != ninf) continue;
          const std::int64_t first = c.elem_off + ((b * c.T + t) * hb + h0 + h) * c.D;
          std::memset(o.data() + first * es, 0xFF, c.D * es);  // NaN in every dtype
        }
      }
    }
    std::vector<std::uint8_t> lb(rows * 4);
    std::memcpy(lb.data(), l.data(), lb.size());
    outs.push_back(std::make_unique<Buf>(std::move(o)));
    lses.push_back(std::make_unique<Buf>(std::move(lb)));
  }
  Buf out(std::vector<std::uint8_t>(buf_elems * es, 0xFF));  // poisoned
  Buf out_lse(std::vector<std::uint8_t>(rows * 4, 0xFF));
  for (const auto& x : {&out, &out_lse}) ASSERT_NE(x->dev, nullptr);

  auto make = [&](bool device) {
    AttnMergeParams p;
    p.batch = c.B, p.tokens = c.T, p.heads = c.H, p.head_dim = c.D, p.dtype = c.dtype;
    p.num_inputs = c.k;
    auto view_at = [&](void* base) {
      return static_cast<char*>(base) + (c.elem_off + h0 * c.D) * es;
    };
    for (int i = 0; i < c.k; ++i) {
      p.in[i] = dense_out_view(view_at(outs[i]->base(device)), c.T, hb, c.D);
      const auto* l = reinterpret_cast<const float*>(lses[i]->base(device));
      p.in_lse[i] = c.bht ? lse_view_bht(l, c.T, c.H) : lse_view_bth(l, c.T, c.H);
    }
    Buf& ob = c.in_place ? *outs[0] : out;
    Buf& lb = c.in_place ? *lses[0] : out_lse;
    p.out = dense_out_dst(view_at(ob.base(device)), c.T, hb, c.D);
    auto* l = reinterpret_cast<float*>(lb.base(device));
    if (c.write_lse) p.out_lse = c.bht ? lse_dst_bht(l, c.T, c.H) : lse_dst_bth(l, c.T, c.H);
    return p;
  };
  ASSERT_NO_THROW(attn_merge_cuda(make(true), nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  attn_merge_ref(make(false));  // host, in place on the host copies when c.in_place

  const Buf& ob = c.in_place ? *outs[0] : out;
  const Buf& lb = c.in_place ? *lses[0] : out_lse;
  const std::vector<std::uint8_t> got = ob.download(), got_lse = lb.download();
  const std::vector<std::uint8_t>& want = ob.host;
  double num = 0, den = 0;
  std::int64_t bad = 0;
  for (std::int64_t e = 0; e < buf_elems; ++e) {
    const std::int64_t r = e - c.elem_off;
    const std::int64_t head = r >= 0 ? (r / c.D) % hb : -1;
    const bool in_view = r >= 0 && head >= h0 && head < h0 + c.H;
    if (!in_view) {  // padding: untouched bytes
      if (std::memcmp(&got[e * es], &want[e * es], es) != 0) ++bad;
      continue;
    }
    const double g = load_as_double(got.data(), c.dtype, e);
    const double w = load_as_double(want.data(), c.dtype, e);
    if (!std::isfinite(g)) ++bad;
    num += (g - w) * (g - w);
    den += w * w;
  }
  EXPECT_EQ(bad, 0) << "non-finite outputs or modified padding";
  EXPECT_LE(std::sqrt(num / den), tolerance(c.dtype));
  // Row 0 is empty everywhere: exactly 0.
  const std::int64_t row0 = c.elem_off + h0 * c.D;
  for (std::int64_t d = 0; d < c.D; ++d) {
    EXPECT_EQ(load_as_double(got.data(), c.dtype, row0 + d), 0.0) << d;
  }
  if (!c.write_lse) {
    if (!c.in_place) {
      EXPECT_EQ(got_lse, std::vector<std::uint8_t>(rows * 4, 0xFF));  // untouched
    }
    return;
  }
  std::vector<float> gl(rows), wl(rows);
  std::memcpy(gl.data(), got_lse.data(), rows * 4);
  std::memcpy(wl.data(), lb.host.data(), rows * 4);
  for (std::int64_t i = 0; i < rows; ++i) {
    if (wl[i] == ninf) {
      ASSERT_EQ(gl[i], ninf) << i;
      continue;
    }
    ASSERT_NEAR(gl[i], wl[i], 2e-6 * (1.0 + std::fabs(wl[i]))) << i;
  }
}

TEST(AttnMergeGpu, EveryDtypeAndK) {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int k = 1; k <= kMaxMergeInputs; ++k) {
      Case c;
      c.dtype = dt;
      c.k = k;
      c.bht = (k % 2) == 0;
      run_case(c);
    }
  }
}

TEST(AttnMergeGpu, StridedMisalignedAndOddHeadDims) {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (std::int64_t d : {128, 64, 40, 37, 1, 300}) {
      for (std::int64_t off : {0, 1}) {
        Case c;
        c.dtype = dt;
        c.k = 3;
        c.D = d;
        c.pad_heads = 3;
        c.elem_off = off;
        c.T = 33;
        c.bht = off == 0;
        run_case(c);
      }
    }
  }
}

TEST(AttnMergeGpu, InPlacePairwiseAndNoLse) {
  SKIP_WITHOUT_GPU();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (bool bht : {true, false}) {
      Case c;
      c.dtype = dt;
      c.k = 2;
      c.bht = bht;
      c.in_place = true;
      c.pad_heads = 2;
      c.T = 129;
      c.H = 24;
      run_case(c);
      c.write_lse = false;
      c.in_place = false;
      run_case(c);
    }
  }
}

TEST(AttnMergeGpu, InPlaceKWayLarge) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.dtype = DType::kBFloat16;
  c.k = 4;
  c.in_place = true;
  c.B = 1;
  c.T = 4099;
  c.H = 24;
  c.D = 128;
  run_case(c);
}

TEST(AttnMergeGpu, RejectsFloat64AndBadParams) {
  SKIP_WITHOUT_GPU();
  AttnMergeParams p;
  p.batch = 1, p.tokens = 1, p.heads = 1, p.head_dim = 8, p.dtype = DType::kFloat64;
  p.num_inputs = 1;
  double x[8];
  float l = 0;
  p.in[0] = dense_out_view(x, 1, 1, 8);
  p.in_lse[0] = lse_view_bht(&l, 1, 1);
  p.out = dense_out_dst(x, 1, 1, 8);
  EXPECT_THROW(attn_merge_cuda(p, nullptr), Error);
  p.dtype = DType::kFloat32;
  p.num_inputs = 0;
  EXPECT_THROW(attn_merge_cuda(p, nullptr), Error);
}

}  // namespace
}  // namespace ditscale::kernels
