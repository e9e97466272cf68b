// Tests of the layout copy builders and CPU reference (layout.h): pack/unpack of random regions
// (exact, against index formulas, the rest of the buffer untouched), and a simulated Ulysses
// all-to-all (scatter heads, exchange, gather tokens, and back) with uneven head and token
// splits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/layout.h"

namespace ditscale::kernels {
namespace {

// Random bytes (any bit pattern, NaN payloads included: copies must be exact).
std::vector<std::uint8_t> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng());
  return v;
}

std::int64_t pick(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

TEST(LayoutRef, PackMatchesIndexFormulaAndUnpackRoundTrips) {
  std::mt19937_64 rng(std::random_device{}());
  for (int iter = 0; iter < 200; ++iter) {
    const DType dtype = static_cast<DType>(pick(rng, 0, 3));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(dtype));
    const std::int64_t B = pick(rng, 1, 3), T = pick(rng, 1, 9), H = pick(rng, 1, 7),
                       D = pick(rng, 1, 20);
    BufferRegion r;
    r.token_begin = pick(rng, 0, T);
    r.tokens = pick(rng, 0, T - r.token_begin);
    r.head_begin = pick(rng, 0, H - 1);
    r.heads = pick(rng, 0, H - r.head_begin);
    std::vector<std::uint8_t> src = random_bytes(rng, B * T * H * D * es);
    std::vector<std::uint8_t> staging(B * r.tokens * r.heads * D * es, 0xAB);
    DenseBuffer sb{src.data(), dtype, B, T, H, D};
    const LayoutCopyParams pack = pack_region_params(sb, r, staging.data());
    EXPECT_EQ(layout_copy_bytes(pack), static_cast<std::int64_t>(staging.size()));
    layout_copy_ref(pack);
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t t = 0; t < r.tokens; ++t) {
        for (std::int64_t h = 0; h < r.heads; ++h) {
          const std::int64_t s = ((b * T + r.token_begin + t) * H + r.head_begin + h) * D * es;
          const std::int64_t d = ((b * r.tokens + t) * r.heads + h) * D * es;
          ASSERT_EQ(std::memcmp(&src[s], &staging[d], D * es), 0)
              << "iter " << iter << " b " << b << " t " << t << " h " << h;
        }
      }
    }
    // Unpack into a different buffer: the region equals src, the rest keeps its old bytes.
    std::vector<std::uint8_t> dst = random_bytes(rng, src.size());
    const std::vector<std::uint8_t> old = dst;
    layout_copy_ref(unpack_region_params(staging.data(), {dst.data(), dtype, B, T, H, D}, r));
    for (std::int64_t b = 0; b < B; ++b) {
      for (std::int64_t t = 0; t < T; ++t) {
        for (std::int64_t h = 0; h < H; ++h) {
          const bool in = t >= r.token_begin && t < r.token_begin + r.tokens && h >= r.head_begin &&
                          h < r.head_begin + r.heads;
          const std::int64_t o = ((b * T + t) * H + h) * D * es;
          ASSERT_EQ(std::memcmp(&dst[o], in ? &src[o] : &old[o], D * es), 0)
              << "iter " << iter << " in region " << in;
        }
      }
    }
  }
}

// n random non-negative sizes summing to total, as n + 1 offsets.
std::vector<std::int64_t> random_offsets(std::mt19937_64& rng, int n, std::int64_t total) {
  std::vector<std::int64_t> cuts = {0, total};
  for (int i = 1; i < n; ++i) cuts.push_back(pick(rng, 0, total));
  std::sort(cuts.begin(), cuts.end());
  return cuts;
}

