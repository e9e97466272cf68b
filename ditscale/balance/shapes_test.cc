#include "ditscale/balance/shapes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "ditscale/core/error.h"
#include "ditscale/core/temp_dir_test_util.h"

namespace ditscale::balance {
namespace {

ModelPreset Preset(const std::string& name) { return GetModelPreset(name).value(); }

RawSample Video(int f, int h, int w, float fps) { return RawSample{f, h, w, fps}; }
RawSample Image(int h, int w) { return RawSample{1, h, w, 0.f}; }

TEST(Shapes, PresetsExistWithTheirArchitecture) {
  EXPECT_EQ(ModelPresetNames(), (std::vector<std::string>{"wan2.1-1.3b", "wan2.1-14b",
                                                          "hunyuanvideo", "cogvideox-5b", "flux"}));
  auto w = Preset("wan2.1-14b");
  EXPECT_EQ(w.hidden, 5120);
  EXPECT_EQ(w.layers, 40);
  EXPECT_EQ(w.heads, 40);
  EXPECT_EQ(w.ffn_hidden, 13824);
  EXPECT_FALSE(w.joint_text);
  auto f = Preset("flux");
  EXPECT_EQ(f.layers, 57);
  EXPECT_TRUE(f.images_only);
  auto bad = GetModelPreset("sd3");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.failure().message.find("wan2.1-1.3b"), std::string::npos);
  for (const auto& name : ModelPresetNames()) {
    for (const auto& b : Preset(name).buckets) {
      EXPECT_EQ(b.height % 16, 0) << name;
      EXPECT_EQ(b.width % 16, 0) << name;
    }
  }
}

TEST(Shapes, WanExactTokenCounts) {
  const auto wan = Preset("wan2.1-1.3b");
  // 81 frames at 16 fps, 480x832: 21 latent frames x 30 x 52.
  EXPECT_EQ(ToTrainShape(Video(81, 480, 832, 16), wan), (TrainShape{81, 480, 832, 32760}));
  // 150 frames at 30 fps -> floor(149*16/30)+1 = 80 -> 4k+1 rule -> 77 frames, 20 latent.
  EXPECT_EQ(ToTrainShape(Video(150, 480, 832, 30), wan), (TrainShape{77, 480, 832, 31200}));
  // 1080p 60 fps 10 s: 600 -> floor(599*16/60)+1 = 160 -> clamp 81; 16:9 -> 720x1280.
  EXPECT_EQ(ToTrainShape(Video(600, 1080, 1920, 60), wan), (TrainShape{81, 720, 1280, 75600}));
  // fps below the target keeps the frames: 50 at 8 fps -> 49.
  EXPECT_EQ(ToTrainShape(Video(50, 480, 832, 8), wan).frames, 49);
  // 854x480 landscape: 720x1280 has the nearest aspect ratio but 832x480 is within the 5%
  // tolerance and much nearer in area.
  EXPECT_EQ(ToTrainShape(Video(81, 480, 854, 16), wan), (TrainShape{81, 480, 832, 32760}));
  // Images: 1024^2 -> 960x960 (3600 tokens); tiny -> 256x256; huge -> largest square bucket.
  EXPECT_EQ(ToTrainShape(Image(1024, 1024), wan), (TrainShape{1, 960, 960, 3600}));
  EXPECT_EQ(ToTrainShape(Image(100, 100), wan), (TrainShape{1, 256, 256, 256}));
  EXPECT_EQ(ToTrainShape(Image(4000, 4000), wan), (TrainShape{1, 960, 960, 3600}));
  // Portrait 3:4 (640x480 h x w): 1104x832 has the nearest aspect ratio; 704x544 and 288x224
  // are within 5%; 704x544 is nearest in area.
  EXPECT_EQ(ToTrainShape(Image(640, 480), wan), (TrainShape{1, 704, 544, 44 * 34}));
  // A 3-frame video rounds down to a single frame.
  EXPECT_EQ(ToTrainShape(Video(3, 480, 832, 16), wan).frames, 1);
}

TEST(Shapes, OtherPresetsExactTokenCounts) {
  // HunyuanVideo: 129 frames at 24 fps, 720x1280: 33 x 45 x 80 + 256 joint text tokens.
  EXPECT_EQ(ToTrainShape(Video(129, 720, 1280, 24), Preset("hunyuanvideo")).seq_len,
            33 * 45 * 80 + 256);
  // CogVideoX-5b: 49 frames at 8 fps, 480x720: 13 x 30 x 45 + 226.
  EXPECT_EQ(ToTrainShape(Video(49, 480, 720, 8), Preset("cogvideox-5b")),
            (TrainShape{49, 480, 720, 13 * 30 * 45 + 226}));
  // 30 fps, 300 frames -> floor(299*8/30)+1 = 80 -> clamp 49.
  EXPECT_EQ(ToTrainShape(Video(300, 480, 720, 30), Preset("cogvideox-5b")).frames, 49);
  // Flux treats a video as an image: 1024^2 -> 64 x 64 + 512.
  EXPECT_EQ(ToTrainShape(Video(81, 1024, 1024, 24), Preset("flux")),
            (TrainShape{1, 1024, 1024, 64 * 64 + 512}));
  // No buckets: rounded down to 16 px.
  auto m = Preset("wan2.1-1.3b");
  m.buckets.clear();
  EXPECT_EQ(ToTrainShape(Image(500, 810), m), (TrainShape{1, 496, 800, 31 * 50}));
}

// Fresh random samples obey the documented rules (checked against a brute-force reading).
TEST(Shapes, RandomSamplesFollowTheDocumentedRules) {
  std::mt19937_64 rng(std::random_device{}());
  for (const auto& name : ModelPresetNames()) {
    const auto m = Preset(name);
    for (int i = 0; i < 3000; ++i) {
      const bool image = rng() % 3 == 0;
      RawSample s{image ? 1 : static_cast<int32_t>(2 + rng() % 2000),
                  static_cast<int32_t>(32 + rng() % 4000), static_cast<int32_t>(32 + rng() % 4000),
                  image ? 0.f : static_cast<float>(5 + rng() % 60)};
      const TrainShape t = ToTrainShape(s, m);
      if (m.images_only || image) {
        EXPECT_EQ(t.frames, 1);
      } else {
        int64_t f = s.num_frames;
        if (s.fps > m.target_fps) f = static_cast<int64_t>((f - 1) * m.target_fps / s.fps) + 1;
        f = std::min<int64_t>(f, m.max_frames);
        EXPECT_EQ(t.frames, (f - 1) / 4 * 4 + 1) << name << " " << s.num_frames << "@" << s.fps;
      }
      EXPECT_EQ((t.frames - 1) % m.vae_stride_t, 0);
      EXPECT_LE(t.frames, m.max_frames);
      const int64_t want = (1 + (t.frames - 1) / 4) * (t.height / 16) * (t.width / 16) +
                           (m.joint_text ? m.text_tokens : 0);
      EXPECT_EQ(t.seq_len, want);
      // The bucket: within 5% of the best aspect ratio and nearest in area among those.
      auto dar = [&](const Resolution& b) {
        return std::abs(std::log(double(s.height) / s.width) -
                        std::log(double(b.height) / b.width));
      };
      auto darea = [&](const Resolution& b) {
        return std::abs(std::log(double(s.height) * s.width) -
                        std::log(double(b.height) * b.width));
      };
      double best = 1e9;
      for (const auto& b : m.buckets) best = std::min(best, dar(b));
      const Resolution chosen{t.height, t.width};
      ASSERT_LE(dar(chosen), best + 0.05 + 1e-12);
      for (const auto& b : m.buckets) {
        if (dar(b) <= best + 0.05) EXPECT_LE(darea(chosen), darea(b) + 1e-12);
      }
    }
  }
}

TEST(Shapes, ShapeManifestGroupsDeterministically) {
  std::mt19937_64 rng(std::random_device{}());
  Manifest m;
  const std::vector<RawSample> kinds = {Video(81, 480, 832, 16), Video(150, 720, 1280, 30),
                                        Image(1024, 1024), Image(512, 512),
                                        Video(81, 480, 854, 16)};
  for (int i = 0; i < 5000; ++i) {
    m.samples.push_back(kinds[rng() % kinds.size()]);
    m.ids.push_back(3 * i + 1);
  }
  const auto wan = Preset("wan2.1-1.3b");
  const ShapedManifest s = ShapeManifest(m, wan);
  ASSERT_EQ(s.shape_of.size(), m.samples.size());
  EXPECT_EQ(s.ids, m.ids);
  EXPECT_TRUE(std::is_sorted(s.shapes.begin(), s.shapes.end(), [](auto& a, auto& b) {
    return std::tie(a.seq_len, a.frames, a.height, a.width) <
           std::tie(b.seq_len, b.frames, b.height, b.width);
  }));
  std::vector<int64_t> count(s.shapes.size(), 0);
  for (size_t i = 0; i < m.samples.size(); ++i) {
    ASSERT_EQ(s.shapes[s.shape_of[i]], ToTrainShape(m.samples[i], wan));
    ++count[s.shape_of[i]];
  }
  EXPECT_EQ(count, s.count);
  // Kinds 0 and 4 share a shape: at most 4 distinct shapes.
  EXPECT_LE(s.shapes.size(), 4u);
  // Shuffled input: same shape list.
  Manifest m2 = m;
  std::shuffle(m2.samples.begin(), m2.samples.end(), rng);
  EXPECT_EQ(ShapeManifest(m2, wan).shapes, s.shapes);
}

class ModelFileTest : public ::testing::Test {
 protected:
  // Each call writes a new file of the test's directory; all are removed with it.
  std::string Write(const std::string& text) {
    return dir_.Write("ds_model_" + std::to_string(files_++) + ".json", text);
  }
  ditscale::testing::TempDir dir_{"ds_model_"};
  int files_ = 0;
};

TEST_F(ModelFileTest, BaseWithOverrides) {
  auto p = Write(R"({"base": "wan2.1-14b", "max_frames": 121, "buckets": [[480, 832], [720, 1280]],
                     "name": "wan14-long"})");
  auto m = LoadModelFile(p);
  ASSERT_TRUE(m.ok()) << m.failure().ToString();
  EXPECT_EQ(m->name, "wan14-long");
  EXPECT_EQ(m->hidden, 5120);
  EXPECT_EQ(m->max_frames, 121);
  ASSERT_EQ(m->buckets.size(), 2u);
  EXPECT_EQ(ToTrainShape(Video(121, 720, 1280, 16), *m).seq_len, 31 * 45 * 80);
  auto r = ResolveModel(p);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->max_frames, 121);
  EXPECT_TRUE(ResolveModel("flux").ok());
  EXPECT_FALSE(ResolveModel("no-such-model").ok());
}

