// GPU tests of the transports (need >= 2 GPUs; skip otherwise).
//
// NCCL: one thread per GPU in this process; send/recv of random bytes in both directions (in
// order, then grouped), all-to-all over every GPU (up to 8), bit-exact; and hang detection: a
// Recv whose Send never comes must fail within the 3 s timeout instead of hanging.
// NVSHMEM: one process per PE. The test forks two children that exec this binary again (so they
// start with a fresh CUDA state) in child mode; child 0 makes the unique id and pipes it to child
// 1; each initializes, puts a pattern with a signal to the other, waits, compares, runs a
// signal ping-pong and finalizes; the parent checks both exit codes.
//
// Run on the GPU machine with NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ditscale/comm/nccl_comm.h"
#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "gpu_test_util.h"

namespace ditscale::comm {
namespace {

int GpuCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// The bytes rank `src` sends to rank `dst` in test case `salt`: both sides can compute them.
std::vector<std::uint8_t> Pattern(int src, int dst, std::size_t bytes, int salt) {
  std::mt19937_64 rng(0x9E3779B97F4A7C15ull ^ (std::uint64_t(src) << 40) ^
                      (std::uint64_t(dst) << 20) ^ std::uint64_t(salt) ^ bytes);
  std::vector<std::uint8_t> v(bytes);
  for (auto& b : v) b = static_cast<std::uint8_t>(rng() >> 56);
  return v;
}

// Runs `body(comm, stream)` on one thread per rank (rank r on GPU r) and returns each rank's
// error ("" when fine). Exceptions (a failed DS_CHECK_CUDA, for one) become errors.
using RankBody = std::function<std::string(NcclComm&, cudaStream_t)>;
std::vector<std::string> RunRanks(int nranks, const RankBody& body) {
  std::vector<std::string> errors(nranks);
  auto id = NcclNewId();
  if (!id.ok()) {
    errors.assign(nranks, id.failure().message);
    return errors;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto comm = NcclComm::Create(*id, nranks, r, r, 60);
        if (!comm.ok()) {
          errors[r] = comm.failure().message;
          return;
        }
        const cuda::Stream s = cuda::Stream::Create(0);  // on GPU r: Create made it current
        errors[r] = body(**comm, s.get());
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

#define SKIP_WITHOUT_2_GPUS()                                                  \
  SKIP_WITHOUT_GPU();                                                          \
  if (GpuCount() < 2) GTEST_SKIP() << "needs >= 2 GPUs, found " << GpuCount(); \
  if (!NcclAvailable()) GTEST_SKIP() << "built without NCCL"

// `bytes` of device memory on the current device; throws when out of memory.
struct DevBuf {
  cuda::DeviceBuffer memory;
  void* p = nullptr;
  explicit DevBuf(std::size_t n)
      : memory(cuda::DeviceBuffer::Allocate(n).ValueOrThrow()), p(memory.data()) {}
  unsigned char* at(std::size_t off) const { return static_cast<unsigned char*>(p) + off; }
};

std::string Compare(const void* dev, const std::vector<std::uint8_t>& want, const char* what) {
  std::vector<std::uint8_t> got(want.size());
  DS_CHECK_CUDA(cudaMemcpy(got.data(), dev, got.size(), cudaMemcpyDeviceToHost));
  for (std::size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i]) {
      return std::string(what) + ": first difference at byte " + std::to_string(i) + " of " +
             std::to_string(want.size());
    }
  }
  return "";
}

TEST(CommNcclGpu, SendRecvBothDirectionsInOrderAndGrouped) {
  SKIP_WITHOUT_2_GPUS();
  const std::vector<std::size_t> sizes = {1, 4099, (std::size_t(1) << 20) + 7};
  auto errors = RunRanks(2, [&](NcclComm& c, cudaStream_t s) -> std::string {
    const int me = c.rank(), peer = 1 - me;
    for (std::size_t bytes : sizes) {
      for (int grouped = 0; grouped < 2; ++grouped) {
        const int salt = grouped;
        auto out = Pattern(me, peer, bytes, salt);
        DevBuf send(bytes), recv(bytes);
        DS_CHECK_CUDA(cudaMemcpy(send.p, out.data(), bytes, cudaMemcpyHostToDevice));
        DS_CHECK_CUDA(cudaMemset(recv.p, 0, bytes));
        if (grouped) {
          c.GroupStart();
          c.Send(send.p, bytes, peer, s);
          c.Recv(recv.p, bytes, peer, s);
          c.GroupEnd();
        } else if (me == 0) {  // rank 0 sends first, rank 1 receives first: no deadlock
          c.Send(send.p, bytes, peer, s);
          c.Recv(recv.p, bytes, peer, s);
        } else {
          c.Recv(recv.p, bytes, peer, s);
          c.Send(send.p, bytes, peer, s);
        }
        auto done = c.Synchronize(s);
        if (!done.ok()) return done.failure().message;
        std::string what = "rank " + std::to_string(me) + (grouped ? " grouped " : " in order ") +
                           std::to_string(bytes) + " B";
        std::string err = Compare(recv.p, Pattern(peer, me, bytes, salt), what.c_str());
        if (!err.empty()) return err;
      }
    }
    return "";
  });
  for (std::size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(CommNcclGpu, AllToAllAllGpus) {
  SKIP_WITHOUT_2_GPUS();
  const int n = std::min(GpuCount(), 8);
  const std::size_t block = 65536 + 3;
  auto errors = RunRanks(n, [&](NcclComm& c, cudaStream_t s) -> std::string {
    const int me = c.rank();
    DevBuf send(block * n), recv(block * n);
    for (int j = 0; j < n; ++j) {
      auto out = Pattern(me, j, block, 7);
      DS_CHECK_CUDA(cudaMemcpy(send.at(j * block), out.data(), block, cudaMemcpyHostToDevice));
    }
    DS_CHECK_CUDA(cudaMemset(recv.p, 0, block * n));
    c.AllToAll(send.p, recv.p, block, s);
    auto done = c.Synchronize(s);
    if (!done.ok()) return done.failure().message;
    for (int i = 0; i < n; ++i) {
      std::string what = "rank " + std::to_string(me) + " block from " + std::to_string(i);
      std::string err = Compare(recv.at(i * block), Pattern(i, me, block, 7), what.c_str());
      if (!err.empty()) return err;
    }
    return "";
  });
  for (std::size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// Both ranks receive from each other and nobody sends: each must report a timeout naming the
// pending receive within the 3 s limit (plus slack), not hang.
TEST(CommNcclGpu, RecvWithoutSendTimesOut) {
  SKIP_WITHOUT_2_GPUS();
  const double timeout_s = 3;
  std::vector<double> elapsed(2, 0);
  auto errors = RunRanks(2, [&](NcclComm& c, cudaStream_t s) -> std::string {
    DevBuf buf(4096);
    c.set_timeout_s(timeout_s);
    const auto t0 = std::chrono::steady_clock::now();
    c.Recv(buf.p, 4096, 1 - c.rank(), s);
    auto done = c.Synchronize(s);
    elapsed[c.rank()] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (done.ok()) return "Synchronize succeeded without a matching Send";
    if (c.ok()) return "communicator not marked failed";
    return "FAILED: " + done.failure().message;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("FAILED: NCCL rank " + std::to_string(r) + " of 2"), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("timed out"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("recv 4096 B from peer " + std::to_string(1 - r)), std::string::npos)
        << errors[r];
    EXPECT_LT(elapsed[r], timeout_s + 5) << "rank " << r;
    std::printf("rank %d failed after %.2f s: %s\n", r, elapsed[r], errors[r].c_str());
  }
}

// ---- NVSHMEM: child processes ----

constexpr const char* kChildEnv = "DITSCALE_COMM_TEST_NVSHMEM_RANK";
constexpr const char* kFdEnv = "DITSCALE_COMM_TEST_NVSHMEM_FD";

int ChildFail(int rank, const std::string& msg) {
  std::fprintf(stderr, "nvshmem child %d: %s\n", rank, msg.c_str());
  return 1;
}

int NvshmemChild(int rank, int fd) {
  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
  const int peer = 1 - rank;
  NvshmemId id;
  if (rank == 0) {
    auto made = NvshmemNewId();
    if (!made.ok()) return ChildFail(rank, made.failure().message);
    id = *made;
    if (write(fd, id.bytes.data(), id.bytes.size()) != static_cast<ssize_t>(id.bytes.size())) {
      return ChildFail(rank, "writing the unique id to the pipe failed");
    }
  } else {
    std::size_t got = 0;
    while (got < id.bytes.size()) {
      ssize_t n = read(fd, id.bytes.data() + got, id.bytes.size() - got);
      if (n <= 0) return ChildFail(rank, "reading the unique id from the pipe failed");
      got += static_cast<std::size_t>(n);
    }
  }
  close(fd);
  auto init = Nvshmem::Init(id, 2, rank, rank);
  if (!init.ok()) return ChildFail(rank, init.failure().message);
  Nvshmem& sh = **init;
  auto again = Nvshmem::Init(id, 2, rank, rank);
  if (again.ok() || again.failure().message.find("already initialized") == std::string::npos) {
    return ChildFail(rank, "a second Init did not fail with 'already initialized'");
  }
  // CUDA errors throw; main() reports them through ChildFail.
  const cuda::Stream stream = cuda::Stream::Create(0);
  cudaStream_t s = stream.get();
  const std::size_t bytes = (std::size_t(1) << 20) + 5;
  auto* buf = static_cast<unsigned char*>(sh.Malloc(bytes));
  auto* sig = static_cast<std::uint64_t*>(sh.Malloc(2 * sizeof(std::uint64_t)));
  std::uint64_t sig_host[2] = {1, 1};
  DS_CHECK_CUDA(cudaMemcpy(sig_host, sig, sizeof(sig_host), cudaMemcpyDeviceToHost));
  if (sig_host[0] != 0 || sig_host[1] != 0) return ChildFail(rank, "Malloc did not zero");
  DevBuf src(bytes);
  auto out = Pattern(rank, peer, bytes, 11);
  DS_CHECK_CUDA(cudaMemcpy(src.p, out.data(), bytes, cudaMemcpyHostToDevice));

  // A non-symmetric destination is refused before NVSHMEM sees it.
  try {
    sh.PutSignal(src.p, src.p, 16, sig, 1, peer, s);
    return ChildFail(rank, "PutSignal to a non-symmetric dst did not throw");
  } catch (const Error& e) {
    if (std::string(e.what()).find("not a symmetric address") == std::string::npos) {
      return ChildFail(rank, std::string("unexpected error: ") + e.what());
    }
  }

  // Put with signal to the peer, wait for the peer's put into our buffer, compare.
  sh.PutSignal(buf, src.p, bytes, &sig[0], 1, peer, s);
  sh.WaitGE(&sig[0], 1, s);
  auto done = sh.Synchronize(s, 20);
  if (!done.ok()) return ChildFail(rank, done.failure().message);
  std::string err = Compare(buf, Pattern(peer, rank, bytes, 11), "put_signal payload");
  if (!err.empty()) return ChildFail(rank, err);

  // Ping-pong on sig[1]: rank 0 signals first; odd rounds use a zero-byte PutSignal.
  const int rounds = 50;
  for (int i = 1; i <= rounds; ++i) {
    auto ping = [&] {
      if (i % 2) {
        sh.PutSignal(buf, src.p, 0, &sig[1], 1, peer, s);
      } else {
        sh.Signal(&sig[1], 1, peer, s);
      }
    };
    if (rank == 0) {
      ping();
      sh.WaitGE(&sig[1], i, s);
    } else {
      sh.WaitGE(&sig[1], i, s);
      ping();
    }
  }
  sh.Quiet(s);
  sh.BarrierAll(s);
  auto drained = sh.Synchronize(s, 20);
  if (!drained.ok()) return ChildFail(rank, drained.failure().message);
  DS_CHECK_CUDA(cudaMemcpy(sig_host, sig, sizeof(sig_host), cudaMemcpyDeviceToHost));
  if (sig_host[0] != 1 || sig_host[1] != static_cast<std::uint64_t>(rounds)) {
    return ChildFail(rank, "signals are " + std::to_string(sig_host[0]) + ", " +
                               std::to_string(sig_host[1]) + "; expected 1, " +
                               std::to_string(rounds));
  }
  sh.Free(sig);
  sh.Free(buf);
  init.value().reset();  // nvshmem finalize (collective)
  std::printf("nvshmem child %d: ok\n", rank);
  return 0;
}

TEST(CommNvshmemGpu, TwoProcessesPutSignalWaitPingPong) {
  SKIP_WITHOUT_GPU();
  if (GpuCount() < 2) GTEST_SKIP() << "needs >= 2 GPUs, found " << GpuCount();
  if (!NvshmemAvailable()) GTEST_SKIP() << NvshmemUnavailableReason();
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t pids[2] = {-1, -1};
  for (int r = 0; r < 2; ++r) {
    pid_t pid = fork();
    ASSERT_GE(pid, 0) << "fork failed";
    if (pid == 0) {
      // exec again: a forked child must not reuse the parent's CUDA state.
      const int fd = r == 0 ? fds[1] : fds[0];
      close(r == 0 ? fds[0] : fds[1]);
      setenv(kChildEnv, std::to_string(r).c_str(), 1);
      setenv(kFdEnv, std::to_string(fd).c_str(), 1);
      char self[] = "/proc/self/exe";
      char* args[] = {self, nullptr};
      execv(self, args);
      _exit(127);
    }
    pids[r] = pid;
  }
  close(fds[0]);
  close(fds[1]);
  int status[2] = {-1, -1};
  bool done[2] = {false, false};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!(done[0] && done[1])) {
    for (int r = 0; r < 2; ++r) {
      if (!done[r] && waitpid(pids[r], &status[r], WNOHANG) == pids[r]) done[r] = true;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < 2; ++r) {
        if (!done[r]) {
          kill(pids[r], SIGKILL);
          waitpid(pids[r], &status[r], 0);
          done[r] = true;
          ADD_FAILURE() << "nvshmem child " << r << " timed out after 60 s (killed)";
        }
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(WIFEXITED(status[r])) << "child " << r << " died (status " << status[r] << ")";
    EXPECT_EQ(WEXITSTATUS(status[r]), 0) << "child " << r << " failed (see its stderr)";
  }
}

}  // namespace
}  // namespace ditscale::comm

int main(int argc, char** argv) {
  if (const char* rank = std::getenv(ditscale::comm::kChildEnv)) {
    const char* fd = std::getenv(ditscale::comm::kFdEnv);
    if (fd == nullptr) return 2;
    try {
      return ditscale::comm::NvshmemChild(std::atoi(rank), std::atoi(fd));
    } catch (const std::exception& e) {
      return ditscale::comm::ChildFail(std::atoi(rank), e.what());
    }
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
