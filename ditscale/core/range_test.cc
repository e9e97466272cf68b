#include "ditscale/core/range.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>

#include "ditscale/core/error.h"

namespace ditscale {
namespace {

TEST(RangeTest, InRangeIsNullopt) {
  EXPECT_FALSE(RangeError("--x", 0.5, 0.0, 1.0));
  EXPECT_FALSE(RangeError("--x", 3LL, 1LL, 3LL));
}

TEST(RangeTest, MessageNamesOptionValueAndRange) {
  EXPECT_EQ(*RangeError("--mem-safety", -0.5, 0.0, 0.99),
            "--mem-safety: -0.5 is out of range [0, 0.99]");
  EXPECT_EQ(*RangeError("--world-size", 0LL, 1LL, 1048576LL),
            "--world-size: 0 is out of range [1, 1048576]");
}

// A value just past a bound is written exactly, not rounded onto the bound it exceeds.
TEST(RangeTest, ValueJustPastABoundIsNotWrittenAsTheBound) {
  EXPECT_EQ(*RangeError("--noise", 1.0000001, 0.0, 1.0),
            "--noise: 1.0000001 is out of range [0, 1]");
  EXPECT_EQ(*RangeError("--x", -1e-9, 0.0, 1.0), "--x: -1e-09 is out of range [0, 1]");
  EXPECT_EQ(*RangeError("--x", 0.9900001, 0.0, 0.99), "--x: 0.9900001 is out of range [0, 0.99]");
}

TEST(RangeTest, NonFiniteIsNeverInRange) {
  EXPECT_EQ(*RangeError("fps", NAN, 0.0, DBL_MAX), "fps: nan is out of range [0, 1.79769e+308]");
  EXPECT_TRUE(RangeError("fps", INFINITY, 0.0, INFINITY));
}

TEST(RangeTest, CheckRangeThrows) {
  EXPECT_THROW(CheckRange("epoch", -1LL, 0LL, 100LL), Error);
  EXPECT_NO_THROW(CheckRange("epoch", 5LL, 0LL, 100LL));
}

}  // namespace
}  // namespace ditscale
