// Strategy names: ParseStrategy and StrategyName are inverse over kAllStrategies, and an unknown
// name is refused naming the field, the value and every valid name.
#include "ditscale/sp/strategy.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

TEST(Strategy, NamesRoundTrip) {
  ASSERT_EQ(StrategyNames().size(), kAllStrategies.size());
  for (size_t i = 0; i < kAllStrategies.size(); ++i) {
    const Strategy s = kAllStrategies[i];
    EXPECT_EQ(StrategyName(s), StrategyNames()[i]);
    Result<Strategy> parsed = ParseStrategy(StrategyName(s));
    ASSERT_TRUE(parsed.ok()) << StrategyName(s);
    EXPECT_EQ(parsed.value(), s);
    std::ostringstream os;
    os << s;
    EXPECT_EQ(os.str(), StrategyName(s));
  }
  EXPECT_EQ(StrategyNameList(), "ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, torus");
}

TEST(Strategy, UnknownNamesAreRefusedWithTheValidNames) {
  for (const std::string bad : {"zigzag", "", "Ring", "ulysses ", "tas", "swiftfusion"}) {
    Result<Strategy> r = ParseStrategy(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.failure().column, "strategy");
    EXPECT_EQ(r.failure().message,
              "'" + bad +
                  "' is not one of ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, "
                  "torus");
  }
}

TEST(Strategy, NameOfANonStrategyThrows) {
  EXPECT_THROW(StrategyName(static_cast<Strategy>(6)), Error);
}

}  // namespace
}  // namespace ditscale::sp
