#include "ditscale/balance/cost_model.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "ditscale/core/temp_dir_test_util.h"

namespace ditscale::balance {
namespace {

TEST(CostModel, PowerAndQuadraticFormulas) {
  CostModel pw;
  pw.kind = CostModel::Kind::kPower;
  pw.a = 0.1;
  pw.b = 2e-9;
  pw.p = 1.5;
  EXPECT_DOUBLE_EQ(pw.Work(10000), 2e-9 * 1e6);
  EXPECT_DOUBLE_EQ(pw.StepTime(3, 10000), 0.1 + 3 * 2e-3);
  EXPECT_DOUBLE_EQ(pw.Exponent(123), 1.5);

  CostModel q;
  q.kind = CostModel::Kind::kQuadratic;
  q.a = 0.05;
  q.c1 = 1e-5;
  q.c2 = 1e-9;
  EXPECT_DOUBLE_EQ(q.Work(1000), 1e-2 + 1e-3);
  EXPECT_DOUBLE_EQ(q.StepTime(4, 1000), 0.05 + 4 * 1.1e-2);
  // d log W / d log S = (c1 S + 2 c2 S^2) / (c1 S + c2 S^2); equal terms at S = c1/c2 -> 1.5.
  EXPECT_DOUBLE_EQ(q.Exponent(10000), 1.5);
  EXPECT_NEAR(q.Exponent(1), 1.0, 1e-3);
  EXPECT_NEAR(q.Exponent(100'000'000), 2.0, 1e-3);
}

TEST(CostModel, MaxTokens) {
  MemoryModel m{20e9, 1e5};
  EXPECT_EQ(m.MaxTokens(140e9, 0.1), static_cast<int64_t>((126e9 - 20e9) / 1e5));
  EXPECT_EQ(m.MaxTokens(20e9, 0.0), 0);
  EXPECT_EQ(m.MaxTokens(10e9, 0.0), 0);
  MemoryModel free_tokens{1e9, 0};
  EXPECT_EQ(free_tokens.MaxTokens(2e9, 0), std::numeric_limits<int64_t>::max());
}

TEST(CostModel, AnalyticalWan14bMatchesTheDerivation) {
  const auto wan = GetModelPreset("wan2.1-14b").value();
  const CostModel c = AnalyticalCost(wan);
  EXPECT_EQ(c.kind, CostModel::Kind::kQuadratic);
  const double d = 5120, f = 13824, L = 40, T = 512;
  const double per_token =
      2 * (4 * d * d + 2 * d * f) + 4 * d * d + 4 * T * d + 4 * T * d * d / 4096;
  EXPECT_NEAR(c.c1, 3 * L * per_token / (0.45 * 989e12), 1e-12 * c.c1);
  EXPECT_NEAR(c.c2, 3 * L * 4 * d / (0.40 * 989e12), 1e-12 * c.c2);
  EXPECT_DOUBLE_EQ(c.a, 0.05);
  // An 81-frame 480p sample (32760 tokens): ~12 s of compute on one H200.
  const double t = c.StepTime(1, 32760);
  EXPECT_GT(t, 8);
  EXPECT_LT(t, 16);
  EXPECT_GT(c.Exponent(32760), 1.4);
  EXPECT_LT(c.Exponent(32760), 1.7);
  EXPECT_EQ(c.source, "analytical:wan2.1-14b@h200");
  // Joint-text models get no cross-attention terms.
  const auto hy = GetModelPreset("hunyuanvideo").value();
  const CostModel h = AnalyticalCost(hy);
  EXPECT_NEAR(h.c1, 3 * 60 * 2 * (4.0 * 3072 * 3072 + 2.0 * 3072 * 12288) / (0.45 * 989e12),
              1e-12 * h.c1);
}

TEST(CostModel, AnalyticalMemory) {
  const auto wan = GetModelPreset("wan2.1-14b").value();
  const MemoryModel m = AnalyticalMemory(wan);
  EXPECT_DOUBLE_EQ(m.m0, 14e9 * 16 / 8 + 4.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(m.m1, (2 * 40 + 34) * 5120.0);
  // Fits a few 480p clips on an H200.
  const int64_t tokens = m.MaxTokens(140.0 * (1ull << 30), 0.1);
  EXPECT_GT(tokens, 3 * 32760);
  EXPECT_LT(tokens, 10 * 32760);
  MemoryAssumptions a;
  a.shard_ranks = 1;
  a.activation_checkpointing = false;
  const MemoryModel u = AnalyticalMemory(wan, a);
  EXPECT_DOUBLE_EQ(u.m0, 14e9 * 16 + 4.0 * (1ull << 30));
  EXPECT_DOUBLE_EQ(u.m1, 34 * 40 * 5120.0);
  EXPECT_EQ(u.MaxTokens(140.0 * (1ull << 30), 0.1), 0);  // unsharded 14B does not fit
}

class CostJsonTest : public ::testing::Test {
 protected:
  // Each call writes a new file of the test's directory; all are removed with it.
  std::string Write(const std::string& text) {
    return dir_.Write("ds_cost_" + std::to_string(files_++) + ".json", text);
  }
  ditscale::testing::TempDir dir_{"ds_cost_"};
  int files_ = 0;
};

TEST_F(CostJsonTest, RoundTripIsExactOnRandomValues) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int i = 0; i < 20; ++i) {
    CostModel c;
    c.kind = i % 2 ? CostModel::Kind::kPower : CostModel::Kind::kQuadratic;
    c.a = u(rng);
    c.a_mb = i % 3 ? u(rng) * 0.1 : 0.0;
    c.b = u(rng) * 1e-9 + 1e-12;
    c.p = 1 + u(rng);
    c.c1 = u(rng) * 1e-5 + 1e-9;
    c.c2 = u(rng) * 1e-10;
    MemoryModel m{u(rng) * 1e11, u(rng) * 1e6 + 1};
    auto p = Write(CostModelToJson(c, &m));
    MemoryModel back_m;
    auto back = LoadCostModel(p, &back_m);
    ASSERT_TRUE(back.ok()) << back.failure().ToString();
    EXPECT_EQ(back->kind, c.kind);
    EXPECT_EQ(back->a, c.a);
    EXPECT_EQ(back->a_mb, c.a_mb);
    EXPECT_EQ(back->b, c.b);
    EXPECT_EQ(back->p, c.p);
    EXPECT_EQ(back->c1, c.c1);
    EXPECT_EQ(back->c2, c.c2);
    EXPECT_EQ(back_m.m0, m.m0);
    EXPECT_EQ(back_m.m1, m.m1);
    EXPECT_EQ(back->source, "json:" + p);
  }
}

TEST_F(CostJsonTest, FilesWithoutAmbReadAsZero) {
  auto c = LoadCostModel(Write(R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5})"));
  ASSERT_TRUE(c.ok()) << c.failure().ToString();
  EXPECT_EQ(c->a_mb, 0);
  EXPECT_DOUBLE_EQ(c->StepTime(2, 100), 0.1 + 2e-9 * std::pow(100.0, 1.5));
  auto d =
      LoadCostModel(Write(R"({"kind": "power", "a": 0.1, "a_mb": 0.02, "b": 1e-9, "p": 1.5})"));
  ASSERT_TRUE(d.ok()) << d.failure().ToString();
  EXPECT_EQ(d->a_mb, 0.02);
}

TEST_F(CostJsonTest, ErrorsNameTheField) {
  struct Case {
    std::string json, field;
  };
  for (const Case& c : std::vector<Case>{
           {R"({"a": 0.1, "b": 1e-9, "p": 1.5})", "kind"},
           {R"({"kind": "cubic", "a": 0.1})", "kind"},
           {R"({"kind": "power", "a": 0.1, "p": 1.5})", "b"},
           {R"({"kind": "power", "a": 0.1, "b": "x", "p": 1.5})", "b"},
           {R"({"kind": "power", "a": -0.1, "b": 1e-9, "p": 1.5})", "a"},
           {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 9})", "p"},
           {R"({"kind": "quadratic", "a": 0.1, "c1": 1e-5})", "c2"},
           {R"({"kind": "quadratic", "a": 0.1, "c1": 0, "c2": 0})", "c1"},
           {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "bb": 1})", "bb"},
           {R"({"kind": "power", "a": 0.1, "a_mb": -0.01, "b": 1e-9, "p": 1.5})", "a_mb"},
           {R"({"kind": "power", "a": 0.1, "a_mb": "x", "b": 1e-9, "p": 1.5})", "a_mb"},
           {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "memory": {"m0": 1}})",
            "memory.m1"},
           {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "memory": 5})", "memory"},
       }) {
    auto p = Write(c.json);
    auto r = LoadCostModel(p);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.failure().file, p);
    EXPECT_EQ(r.failure().column, c.field) << c.json << " -> " << r.failure().ToString();
  }
  auto p = Write("{\n  \"kind\": \"power\",\n  \"a\": 0.1,,\n}");
  auto r = LoadCostModel(p);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().line, 3);
  EXPECT_FALSE(LoadCostModel("/nonexistent/cost.json").ok());
}