TEST_F(ModelFileTest, ErrorsNameFileAndField) {
  struct Case {
    std::string json, field;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"base": "wan2.1-14b", "max_frame": 1})", "max_frame"},
           {R"({"base": "nope"})", "base"},
           {R"({"base": "flux", "hidden": "big"})", "hidden"},
           {R"({"base": "flux", "layers": 0})", "layers"},
           {R"({"base": "flux", "patch_h": 1.5})", "patch_h"},
           {R"({"base": "flux", "joint_text": 1})", "joint_text"},
           {R"({"base": "flux", "buckets": [[512, 512], [500, 512]]})", "buckets[1]"},
           {R"({"base": "flux", "buckets": [[512]]})", "buckets[0]"},
           {R"({"heads": 4})", "hidden"},
       }) {
    auto p = Write(c.json);
    auto m = LoadModelFile(p);
    ASSERT_FALSE(m.ok()) << c.json;
    EXPECT_EQ(m.failure().file, p);
    EXPECT_EQ(m.failure().column, c.field) << c.json << ": " << m.failure().ToString();
  }
  auto p = Write("{\n\"base\": \"flux\",\n\"hidden\": }\n");
  auto m = LoadModelFile(p);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.failure().line, 3);
}

// Issue 20: fields that each passed validation multiplied to 0 (vae_stride_hw * patch_h wraps
// int32) and killed the process with SIGFPE; now every field has a range.
TEST_F(ModelFileTest, FieldRangesNameFieldValueAndRange) {
  struct Case {
    std::string json, field, expect;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"base":"wan2.1-1.3b","vae_stride_hw":65536,"patch_h":65536})", "vae_stride_hw",
            "vae_stride_hw: 65536 is out of range [1, 64]"},
           {R"({"base":"wan2.1-1.3b","max_frames":2147483647})", "max_frames",
            "max_frames: 2147483647 is out of range [1, 1048576]"},
           {R"({"base":"wan2.1-1.3b","patch_w":0})", "patch_w", "patch_w: 0 is out of range"},
           {R"({"base":"wan2.1-1.3b","hidden":9223372036854775807})", "hidden",
            "hidden: 9223372036854775807 is out of range [1, 65536]"},
           {R"({"base":"wan2.1-1.3b","text_tokens":-1})", "text_tokens",
            "text_tokens: -1 is out of range [0, 1048576]"},
           {R"({"base":"wan2.1-1.3b","target_fps":1e300})", "target_fps",
            "is out of range [0, 1000]"},
           {R"({"base":"wan2.1-1.3b","buckets":[[0, 512]]})", "buckets[0]",
            "is out of range [1, 1048576]"},
           {R"({"base":"wan2.1-1.3b","buckets":[[4294967296, 512]]})", "buckets[0]",
            "is out of range [1, 1048576]"},
       }) {
    auto p = Write(c.json);
    auto m = LoadModelFile(p);
    ASSERT_FALSE(m.ok()) << c.json;
    EXPECT_EQ(m.failure().column, c.field) << m.failure().ToString();
    EXPECT_NE(m.failure().message.find(c.expect), std::string::npos) << m.failure().ToString();
  }
}

