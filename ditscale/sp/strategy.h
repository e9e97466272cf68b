// The sequence-parallel strategies as one enum (algorithms: strategies.h). Names are parsed only
// at the edges (CLI, Python bindings, the torch ops' configuration dict) by ParseStrategy and
// printed only through StrategyName; inside the library a strategy is a Strategy.
//
// Names (the order of kAllStrategies, of StrategyNames() and of the planner's enumeration):
//   ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, torus.
#pragma once

#include <array>
#include <iosfwd>
#include <string>
#include <string_view>

#include "ditscale/core/result.h"

namespace ditscale::sp {

enum class Strategy {
  kUlysses,         // "ulysses": U = N, R = 1 (head chunks: SpConfig::ulysses_chunks)
  kUlyssesOverlap,  // "ulysses-overlap": ulysses with its all-to-alls under the attention
  kRing,            // "ring": U = 1, R = N
  kUsp,             // "usp": Ulysses within machines, Ring across
  kSwiftFusionTas,  // "swiftfusion-tas": Ulysses across machines, Ring within
  kTorus,           // "torus": tas, pipelined in token chunks (SpConfig::torus_chunks)
};

inline constexpr std::array<Strategy, 6> kAllStrategies = {
    Strategy::kUlysses, Strategy::kUlyssesOverlap, Strategy::kRing,
    Strategy::kUsp,     Strategy::kSwiftFusionTas, Strategy::kTorus};

// The canonical name, e.g. "swiftfusion-tas".
std::string_view StrategyName(Strategy s);

// The strategy of a canonical name (exact, case-sensitive). Failure (field "strategy"):
// "'zigzag' is not one of ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, torus".
Result<Strategy> ParseStrategy(std::string_view name);

// "ulysses, ulysses-overlap, ring, usp, swiftfusion-tas, torus".
const std::string& StrategyNameList();

// Prints StrategyName(s).
std::ostream& operator<<(std::ostream& os, Strategy s);

}  // namespace ditscale::sp
