// ShapeManifest on manifests large enough for its two-thread path (>= 2^17 samples) and with
// more distinct (frames, height, width) triples than its memo keeps: the result is the
// one-sample-at-a-time mapping (ToTrainShape), and an error names the first bad row in row
// order whichever part it falls in.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <tuple>
#include <utility>

#include "ditscale/balance/shapes.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

constexpr int kRows = 300000;

// Videos at a few fps and random lengths, images of common and of random sizes.
Manifest RandomManifest(uint64_t seed) {
  std::mt19937_64 rng(seed);
  const float fps[] = {24, 25, 30, 60, 23.976f, 29.97f};
  const int sizes[][2] = {{480, 854}, {720, 1280}, {1080, 1920}, {1280, 720}, {512, 512}};
  Manifest m;
  m.source = "random.csv";
  for (int i = 0; i < kRows; ++i) {
    const int kind = static_cast<int>(rng() % 3);
    const auto& hw = sizes[rng() % 5];
    if (kind == 0) {
      m.samples.push_back(
          RawSample{static_cast<int32_t>(2 + rng() % 600), hw[0], hw[1], fps[rng() % 6]});
    } else if (kind == 1) {
      m.samples.push_back(RawSample{1, hw[0], hw[1], 0});
    } else {
      m.samples.push_back(RawSample{1, static_cast<int32_t>(200 + rng() % 2300),
                                    static_cast<int32_t>(200 + rng() % 2300), 0});
    }
    m.ids.push_back(2 * static_cast<int64_t>(i) + 5);
  }
  return m;
}

void ExpectOneByOne(const Manifest& m, const ModelPreset& model) {
  const ShapedManifest s = ShapeManifest(m, model);
  ASSERT_EQ(s.shape_of.size(), m.samples.size());
  EXPECT_EQ(s.ids, m.ids);
  EXPECT_TRUE(std::is_sorted(s.shapes.begin(), s.shapes.end(), [](auto& a, auto& b) {
    return std::tie(a.seq_len, a.frames, a.height, a.width) <
           std::tie(b.seq_len, b.frames, b.height, b.width);
  }));
  EXPECT_EQ(std::adjacent_find(s.shapes.begin(), s.shapes.end()), s.shapes.end());
  std::vector<int64_t> count(s.shapes.size(), 0);
  for (size_t i = 0; i < m.samples.size(); ++i) {
    ASSERT_EQ(s.shapes[s.shape_of[i]], ToTrainShape(m.samples[i], model)) << "row " << i;
    ++count[s.shape_of[i]];
  }
  EXPECT_EQ(count, s.count);
  for (int64_t c : count) EXPECT_GT(c, 0);
}

TEST(ShapesParallel, LargeManifestEqualsOneSampleAtATime) {
  const Manifest m = RandomManifest(11);
  ExpectOneByOne(m, GetModelPreset("wan2.1-1.3b").value());
  ExpectOneByOne(m, GetModelPreset("flux").value());
  // Without buckets every aligned size is a shape of its own: thousands of them.
  auto no_buckets = ParseModelFile(R"({"base":"hunyuanvideo","buckets":[]})", "m.json");
  ASSERT_TRUE(no_buckets.ok()) << no_buckets.failure().ToString();
  ExpectOneByOne(m, *no_buckets);
  // A temporal stride that is not a power of two (the memo's frame rule divides instead of
  // shifting).
  auto stride3 =
      ParseModelFile(R"({"base":"wan2.1-1.3b","vae_stride_t":3,"max_frames":100})", "m.json");
  ASSERT_TRUE(stride3.ok()) << stride3.failure().ToString();
  ExpectOneByOne(m, *stride3);
}

std::string ErrorOf(const Manifest& m, const ModelPreset& model) {
  try {
    ShapeManifest(m, model);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(ShapesParallel, ErrorNamesTheFirstBadRowInRowOrder) {
  const ModelPreset wan = GetModelPreset("wan2.1-1.3b").value();
  Manifest m = RandomManifest(12);
  // Bad rows in the second half only, then one in the first half too.
  m.samples[kRows - 10].height = 0;
  m.samples[kRows / 2 + 100] = RawSample{1, 512, -3, 0};
  EXPECT_EQ(ErrorOf(m, wan), "random.csv: sample id " + std::to_string(m.ids[kRows / 2 + 100]) +
                                 ": sample (num_frames 1, height 512, width -3, fps 0): "
                                 "num_frames, height and width must be >= 1 and fps finite and "
                                 ">= 0");
  m.samples[7] = RawSample{0, 480, 854, 24};
  EXPECT_EQ(ErrorOf(m, wan),
            "random.csv: sample id 19: sample (num_frames 0, height 480, width "
            "854, fps 24): num_frames, height and width must be >= 1 and fps "
            "finite and >= 0");
  // A token count out of range in the second half names that sample and the model.
  auto big = ParseModelFile(
      R"({"base":"wan2.1-1.3b","vae_stride_t":1,"vae_stride_hw":1,"patch_t":1,"patch_h":1,
          "patch_w":1,"max_frames":1048576,"target_fps":0,"buckets":[]})",
      "big.json");
  ASSERT_TRUE(big.ok()) << big.failure().ToString();
  Manifest m2 = RandomManifest(13);
  for (RawSample& r : m2.samples) r = RawSample{1, r.height, r.width, 0};  // images only
  m2.samples[kRows - 1] = RawSample{1025, 1024, 2048, 16};
  m2.samples[kRows - 2] = RawSample{1024, 1024, 1024, 16};  // 2^30 tokens: the limit itself
  const std::string e = ErrorOf(m2, *big);
  EXPECT_NE(e.find("random.csv: sample id " + std::to_string(m2.ids[kRows - 1]) +
                   ": tokens of sample (num_frames 1025, height 1024, width 2048, fps 16) for "
                   "model wan2.1-1.3b@big.json: 2149580800 is out of range [1, 1073741824]"),
            std::string::npos)
      << e;
}

// ShapeManifest(Manifest&&) moves the ids instead of copying them: the same result, the same
// error text (naming the sample id), manifest.ids left empty and the samples untouched.
TEST(ShapesParallel, MovedIdsGiveTheSameResultAndErrors) {
  const ModelPreset wan = GetModelPreset("wan2.1-1.3b").value();
  const Manifest m = RandomManifest(14);
  const ShapedManifest copied = ShapeManifest(m, wan);
  Manifest moved_from = m;
  const ShapedManifest moved = ShapeManifest(std::move(moved_from), wan);
  EXPECT_EQ(moved.ids, m.ids);
  EXPECT_EQ(moved.shape_of, copied.shape_of);
  EXPECT_EQ(moved.shapes, copied.shapes);
  EXPECT_EQ(moved.count, copied.count);
  EXPECT_TRUE(moved_from.ids.empty());  // NOLINT(bugprone-use-after-move): documented state
  EXPECT_EQ(moved_from.samples.size(), m.samples.size());

  Manifest bad = m;
  bad.samples[kRows / 2 + 7].height = 0;
  const std::string want = ErrorOf(bad, wan);
  std::string got = "no error";
  try {
    ShapeManifest(std::move(bad), wan);
  } catch (const Error& e) {
    got = e.what();
  }
  EXPECT_EQ(got, want);
  EXPECT_NE(got.find("sample id " + std::to_string(m.ids[kRows / 2 + 7]) + ":"), std::string::npos)
      << got;
}

}  // namespace
}  // namespace ditscale::balance
