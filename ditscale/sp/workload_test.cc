#include "ditscale/sp/workload.h"

#include <gtest/gtest.h>

#include <cmath>

namespace ditscale::sp {
namespace {

Workload Make(const std::string& m, WorkloadOptions o) { return MakeWorkload(m, o).value(); }

TEST(Workload, FluxTokensFromResolution) {
  EXPECT_EQ(Make("flux", {3072, 3072}).tokens, 36864);
  EXPECT_EQ(Make("flux", {4096, 4096}).tokens, 65536);
  Workload f = Make("flux", {1024, 1024});
  EXPECT_EQ(f.tokens, 4096);
  EXPECT_EQ(f.text_tokens, 512);
  EXPECT_EQ(f.heads, 24);
  EXPECT_EQ(f.head_dim, 128);
  EXPECT_EQ(f.layers, 57);
}

TEST(Workload, CogVideoXTokensFromDuration) {
  WorkloadOptions o;
  o.duration_s = 6;
  EXPECT_EQ(Make("cogvideox-5b", o).tokens, 13 * 1350);
  o.duration_s = 20;
  EXPECT_EQ(Make("cogvideox-5b", o).tokens, 55350);
  o.duration_s = 40;
  Workload c = Make("cogvideox-5b", o);
  EXPECT_EQ(c.tokens, 109350);
  EXPECT_EQ(c.heads, 48);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.text_tokens, 226);
  EXPECT_EQ(Make("cogvideox-2b", o).heads, 30);
  // Frame counts that are not 4k+1 round up.
  WorkloadOptions f;
  f.frames = 50;
  EXPECT_EQ(Make("cogvideox-5b", f).tokens, 14 * 1350);
}

TEST(Workload, WanAndHunyuan) {
  Workload w = Make("wan2.1-14b", {});
  EXPECT_EQ(w.tokens, 21 * 3600);  // 720x1280, 5 s at 16 fps = 81 frames
  EXPECT_EQ(w.text_tokens, 0);
  EXPECT_EQ(w.heads, 40);
  Workload h = Make("hunyuanvideo", {});
  EXPECT_EQ(h.tokens, 33 * 3600);  // 129 frames
  EXPECT_EQ(h.layers, 60);
  EXPECT_EQ(h.text_tokens, 256);
}

TEST(Workload, FlopsAndBytes) {
  Workload f = Make("flux", {4096, 4096});
  double n = 65536 + 512;
  EXPECT_DOUBLE_EQ(f.AttentionFlops(), 4.0 * 24 * 128 * n * n);
  EXPECT_DOUBLE_EQ(f.QkvoBytes(), n * 24 * 128 * 2);
  EXPECT_DOUBLE_EQ(f.LinearFlops(), n * 24.0 * 3072 * 3072);
  WorkloadOptions o{4096, 4096, 0, 0, 3};
  EXPECT_DOUBLE_EQ(Make("flux", o).AttentionFlops(), 3 * f.AttentionFlops());
}

TEST(Workload, ToAttentionShape) {
  WorkloadOptions o;
  o.duration_s = 20;
  o.batch = 2;
  AttentionShape a = ToAttentionShape(Make("cogvideox-5b", o));
  EXPECT_EQ(a.batch, 2);
  EXPECT_EQ(a.seq_tokens, 55350);
  EXPECT_EQ(a.text_tokens, 226);
  EXPECT_EQ(a.heads, 48);
  EXPECT_EQ(a.kv_heads_or_heads(), 48);
  EXPECT_EQ(a.head_dim, 64);
  EXPECT_EQ(a.dtype_bytes, 2);
}

TEST(Workload, BadOptionsNameTheField) {
  auto expect_fail = [](const std::string& model, WorkloadOptions o, const std::string& field) {
    auto r = MakeWorkload(model, o);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.failure().column, field) << r.failure().ToString();
  };
  expect_fail("flux", {1000, 1024}, "height");
  expect_fail("flux", {1024, -16}, "width");
  expect_fail("flux", {1024, 1024, 5}, "duration_s");
  expect_fail("flux", {1024, 1024, 0, 0, 0}, "batch");
  expect_fail("sd3", {}, "model");
  expect_fail("cogvideox-5b", {0, 0, -1}, "duration_s");
  Workload w = Make("flux", {});
  w.kv_heads = 5;
  EXPECT_EQ(w.Validate().failure().column, "kv_heads");
}

// Every size has a limit checked before anything is sized by it; 0 is the model's default, a
// negative value an error (no silent fallback); messages name the field, the value and the range.
TEST(Workload, SizesOutOfRangeNameFieldValueAndRange) {
  auto expect = [](const std::string& model, WorkloadOptions o, const std::string& field,
                   const std::string& text) {
    auto r = MakeWorkload(model, o);
    ASSERT_FALSE(r.ok()) << field;
    EXPECT_EQ(r.failure().column, field) << r.failure().ToString();
    EXPECT_NE(r.failure().message.find(text), std::string::npos) << r.failure().ToString();
  };
  expect("flux", {-16, 1024}, "height", "-16 is out of range [16, 16384]");
  expect("flux", {1024, 16400}, "width", "16400 is out of range [16, 16384]");
  expect("flux", {1000, 1024}, "height", "1000 is not a multiple of 16");
  expect("flux", {1024, 1024, 0, 0, 5000}, "batch", "5000 is out of range [1, 1024]");
  expect("wan2.1-14b", {0, 0, 0, 1000000}, "frames", "1000000 is out of range [1, 16384]");
  expect("wan2.1-14b", {0, 0, 0, -1}, "frames", "-1 is out of range [1, 16384]");
  expect("wan2.1-14b", {0, 0, 1e9}, "duration_s", "1e+09 is out of range [0.001, 3600]");
  expect("wan2.1-14b", {0, 0, std::nan("")}, "duration_s", "nan is out of range");
  expect("wan2.1-14b", {0, 0, 3000}, "duration_s", "48001 frames, over the limit of 16384");
  expect("hunyuanvideo", {16384, 16384, 0, 16384}, "frames", "exceed the limit of 16777216");
  // Absent (0) sizes are the model's defaults.
  EXPECT_EQ(Make("flux", {0, 0}).tokens, 4096);
  EXPECT_EQ(Make("flux", {16384, 16384}).tokens, 1024 * 1024);
  Workload w = Make("flux", {});
  w.heads = w.kv_heads = 100000;
  EXPECT_NE(w.Validate().failure().ToString().find("'heads': 100000 is out of range [1, 1024]"),
            std::string::npos);
  w = Make("flux", {});
  w.tokens = int64_t{1} << 40;
  EXPECT_EQ(w.Validate().failure().column, "tokens");
  w = Make("flux", {});
  w.linear_flops_per_token_per_layer = std::nan("");
  EXPECT_EQ(w.Validate().failure().column, "linear_flops_per_token_per_layer");
}

}  // namespace
}  // namespace ditscale::sp
