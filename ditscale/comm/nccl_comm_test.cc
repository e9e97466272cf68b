// CPU tests of the NCCL transport: argument checks and clean failures without NCCL or a GPU.
// (Data movement is tested on GPUs by tests/gpu/comm_gpu_test.cu.)
#include "ditscale/comm/nccl_comm.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace ditscale::comm {
namespace {

// `text` contains `part` (gtest without gmock).
#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

TEST(CommArgs, RankArgs) {
  EXPECT_EQ(internal::CheckRankArgs("X", 2, 1, 0), "");
  EXPECT_HAS(internal::CheckRankArgs("X", 0, 0, 0), "X: nranks must be >= 1, got 0");
  EXPECT_HAS(internal::CheckRankArgs("X", 2, 2, 0), "rank 2 is out of range for nranks 2");
  EXPECT_HAS(internal::CheckRankArgs("X", 2, -1, 0), "rank -1 is out of range for nranks 2");
  EXPECT_HAS(internal::CheckRankArgs("X", 2, 0, -3), "device must be >= 0, got -3");
}

TEST(CommArgs, PeerAndBytes) {
  EXPECT_EQ(internal::CheckPeer("send", 0, 4, 3), "");
  EXPECT_HAS(internal::CheckPeer("send", 1, 4, 4),
             "send on rank 1: peer 4 is out of range for 4 ranks");
  EXPECT_HAS(internal::CheckPeer("recv", 1, 4, -1), "peer -1 is out of range");
  int x = 0;
  EXPECT_EQ(internal::CheckBytes("send", 0, 1, 0, nullptr, "buf"), "");  // zero bytes: a no-op
  EXPECT_EQ(internal::CheckBytes("send", 0, 1, 4, &x, "buf"), "");
  EXPECT_HAS(internal::CheckBytes("send", 0, 1, 4, nullptr, "buf"),
             "send on rank 0 with peer 1: buf is null for 4 bytes");
  // A negative count converted to size_t is caught, not sent.
  const long long negative = -8;
  EXPECT_HAS(internal::CheckBytes("recv", 2, 3, static_cast<std::size_t>(negative), &x, "buf"),
             "negative count");
}

TEST(CommNccl, CreateRejectsBadArguments) {
  NcclId id;
  auto r = NcclComm::Create(id, 0, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "NcclComm::Create: nranks must be >= 1");
  r = NcclComm::Create(id, 2, 2, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "rank 2 is out of range for nranks 2");
  r = NcclComm::Create(id, 2, 0, -1);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "device must be >= 0");
  // A device that exists on no machine: fails cleanly with or without a GPU.
  r = NcclComm::Create(id, 2, 0, 1000, 1.0);
  ASSERT_FALSE(r.ok());
  EXPECT_FALSE(r.failure().message.empty());
  if (NcclAvailable()) {
    r = NcclComm::Create(id, 2, 0, 0, 10.0, 65);
    ASSERT_FALSE(r.ok());
    EXPECT_HAS(r.failure().message, "channels_per_net_peer must be in [0, 64], got 65");
    r = NcclComm::Create(id, 2, 0, 0, 0.0);
    ASSERT_FALSE(r.ok());
    EXPECT_HAS(r.failure().message, "timeout_s must be > 0");
  } else {
    EXPECT_HAS(r.failure().message, "built without NCCL");
  }
}

// Without a GPU, Create fails with a message (no crash, no hang); with one, a 1-rank communicator
// works and Send/Recv check their arguments.
TEST(CommNccl, CreateFailsCleanlyWithoutGpuOrWorksWithOne) {
  auto id = NcclNewId();
  if (!NcclAvailable()) {
    ASSERT_FALSE(id.ok());
    EXPECT_HAS(id.failure().message, "built without NCCL");
    return;
  }
  if (!id.ok()) {  // some NCCL builds need a network interface for the id
    EXPECT_HAS(id.failure().message, "ncclGetUniqueId");
    return;
  }
  auto r = NcclComm::Create(*id, 1, 0, 0, 20.0);
  if (!r.ok()) {
    EXPECT_HAS(r.failure().message, "rank 0 of 1");
    return;
  }
  NcclComm& c = **r;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_NE(c.raw(), nullptr);
  int x = 0;
  EXPECT_THROW(c.Send(&x, 4, 1, nullptr), Error);
  EXPECT_THROW(c.Recv(nullptr, 4, 0, nullptr), Error);
  c.Send(nullptr, 0, 0, nullptr);  // zero bytes: a no-op
  auto done = c.Synchronize(nullptr);
  EXPECT_TRUE(done.ok()) << done.failure().message;
}

}  // namespace
}  // namespace ditscale::comm
