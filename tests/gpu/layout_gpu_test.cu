// GPU tests of the layout copy kernel (layout.h) against the CPU reference, bit-exact: random
// pack/unpack regions of every element size (vectorised and general paths, misaligned bases),
// Ulysses split/join with uneven head and token splits, destinations poisoned so untouched bytes
// are checked too. Fresh random inputs each run (the seed is printed). Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/layout.h"
#include "tests/gpu/gpu_test_util.h"

namespace ditscale::kernels {
namespace {

using gpu_test::Buf;

std::mt19937_64& rng() {
  static std::mt19937_64 r = [] {
    const auto s =
        static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    std::printf("layout_gpu_test seed: %llu\n", static_cast<unsigned long long>(s));
    return std::mt19937_64(s);
  }();
  return r;
}

std::int64_t pick(std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng());
}

std::vector<std::uint8_t> random_bytes(std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng()());
  return v;
}

// Runs `make(device)` on the GPU and on the host and expects identical destination bytes.
template <typename Make>
void expect_same(Buf& dst, Make&& make, const std::string& what) {
  ASSERT_NO_THROW(layout_copy_cuda(make(true), nullptr)) << what;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << what;
  layout_copy_ref(make(false));
  ASSERT_TRUE(dst.download() == dst.host) << what;
}

TEST(LayoutGpu, PackUnpackRandomRegions) {
  SKIP_WITHOUT_GPU();
  for (int iter = 0; iter < 300; ++iter) {
    const DType dtype = static_cast<DType>(pick(0, 3));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(dtype));
    // Half of the cases use head dims with 16-byte rows (vectorised path when aligned).
    const std::int64_t D = iter % 2 == 0 ? (16 / es) * pick(1, 24) : pick(1, 150);
    const std::int64_t B = pick(1, 3), T = pick(1, 70), H = pick(1, 24);
    const std::int64_t off = iter % 5 == 0 ? 1 : 0;  // misaligned base: general path
    BufferRegion r;
    r.token_begin = pick(0, T);
    r.tokens = pick(0, T - r.token_begin);
    r.head_begin = pick(0, H - 1);
    r.heads = pick(0, H - r.head_begin);
    const std::string what = "iter " + std::to_string(iter) + " " + dtype_name(dtype) +
                             " B=" + std::to_string(B) + " T=" + std::to_string(T) +
                             " H=" + std::to_string(H) + " D=" + std::to_string(D) +
                             " off=" + std::to_string(off);
    Buf src(random_bytes((B * T * H * D + off) * es));
    Buf staging(std::vector<std::uint8_t>((B * r.tokens * r.heads * D + off) * es, 0xFF));
    expect_same(
        staging,
        [&](bool dev) {
          return pack_region_params({src.base(dev) + off * es, dtype, B, T, H, D}, r,
                                    staging.base(dev) + off * es);
        },
        what + " pack");
    Buf dst(random_bytes(src.host.size()));
    expect_same(
        dst,
        [&](bool dev) {
          return unpack_region_params(staging.base(dev) + off * es,
                                      {dst.base(dev) + off * es, dtype, B, T, H, D}, r);
        },
        what + " unpack");
  }
}

TEST(LayoutGpu, UlyssesSplitJoinUnevenSplits) {
  SKIP_WITHOUT_GPU();
  for (int iter = 0; iter < 120; ++iter) {
    const int n = static_cast<int>(pick(1, kMaxLayoutCopies));
    const DType dtype = static_cast<DType>(pick(0, 3));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(dtype));
    const std::int64_t D = iter % 3 == 0 ? pick(1, 100) : 128;
    const std::int64_t B = pick(1, 2), T = pick(0, 300), H = pick(1, 40);
    const SplitAxis axis = iter % 2 == 0 ? SplitAxis::kHeads : SplitAxis::kTokens;
    const std::int64_t size = axis == SplitAxis::kHeads ? H : T;
    std::vector<std::int64_t> offsets = {0, size};
    for (int i = 1; i < n; ++i) offsets.push_back(pick(0, size));
    std::sort(offsets.begin(), offsets.end());
    const std::string what = "iter " + std::to_string(iter) + " n=" + std::to_string(n) + " " +
                             dtype_name(dtype) + " T=" + std::to_string(T) +
                             " H=" + std::to_string(H) + " D=" + std::to_string(D);
    Buf src(random_bytes(B * T * H * D * es));
    Buf staging(std::vector<std::uint8_t>(src.host.size(), 0xFF));
    expect_same(
        staging,
        [&](bool dev) {
          return split_params({src.base(dev), dtype, B, T, H, D}, axis, offsets, staging.base(dev));
        },
        what + " split");
    Buf back(std::vector<std::uint8_t>(src.host.size(), 0xFF));
    expect_same(
        back,
        [&](bool dev) {
          return join_params(staging.base(dev), axis, offsets, {back.base(dev), dtype, B, T, H, D});
        },
        what + " join");
    EXPECT_TRUE(back.host == src.host) << what << ": split then join is not the identity";
  }
}

TEST(LayoutGpu, EmptyCopiesLaunchNothing) {
  SKIP_WITHOUT_GPU();
  LayoutCopyParams p;
  p.dtype = DType::kFloat32;
  p.batch = 1;
  p.head_dim = 4;
  p.num_copies = 0;
  EXPECT_NO_THROW(layout_copy_cuda(p, nullptr));
  p.num_copies = 1;
  p.copies[0].tokens = 0;
  p.copies[0].heads = 3;
  EXPECT_NO_THROW(layout_copy_cuda(p, nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace ditscale::kernels
