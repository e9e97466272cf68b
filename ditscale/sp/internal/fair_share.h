// Max-min fair bandwidth sharing (progressive filling), used by the simulator for link sharing.
#pragma once

#include <array>
#include <vector>

namespace ditscale::sp::internal {

// capacity[r] > 0: capacity of resource r (bytes/s). flows[f]: the (up to two) resources flow f
// crosses; -1 = unused slot. Returns the max-min fair rate of every flow: rates are raised
// together until some resource is saturated; the flows crossing it are frozen at that rate; the
// rest continue. Every flow gets a rate > 0; a flow with no resource gets +infinity.
std::vector<double> MaxMinFairRates(const std::vector<double>& capacity,
                                    const std::vector<std::array<int, 2>>& flows);

}  // namespace ditscale::sp::internal
