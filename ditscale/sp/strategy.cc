// Strategy names (strategy.h).
#include "ditscale/sp/strategy.h"

#include <ostream>

#include "ditscale/core/error.h"

namespace ditscale::sp {

std::string_view StrategyName(Strategy s) {
  switch (s) {
    case Strategy::kUlysses:
      return "ulysses";
    case Strategy::kUlyssesOverlap:
      return "ulysses-overlap";
    case Strategy::kRing:
      return "ring";
    case Strategy::kUsp:
      return "usp";
    case Strategy::kSwiftFusionTas:
      return "swiftfusion-tas";
    case Strategy::kTorus:
      return "torus";
  }
  DS_FAIL("StrategyName: no strategy ", static_cast<int>(s));
}

const std::string& StrategyNameList() {
  static const std::string list = [] {
    std::string s;
    for (Strategy x : kAllStrategies) s += (s.empty() ? "" : ", ") + std::string(StrategyName(x));
    return s;
  }();
  return list;
}

Result<Strategy> ParseStrategy(std::string_view name) {
  for (Strategy s : kAllStrategies) {
    if (StrategyName(s) == name) return s;
  }
  return Failure::InvalidArgument("'" + std::string(name) + "' is not one of " + StrategyNameList(),
                                  "strategy");
}

std::ostream& operator<<(std::ostream& os, Strategy s) { return os << StrategyName(s); }

}  // namespace ditscale::sp
