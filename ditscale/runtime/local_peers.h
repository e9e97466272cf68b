// Ranks of one process as one-sided peers (comm::PeerArena): every rank's allocation is plain
// cudaMalloc memory on that rank's device, and a rank reaches its peers' copies by address
// (same device, or peer access enabled between the devices). With it the GPU executor runs every
// rank of a one-sided schedule in one process through its copy-engine engine: the real executor,
// puts, signals and waits, on one GPU (tests, tools/gpu_check.sh on a one-GPU lease).
#pragma once

#include <memory>
#include <vector>

#include "ditscale/comm/peer_arena.h"

namespace ditscale::runtime {

// One PeerArena per rank; rank r lives on devices[r]. Allocation is not a cross-thread
// collective here: rank r's k-th Allocate pairs with every other rank's k-th, and PeerAddress of
// an allocation some rank has not made yet throws. Ranks on different devices without peer access
// between them are unreachable (PeerAddress returns null).
std::vector<std::unique_ptr<comm::PeerArena>> MakeLocalPeers(const std::vector<int>& devices);

}  // namespace ditscale::runtime
