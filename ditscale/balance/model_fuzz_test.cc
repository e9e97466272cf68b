// Fuzz of the two JSON readers a user points `ditscale plan` at: model files (--model) and cost
// models (--cost). Valid files are mutated (random byte flips, field values replaced by hostile
// numbers and types, hostile fields added) for a bounded number of iterations with a fixed seed;
// every input must end in a Result failure or a usable value:
//   model: every sample maps to a shape with 1 <= S <= kMaxSeqLen, or ditscale::Error;
//   cost:  Work(S) finite and > 0 over [1, kMaxSeqLen], memory m1 > 0.
// Any other exception (nlohmann, std::bad_alloc, ...) or a crash fails the test.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

constexpr int kIterations = 2500;          // per reader
constexpr double kTimeLimitS = 0.8;        // per reader, whichever comes first
constexpr uint64_t kSeed = 0x5eed2025ull;  // fixed: failures reproduce

const std::vector<std::string> kHostile = {"0",
                                           "-1",
                                           "2147483648",
                                           "9223372036854775807",
                                           "18446744073709551616",
                                           "1e400",
                                           "nan",
                                           "\"1\"",
                                           "[]",
                                           "{}",
                                           "1.5",
                                           "-0",
                                           "1e-400",
                                           "true",
                                           "null",
                                           "65536",
                                           "4294967296"};

const std::vector<std::string> kModelSeeds = {
    R"({"base": "wan2.1-1.3b", "vae_stride_hw": 8, "patch_h": 2})",
    R"({"base": "wan2.1-14b", "max_frames": 121, "buckets": [[480, 832], [720, 1280]]})",
    R"({"name": "custom", "hidden": 1024, "layers": 8, "heads": 8, "ffn_hidden": 4096,
        "text_tokens": 77, "joint_text": true, "params_b": 0.5, "vae_stride_t": 1,
        "vae_stride_hw": 1, "patch_t": 1, "patch_h": 1, "patch_w": 1, "target_fps": 0,
        "max_frames": 1048576, "images_only": false, "buckets": []})",
    R"({"base": "flux", "buckets": [[512, 512], [1024, 1024]]})",
};

const std::vector<std::string> kModelFields = {
    "hidden",     "layers",       "heads",         "ffn_hidden", "text_tokens", "joint_text",
    "params_b",   "vae_stride_t", "vae_stride_hw", "patch_t",    "patch_h",     "patch_w",
    "target_fps", "max_frames",   "images_only",   "buckets",    "base",        "name"};

const std::vector<std::string> kCostSeeds = {
    R"({"kind": "power", "a": 0.05, "a_mb": 0.01, "b": 1e-9, "p": 1.8,
        "memory": {"m0": 2e10, "m1": 1e5}})",
    R"({"kind": "quadratic", "a": 0.05, "c1": 1e-6, "c2": 1e-11, "source": "x"})",
};

const std::vector<std::string> kCostFields = {"kind", "a",      "a_mb",   "b",  "p", "c1",
                                              "c2",   "memory", "source", "m0", "m1"};

// One mutation of `text`: byte flips, a field's value replaced, or a field added.
std::string Mutate(const std::string& text, const std::vector<std::string>& fields,
                   std::mt19937_64& g) {
  std::string s = text;
  const auto pick = [&](size_t n) { return static_cast<size_t>(g() % n); };
  switch (g() % 3) {
    case 0: {  // flip 1-4 random bytes
      const int flips = 1 + static_cast<int>(g() % 4);
      for (int i = 0; i < flips && !s.empty(); ++i) {
        s[pick(s.size())] = static_cast<char>(g() & 0xff);
      }
      break;
    }
    case 1: {  // replace the value of a present field with a hostile one
      const std::string key = "\"" + fields[pick(fields.size())] + "\":";
      const size_t at = s.find(key);
      if (at == std::string::npos) break;
      size_t b = at + key.size();
      while (b < s.size() && s[b] == ' ') ++b;
      size_t e = b;
      int depth = 0;
      while (e < s.size()) {
        const char c = s[e];
        if (c == '[' || c == '{') ++depth;
        if (c == ']' || c == '}') {
          if (depth == 0) break;
          --depth;
        }
        if (c == ',' && depth == 0) break;
        ++e;
      }
      s = s.substr(0, b) + kHostile[pick(kHostile.size())] + s.substr(e);
      break;
    }
    default: {  // add (or duplicate) a field with a hostile value after the opening brace
      const size_t at = s.find('{');
      if (at == std::string::npos) break;
      s.insert(at + 1, "\"" + fields[pick(fields.size())] +
                           "\": " + kHostile[pick(kHostile.size())] + ", ");
    }
  }
  return s;
}

