#include <gtest/gtest.h>

#include "ditscale/core/error.h"
#include "ditscale/core/result.h"

namespace ditscale {
namespace {

TEST(Error, CheckNamesFileLineExpressionAndValues) {
  int x = 3;
  try {
    DS_CHECK(x == 4, "x is ", x);
    FAIL() << "DS_CHECK did not throw";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("core_test.cc:"), std::string::npos) << what;
    EXPECT_NE(what.find("x == 4"), std::string::npos) << what;
    EXPECT_NE(what.find("x is 3"), std::string::npos) << what;
  }
}

TEST(Error, CheckPassesSilently) { EXPECT_NO_THROW(DS_CHECK(1 + 1 == 2)); }

TEST(Result, ValueAndFailure) {
  Result<int> ok = 5;
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 5);
  Result<int> bad = Failure{"frames must be positive", "m.csv", 7, "num_frames"};
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.failure().ToString(), "m.csv:7: column 'num_frames': frames must be positive");
  EXPECT_THROW((void)bad.value(), Error);
  EXPECT_THROW(std::move(bad).ValueOrThrow(), Error);
}

}  // namespace
}  // namespace ditscale
