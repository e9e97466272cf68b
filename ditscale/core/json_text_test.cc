#include "ditscale/core/json_text.h"

#include <gtest/gtest.h>

namespace ditscale {
namespace {

std::string Err(std::string_view text, long long first_line = 1) {
  auto r = ParseJson(text, "f.json", first_line);
  return r.ok() ? "" : r.failure().ToString();
}

TEST(JsonTextTest, ParsesNestedObjectsWithSameKeysInDifferentObjects) {
  auto r = ParseJson(R"({"a":{"k":1},"b":{"k":2},"c":[{"k":3},{"k":4}]})", "f.json");
  ASSERT_TRUE(r.ok()) << r.failure().ToString();
  EXPECT_EQ((*r)["c"][1]["k"], 4);
}

TEST(JsonTextTest, DuplicateKeyIsRefused) {
  EXPECT_EQ(Err(R"({"fps":1,"fps":2})"), "f.json:1: duplicate key 'fps'");
  EXPECT_EQ(Err(R"([{"b":{"c":1,"c":2}}])"), "f.json:1: duplicate key 'c'");
}

TEST(JsonTextTest, NumberBeyondDoubleNamesTheFile) {
  EXPECT_EQ(Err(R"({"x":1e400})"), "f.json:1: JSON value error: number overflow parsing '1e400'");
}

TEST(JsonTextTest, ValueProblemsGiveTheirLine) {
  EXPECT_EQ(Err("{\n\"a\": {\"k\": 1},\n\"b\": \"x,\\\"k\\\"\",\n\"a\": 2}"),
            "f.json:4: duplicate key 'a'");
  EXPECT_EQ(Err("{\"a\": [1, -2.5e3,\n 3],\n\"x\": 1e400}", 10),
            "f.json:12: JSON value error: number overflow parsing '1e400'");
}

TEST(JsonTextTest, SyntaxErrorGivesTheLine) {
  EXPECT_EQ(Err("{\n\"x\": 1,\n}", 1).rfind("f.json:3: JSON syntax error", 0), 0u);
  EXPECT_EQ(Err("{\"x\": }", 41).rfind("f.json:41: JSON syntax error", 0), 0u);
}

TEST(JsonTextTest, ReadJsonFileRefusesDirectoriesAndMissingFiles) {
  EXPECT_EQ(ReadJsonFile("/").failure().ToString(), "/: not a regular file");
  EXPECT_EQ(ReadJsonFile("/nonexistent/x.json").failure().ToString(),
            "/nonexistent/x.json: cannot open the file");
}

}  // namespace
}  // namespace ditscale