// Raw samples from ordinary to extreme (int32 limits, a tiny and a huge fps).
std::vector<RawSample> ProbeSamples() {
  const int32_t big = std::numeric_limits<int32_t>::max();
  return {{1, 1, 1, 0},           {1, 512, 512, 0},     {81, 480, 832, 30},
          {121, 720, 1280, 16},   {big, 720, 1280, 16}, {1, big, big, 0},
          {big, big, big, 1e30f}, {5, 3, big, 1e-30f},  {2, 65536, 65536, 24}};
}

bool TimeLeft(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < kTimeLimitS;
}

TEST(ModelFuzz, MutatedModelFilesFailCleanlyOrMapToValidShapes) {
  std::mt19937_64 g(kSeed);
  const std::vector<RawSample> probes = ProbeSamples();
  int parsed = 0, refused = 0, shape_errors = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations && TimeLeft(t0); ++it) {
    std::string text = kModelSeeds[g() % kModelSeeds.size()];
    const int rounds = 1 + static_cast<int>(g() % 3);
    for (int r = 0; r < rounds; ++r) text = Mutate(text, kModelFields, g);
    SCOPED_TRACE("input: " + text);
    Result<ModelPreset> m = Failure::InvalidArgument("not parsed");
    try {
      m = ParseModelFile(text, "fuzz.json");
    } catch (const std::exception& e) {
      FAIL() << "ParseModelFile threw " << e.what();
    }
    if (!m.ok()) {
      ++refused;
      EXPECT_EQ(m.failure().file, "fuzz.json");
      EXPECT_FALSE(m.failure().message.empty());
      continue;
    }
    ++parsed;
    for (const RawSample& s : probes) {
      try {
        const TrainShape t = ToTrainShape(s, *m);
        EXPECT_GE(t.seq_len, 1);
        EXPECT_LE(t.seq_len, kMaxSeqLen);
        EXPECT_GE(t.frames, 1);
        EXPECT_GE(t.height, 1);
        EXPECT_GE(t.width, 1);
      } catch (const Error& e) {
        ++shape_errors;
        EXPECT_NE(std::string(e.what()).find("sample"), std::string::npos) << e.what();
      } catch (const std::exception& e) {
        FAIL() << "ToTrainShape threw a non-ditscale exception: " << e.what();
      }
    }
  }
  // The mutations must exercise both outcomes.
  EXPECT_GT(parsed, 10);
  EXPECT_GT(refused, 10);
  EXPECT_GT(shape_errors, 0);
}

TEST(ModelFuzz, MutatedCostFilesFailCleanlyOrPredictPositiveWork) {
  std::mt19937_64 g(kSeed + 1);
  int parsed = 0, refused = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < kIterations && TimeLeft(t0); ++it) {
    std::string text = kCostSeeds[g() % kCostSeeds.size()];
    const int rounds = 1 + static_cast<int>(g() % 3);
    for (int r = 0; r < rounds; ++r) text = Mutate(text, kCostFields, g);
    SCOPED_TRACE("input: " + text);
    MemoryModel mem;
    mem.m1 = -1;
    Result<CostModel> c = Failure::InvalidArgument("not parsed");
    try {
      c = ParseCostModel(text, "cost.json", &mem);
    } catch (const std::exception& e) {
      FAIL() << "ParseCostModel threw " << e.what();
    }
    if (!c.ok()) {
      ++refused;
      EXPECT_EQ(c.failure().file, "cost.json");
      continue;
    }
    ++parsed;
    for (int64_t s : {int64_t{1}, int64_t{1000}, int64_t{75600}, kMaxSeqLen}) {
      const double w = c->Work(s);
      EXPECT_TRUE(std::isfinite(w) && w > 0) << "Work(" << s << ") = " << w;
    }
    EXPECT_TRUE(c->a >= 0 && std::isfinite(c->a));
    EXPECT_TRUE(c->a_mb >= 0 && std::isfinite(c->a_mb));
    if (mem.m1 != -1) {
      EXPECT_GT(mem.m1, 0);
      EXPECT_GE(mem.m0, 0);
      EXPECT_GE(mem.MaxTokens(141.0 * (1ull << 30), 0.1), 0);
    }
  }
  EXPECT_GT(parsed, 10);
  EXPECT_GT(refused, 10);
}

}  // namespace
}  // namespace ditscale::balance
