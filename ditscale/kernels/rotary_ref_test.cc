// Tests of the rotary embedding's CPU implementation and checks (rotary.h): random float32 and
// float64 inputs (strided x, shared and per-sample tables) against the formula in double, the
// inverse undoing the forward, and each invalid field named by the check.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/rotary.h"

namespace ditscale::kernels {
namespace {

struct Case {
  std::int64_t B, S, H, Dh, head_gap;  // x's heads `head_gap` elements apart beyond Dh
  bool per_sample;
};

RotaryParams params(const Case& c, const std::vector<float>& x, std::vector<float>& y,
                    const std::vector<float>& cos, const std::vector<float>& sin) {
  RotaryParams p;
  p.x = x.data();
  p.y = y.data();
  p.dtype = DType::kFloat32;
  p.batch = c.B;
  p.seq_len = c.S;
  p.heads = c.H;
  p.head_dim = c.Dh;
  p.x_stride_h = c.Dh + c.head_gap;
  p.x_stride_s = c.H * p.x_stride_h;
  p.x_stride_b = c.S * p.x_stride_s;
  p.cos = cos.data();
  p.sin = sin.data();
  p.freq_stride_b = c.per_sample ? c.S * c.Dh : 0;
  return p;
}

TEST(RotaryRef, MatchesTheFormulaAndTheInverseUndoesIt) {
  std::mt19937_64 rng(std::random_device{}());
  std::normal_distribution<float> normal;
  for (int iter = 0; iter < 50; ++iter) {
    const Case c{1 + static_cast<std::int64_t>(rng() % 3), 1 + static_cast<std::int64_t>(rng() % 9),
                 1 + static_cast<std::int64_t>(rng() % 4), 2 * (1 + static_cast<std::int64_t>(rng() % 8)),
                 2 * static_cast<std::int64_t>(rng() % 3), rng() % 2 == 0};
    std::vector<float> x(c.B * c.S * c.H * (c.Dh + c.head_gap)), y(c.B * c.S * c.H * c.Dh),
        back(y.size());
    const std::int64_t tables = (c.per_sample ? c.B : 1) * c.S * c.Dh;
    std::vector<float> cos(tables), sin(tables);
    for (auto& v : x) v = normal(rng);
    for (std::int64_t i = 0; i < tables; i += 2) {  // one angle per pair, as Wan's tables;
      const float angle = normal(rng);  // the members the op must not read are off by 0.5
      cos[i] = std::cos(angle);
      cos[i + 1] = cos[i] + 0.5f;
      sin[i + 1] = std::sin(angle);
      sin[i] = sin[i + 1] - 0.5f;
    }
    RotaryParams p = params(c, x, y, cos, sin);
    rotary_ref(p);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t s = 0; s < c.S; ++s)
        for (std::int64_t h = 0; h < c.H; ++h)
          for (std::int64_t j = 0; j < c.Dh / 2; ++j) {
            const std::int64_t f = (c.per_sample ? b : 0) * c.S * c.Dh + s * c.Dh + 2 * j;
            const std::int64_t k = b * p.x_stride_b + s * p.x_stride_s + h * p.x_stride_h + 2 * j;
            const std::int64_t i = ((b * c.S + s) * c.H + h) * c.Dh + 2 * j;
            const double a = x[k], bb = x[k + 1], co = cos[f], si = sin[f + 1];
            EXPECT_NEAR(y[i], a * co - bb * si, 1e-5) << "iter " << iter;
            EXPECT_NEAR(y[i + 1], a * si + bb * co, 1e-5) << "iter " << iter;
          }
    Case dense = c;  // y is contiguous: the inverse reads it with no head gap
    dense.head_gap = 0;
    RotaryParams q = params(dense, y, back, cos, sin);
    q.inverse = true;
    rotary_ref(q);
    for (std::int64_t r = 0; r < c.B * c.S * c.H; ++r)
      for (std::int64_t d = 0; d < c.Dh; ++d)
        EXPECT_NEAR(back[r * c.Dh + d], x[r * (c.Dh + c.head_gap) + d], 1e-5) << "iter " << iter;
  }
}

TEST(RotaryRef, ChecksNameTheField) {
  const Case c{1, 2, 1, 4, 0, false};
  std::vector<float> x(8), y(8), cos(8), sin(8);
  auto expect = [&](auto edit, const std::string& field) {
    RotaryParams p = params(c, x, y, cos, sin);
    edit(p);
    try {
      rotary_ref(p);
      ADD_FAILURE() << "no error for " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect([](RotaryParams& p) { p.head_dim = 3; }, "p.head_dim must be even");
  expect([](RotaryParams& p) { p.heads = 0; }, "p.heads must be >= 1");
  expect([](RotaryParams& p) { p.freq_stride_b = 3; }, "p.freq_stride_b must be 0 or");
  expect([](RotaryParams& p) { p.x_stride_h = 5; }, "p.x_stride_b/s/h must be even");
  expect([](RotaryParams& p) { p.cos = nullptr; }, "p.cos and p.sin must not be null");
  expect([](RotaryParams& p) { p.seq_len = std::int64_t{1} << 62; }, "overflows");
  RotaryParams p = params(c, x, y, cos, sin);
  p.dtype = DType::kFloat64;
  EXPECT_THROW(rotary_check(p, /*for_gpu=*/true), Error);
}

}  // namespace
}  // namespace ditscale::kernels