// Ulysses all-to-all among n simulated ranks: rank r holds tokens [tok[r], tok[r + 1]) of a
// global [B, T, H, D] tensor with all heads; after split(kHeads) + exchange + join(kTokens) rank
// i holds all tokens of heads [hd[i], hd[i + 1]); the reverse exchange restores the shards.
TEST(LayoutRef, UlyssesAllToAllWithUnevenSplits) {
  std::mt19937_64 rng(std::random_device{}());
  for (int iter = 0; iter < 40; ++iter) {
    const int n = static_cast<int>(pick(rng, 1, 8));
    const DType dtype = static_cast<DType>(pick(rng, 0, 3));
    const std::int64_t es = static_cast<std::int64_t>(dtype_size(dtype));
    const std::int64_t B = pick(rng, 1, 2), T = pick(rng, 0, 17), H = pick(rng, 1, 11),
                       D = pick(rng, 1, 9);
    const std::vector<std::int64_t> tok = random_offsets(rng, n, T), hd = random_offsets(rng, n, H);
    const std::vector<std::uint8_t> global = random_bytes(rng, B * T * H * D * es);
    // Shards [B, t_r, H, D].
    std::vector<std::vector<std::uint8_t>> shard(n), send(n), recv(n), gathered(n);
    for (int r = 0; r < n; ++r) {
      const std::int64_t tr = tok[r + 1] - tok[r];
      shard[r].resize(B * tr * H * D * es);
      for (std::int64_t b = 0; b < B; ++b) {
        std::memcpy(shard[r].data() + b * tr * H * D * es,
                    global.data() + (b * T + tok[r]) * H * D * es, tr * H * D * es);
      }
      send[r].assign(shard[r].size(), 0xCD);
      layout_copy_ref(split_params({shard[r].data(), dtype, B, tr, H, D}, SplitAxis::kHeads, hd,
                                   send[r].data()));
    }
    // Exchange: rank i receives chunk i of every rank j, back to back in j order.
    for (int i = 0; i < n; ++i) {
      const std::int64_t hi = hd[i + 1] - hd[i];
      recv[i].assign(B * T * hi * D * es, 0xEF);
      for (int j = 0; j < n; ++j) {
        const std::int64_t tj = tok[j + 1] - tok[j];
        const DenseBuffer shape{shard[j].data(), dtype, B, tj, H, D};
        const std::int64_t from = chunk_offset(shape, SplitAxis::kHeads, hd, i) * es;
        const DenseBuffer rshape{recv[i].data(), dtype, B, T, hi, D};
        const std::int64_t to = chunk_offset(rshape, SplitAxis::kTokens, tok, j) * es;
        std::memcpy(recv[i].data() + to, send[j].data() + from, B * tj * hi * D * es);
      }
      gathered[i].assign(recv[i].size(), 0x11);
      layout_copy_ref(join_params(recv[i].data(), SplitAxis::kTokens, tok,
                                  {gathered[i].data(), dtype, B, T, hi, D}));
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t t = 0; t < T; ++t) {
          for (std::int64_t h = 0; h < hi; ++h) {
            ASSERT_EQ(std::memcmp(&gathered[i][((b * T + t) * hi + h) * D * es],
                                  &global[((b * T + t) * H + hd[i] + h) * D * es], D * es),
                      0)
                << "iter " << iter << " rank " << i << " b " << b << " t " << t << " h " << h;
          }
        }
      }
    }
    // Reverse: split tokens on the head-sharded ranks, exchange, join heads.
    std::vector<std::vector<std::uint8_t>> back_send(n), back(n);
    for (int i = 0; i < n; ++i) {
      const std::int64_t hi = hd[i + 1] - hd[i];
      back_send[i].assign(gathered[i].size(), 0x22);
      layout_copy_ref(split_params({gathered[i].data(), dtype, B, T, hi, D}, SplitAxis::kTokens,
                                   tok, back_send[i].data()));
    }
    for (int r = 0; r < n; ++r) {
      const std::int64_t tr = tok[r + 1] - tok[r];
      std::vector<std::uint8_t> staged(shard[r].size(), 0x33);
      for (int i = 0; i < n; ++i) {
        const std::int64_t hi = hd[i + 1] - hd[i];
        const DenseBuffer from_shape{gathered[i].data(), dtype, B, T, hi, D};
        const DenseBuffer to_shape{staged.data(), dtype, B, tr, H, D};
        std::memcpy(staged.data() + chunk_offset(to_shape, SplitAxis::kHeads, hd, i) * es,
                    back_send[i].data() + chunk_offset(from_shape, SplitAxis::kTokens, tok, r) * es,
                    B * tr * hi * D * es);
      }
      back[r].assign(shard[r].size(), 0x44);
      layout_copy_ref(
          join_params(staged.data(), SplitAxis::kHeads, hd, {back[r].data(), dtype, B, tr, H, D}));
      EXPECT_EQ(back[r], shard[r]) << "iter " << iter << " rank " << r;
    }
  }
}

TEST(LayoutRef, ValidationNamesTheArgument) {
  std::vector<float> buf(2 * 4 * 3 * 5), staging(buf.size());
  const DenseBuffer b{buf.data(), DType::kFloat32, 2, 4, 3, 5};
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(message([&] {
              pack_region_params(b, {2, 3, 0, 1}, staging.data());
            }).find("region tokens [2, +3) outside the buffer's 4 tokens"),
            std::string::npos);
  EXPECT_NE(message([&] {
              pack_region_params(b, {0, 1, 1, 3}, staging.data());
            }).find("region heads"),
            std::string::npos);
  EXPECT_NE(message([&] {
              pack_region_params(b, {0, 1, 0, 1}, nullptr);
            }).find("staging: null"),
            std::string::npos);
  EXPECT_NE(message([&] {
              split_params(b, SplitAxis::kHeads, {0, 2, 1, 3}, staging.data());
            }).find("offsets[2] = 1 is smaller"),
            std::string::npos);
  EXPECT_NE(message([&] {
              split_params(b, SplitAxis::kHeads, {0, 2}, staging.data());
            }).find("from 0 to the heads of the buffer (3)"),
            std::string::npos);
  LayoutCopyParams p = pack_region_params(b, {0, 1, 0, 1}, staging.data());
  p.copies[0].dst = nullptr;
  EXPECT_NE(message([&] { layout_copy_ref(p); }).find("LayoutCopyParams.copies[0].dst: null"),
            std::string::npos);
  p.num_copies = kMaxLayoutCopies + 1;
  EXPECT_NE(message([&] { layout_copy_check(p); }).find("num_copies"), std::string::npos);
}

}  // namespace
}  // namespace ditscale::kernels