// The model file goes through the one JSON reader: duplicate keys, 1e400 and directories are
// refused with the file's name.
TEST_F(ModelFileTest, StrictJsonReader) {
  for (const std::string json :
       {R"({"base":"flux","hidden":1024,"hidden":2048})", R"({"base":"flux","params_b":1e400})"}) {
    auto p = Write(json);
    auto m = LoadModelFile(p);
    ASSERT_FALSE(m.ok()) << json;
    EXPECT_NE(m.failure().ToString().find(p), std::string::npos) << m.failure().ToString();
  }
  const std::string dir = std::filesystem::temp_directory_path().string();
  auto m = ResolveModel(dir);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.failure().ToString().find(dir), std::string::npos) << m.failure().ToString();
}

// Token counts are checked 64-bit arithmetic bounded by kMaxSeqLen: the largest fields on the
// largest raw samples end in an error naming the sample, never a negative count.
TEST(Shapes, TokenCountsNeverWrap) {
  auto m = ParseModelFile(
      R"({"base":"wan2.1-1.3b","vae_stride_t":1,"vae_stride_hw":1,"patch_t":1,"patch_h":1,
          "patch_w":1,"max_frames":1048576,"target_fps":0,"buckets":[]})",
      "m.json");
  ASSERT_TRUE(m.ok()) << m.failure().ToString();
  const int32_t big = std::numeric_limits<int32_t>::max();
  try {
    ToTrainShape(RawSample{big, big, big, 16}, *m);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("num_frames 2147483647"), std::string::npos) << what;
    EXPECT_NE(what.find("overflows int64"), std::string::npos) << what;
  }
  try {
    ToTrainShape(RawSample{1025, 1024, 2048, 16}, *m);  // 1025 * 1024 * 2048 tokens
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2149580800 is out of range [1, 1073741824]"), std::string::npos) << what;
  }
  EXPECT_EQ(ToTrainShape(RawSample{5, 64, 32, 16}, *m).seq_len, 5 * 64 * 32);
  // Non-positive raw sizes are refused, not mapped to one patch.
  EXPECT_THROW(ToTrainShape(RawSample{1, 0, 512, 0}, *m), Error);
  EXPECT_THROW(ToTrainShape(RawSample{1, 512, -4, 0}, *m), Error);
  EXPECT_THROW(ToTrainShape(RawSample{9, 512, 512, -1}, *m), Error);
  // ShapeManifest names the sample id.
  Manifest man;
  man.source = "x.csv";
  man.samples = {RawSample{1, 64, 64, 0}, RawSample{big, big, big, 16}};
  man.ids = {0, 7};
  try {
    ShapeManifest(man, *m);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x.csv: sample id 7"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ditscale::balance