// Every number has a range named in the error; the strict JSON reader refuses duplicate keys
// and numbers beyond double.
TEST_F(CostJsonTest, RangesAndStrictJson) {
  struct Case {
    std::string json, field, expect;
  };
  for (
      const Case& c : std::vector<Case>{
          {R"({"kind": "power", "a": 1e300, "b": 1e-9, "p": 1.5})", "a",
           "a: 1e+300 is out of range [0, 1e+06]"},
          {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 0.2})", "p",
           "p: 0.2 is out of range [0.5, 4]"},
          {R"({"kind": "quadratic", "a": 0.1, "c1": 1e-5, "c2": 1e12})", "c2",
           "c2: 1000000000000.0 is out of range [0, 1e+06]"},
          {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "memory": {"m0": -5, "m1": 1}})",
           "memory.m0", "memory.m0: -5 is out of range [0, 1e+18]"},
          {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "memory": {"m0": 0, "m1": 1, "x": 1}})",
           "memory.x", "unknown field"},
          {R"({"kind": "power", "a": 0.1, "b": 1e-9, "p": 1.5, "source": 5})", "source",
           "expected a string"},
      }) {
    auto p = Write(c.json);
    auto r = LoadCostModel(p);
    ASSERT_FALSE(r.ok()) << c.json;
    EXPECT_EQ(r.failure().column, c.field) << r.failure().ToString();
    EXPECT_NE(r.failure().message.find(c.expect), std::string::npos) << r.failure().ToString();
  }
  for (const std::string json : {R"({"kind": "power", "a": 0.1, "a": 0.2, "b": 1e-9, "p": 1.5})",
                                 R"({"kind": "power", "a": 0.1, "b": 1e400, "p": 1.5})"}) {
    auto p = Write(json);
    auto r = LoadCostModel(p);
    ASSERT_FALSE(r.ok()) << json;
    EXPECT_NE(r.failure().ToString().find(p), std::string::npos) << r.failure().ToString();
  }
  auto r = LoadCostModel(std::filesystem::temp_directory_path().string());
  EXPECT_FALSE(r.ok());
}

TEST(CostModel, MaxTokensOfNaNIsZero) {
  MemoryModel m{20e9, 1e5};
  EXPECT_EQ(m.MaxTokens(std::nan(""), 0.1), 0);
  EXPECT_EQ(m.MaxTokens(140e9, std::nan("")), 0);
}

}  // namespace
}  // namespace ditscale::balance
