#include "ditscale/sp/workload.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ditscale::sp
