// CPU tests of the NVSHMEM transport: availability, argument checks and clean failures without
// a GPU. (Puts and signals between processes are tested by tests/gpu/comm_gpu_test.cu.)
#include "ditscale/comm/nvshmem_comm.h"

#include <gtest/gtest.h>

#include <string>

namespace ditscale::comm {
namespace {

// `text` contains `part` (gtest without gmock).
#define EXPECT_HAS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "in: " << (text)

TEST(CommNvshmem, AvailabilityAndReasonAgree) {
  EXPECT_EQ(NvshmemAvailable(), NvshmemUnavailableReason().empty());
  if (!NvshmemAvailable()) {
    EXPECT_HAS(NvshmemUnavailableReason(), "nvidia-nvshmem-cu13");
    auto id = NvshmemNewId();
    ASSERT_FALSE(id.ok());
    EXPECT_EQ(id.failure().message, NvshmemUnavailableReason());
  }
}

TEST(CommNvshmem, InitRejectsBadArguments) {
  NvshmemId id;
  auto r = Nvshmem::Init(id, 0, 0, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "Nvshmem::Init: nranks must be >= 1");
  r = Nvshmem::Init(id, 2, 5, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "rank 5 is out of range for nranks 2");
  r = Nvshmem::Init(id, 2, 0, -2);
  ASSERT_FALSE(r.ok());
  EXPECT_HAS(r.failure().message, "device must be >= 0");
  r = Nvshmem::Init(id, 2, 0, 1000);  // no machine has it: fails before any bootstrap
  ASSERT_FALSE(r.ok());
  EXPECT_FALSE(r.failure().message.empty());
}

// The unique id comes from the bootstrap plugin (nvshmem_bootstrap_uid.so.3), so this also checks
// that the plugin is found next to libnvshmem_host.so.3. Init without a GPU fails cleanly; with
// one, a 1-PE job initializes, allocates zeroed symmetric memory and refuses a second Init.
TEST(CommNvshmem, NewIdAndInitFailCleanlyWithoutGpuOrWorkWithOne) {
  if (!NvshmemAvailable()) GTEST_SKIP() << NvshmemUnavailableReason();
  auto id = NvshmemNewId();
  ASSERT_TRUE(id.ok()) << id.failure().message;
  auto r = Nvshmem::Init(*id, 1, 0, 0);
  if (!r.ok()) {
    EXPECT_HAS(r.failure().message, "Nvshmem::Init: rank 0 of 1");
    return;
  }
  Nvshmem& sh = **r;
  EXPECT_EQ(sh.rank(), 0);
  EXPECT_EQ(sh.size(), 1);
  auto again = Nvshmem::Init(*id, 1, 0, 0);
  ASSERT_FALSE(again.ok());
  EXPECT_HAS(again.failure().message, "already initialized");
  void* p = sh.Malloc(64);
  ASSERT_NE(p, nullptr);
  int local = 0;
  EXPECT_THROW(sh.Signal(reinterpret_cast<std::uint64_t*>(&local), 1, 0, nullptr), Error);
  EXPECT_THROW(sh.Signal(static_cast<std::uint64_t*>(p), 1, 1, nullptr), Error);  // PE 1 of 1
  sh.Free(p);
}

}  // namespace
}  // namespace ditscale::comm
