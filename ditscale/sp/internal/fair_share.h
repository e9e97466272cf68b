// Max-min fair bandwidth sharing (progressive filling), used by the simulator for link sharing.
#pragma once

#include <array>
#include <vector>

namespace ditscale::sp::internal {

// The resources one flow crosses (up to four: e.g. a NIC's egress, the peer NIC's ingress and
// both NICs' duplex limits); -1 = unused slot.
using FlowResources = std::array<int, 6>;

// capacity[r] > 0: capacity of resource r (bytes/s). flows[f]: the resources flow f crosses.
// Returns the max-min fair rate of every flow: rates are raised together until some resource is
// saturated; the flows crossing it are frozen at that rate; the rest continue. Every flow gets a
// rate > 0; a flow with no resource gets +infinity.
// (Spell all four slots: a braced {a, b} would pad with resource 0, not -1.)
std::vector<double> MaxMinFairRatesWide(const std::vector<double>& capacity,
                                        const std::vector<FlowResources>& flows);
// The same for flows of at most two resources.
std::vector<double> MaxMinFairRates(const std::vector<double>& capacity,
                                    const std::vector<std::array<int, 2>>& flows);

}  // namespace ditscale::sp::internal
