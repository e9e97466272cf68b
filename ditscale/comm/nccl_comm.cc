#include "ditscale/comm/nccl_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <utility>

#include "ditscale/core/error.h"

#if DITSCALE_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#endif

namespace ditscale::comm {

using ::ditscale::internal::StrCat;

#if DITSCALE_HAVE_NCCL

static_assert(sizeof(ncclUniqueId) == kUniqueIdBytes, "NcclId must hold an ncclUniqueId");

namespace {

constexpr std::size_t kMaxPendingKept = 16;

using Clock = std::chrono::steady_clock;

std::string NcclText(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && last[0] != '\0') s += StrCat(" (", last, ")");
  return s;
}

// Polls with a short sleep that grows to 1 ms: quick for fast ops, cheap for long waits.
class Backoff {
 public:
  void Wait() {
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    us_ = std::min(us_ * 2, 1000);
  }

 private:
  int us_ = 20;
};

}  // namespace

bool NcclAvailable() { return true; }

Result<NcclId> NcclNewId() {
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) {
    return Failure::BackendError(StrCat("ncclGetUniqueId failed: ", NcclText(r, nullptr)));
  }
  NcclId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

NcclComm::NcclComm(int rank, int size, int device, double timeout_s)
    : rank_(rank), size_(size), device_(device), timeout_s_(timeout_s) {}

Result<std::unique_ptr<NcclComm>> NcclComm::Create(const NcclId& id, int nranks, int rank,
                                                   int device, double timeout_s,
                                                   int channels_per_net_peer) {
  std::string bad = internal::CheckRankArgs("NcclComm::Create", nranks, rank, device);
  if (!bad.empty()) return Failure::InvalidArgument(bad);
  if (!(timeout_s > 0)) {
    return Failure::InvalidArgument(
        StrCat("NcclComm::Create: rank ", rank, ": timeout_s must be > 0, got ", timeout_s));
  }
  if (channels_per_net_peer < 0 || channels_per_net_peer > 64) {
    return Failure::InvalidArgument(StrCat("NcclComm::Create: rank ", rank,
                                           ": channels_per_net_peer must be in [0, 64], got ",
                                           channels_per_net_peer));
  }
  int ndev = 0;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    return Failure::Unavailable(StrCat("NcclComm::Create: rank ", rank, " of ", nranks,
                                       ": cudaGetDeviceCount failed: ", CudaErrorText(ce),
                                       " (no usable GPU?)"));
  }
  if (device >= ndev) {
    return Failure::InvalidArgument(StrCat("NcclComm::Create: rank ", rank, " of ", nranks,
                                           ": device ", device, " does not exist (", ndev,
                                           " CUDA devices)"));
  }
  ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    return Failure::BackendError(StrCat("NcclComm::Create: rank ", rank, " of ", nranks,
                                        ": cudaSetDevice(", device,
                                        ") failed: ", CudaErrorText(ce)));
  }
  // One process has one libnccl.so.2 (often torch's, loaded first). Structs such as
  // ncclConfig_t change between versions, so headers and the loaded library must agree.
  int loaded = 0;
  if (ncclGetVersion(&loaded) == ncclSuccess && loaded / 100 != NCCL_VERSION_CODE / 100) {
    return Failure::Unavailable(
        StrCat("NCCL rank ", rank, ": ditscale was compiled against NCCL ", NCCL_VERSION_CODE,
               " but this process runs NCCL ", loaded,
               " (the libnccl.so.2 loaded first, e.g. torch's); rebuild ditscale against it "
               "(NCCL_HOME, or the nvidia-nccl-cu13 wheel that torch uses)"));
  }
  ncclUniqueId uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns at once, so that a missing peer cannot hang us
  // Kernels of single CTAs, not NCCL's clusters of 4 on Hopper: a cluster must fit in one GPU
  // processing cluster, and the few SMs the GPU executor leaves outside a compute partition
  // (SpConfig::comm_sms) held none (the send/recv then waited for the attention call;
  // lab/results/sp-smpart_h200_2026-12/).
  config.cgaClusterSize = 1;
  if (channels_per_net_peer > 0) {
#if NCCL_VERSION_CODE >= 22800
    config.nChannelsPerNetPeer = channels_per_net_peer;
#else
    return Failure::Unavailable(StrCat("NcclComm::Create: rank ", rank,
                                       ": channels_per_net_peer needs NCCL >= 2.28 (built with ",
                                       NCCL_VERSION_CODE, ")"));
#endif
  }
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, nranks, uid, rank, &config);
  std::unique_ptr<NcclComm> c(new NcclComm(rank, nranks, device, timeout_s));
  c->comm_ = comm;
  std::string what = StrCat("ncclCommInitRankConfig (waiting for all ", nranks,
                            " ranks to join with the same id)");
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm == nullptr) {
      c->failed_ = true;
      return Failure::BackendError(
          StrCat("NCCL rank ", rank, " of ", nranks, " (device ", device,
                 "): ncclCommInitRankConfig failed: ", NcclText(r, nullptr)));
    }
    return c->Fail(StrCat(what, " failed: ", NcclText(r, comm)));
  }
  if (!c->WaitReady(what)) return Failure::BackendError(c->failure_);
  return c;
}

NcclComm::~NcclComm() {
  if (comm_ == nullptr) return;
  auto comm = static_cast<ncclComm_t>(comm_);
  cuda::DeviceGuard guard(device_, std::nothrow);
  if (failed_) {
    ncclCommAbort(comm);
    return;
  }
  // Finalize flushes outstanding work (non-blocking: poll), then Destroy frees the resources; a
  // peer that never completes its side must not hang the destructor, so abort after timeout_s.
  ncclResult_t r = ncclCommFinalize(comm);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  Backoff backoff;
  while (r == ncclInProgress && Clock::now() < deadline) {
    backoff.Wait();
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
  }
  if (r == ncclSuccess) {
    r = ncclCommDestroy(comm);
    if (r == ncclSuccess || r == ncclInProgress) return;
  }
  std::fprintf(stderr,
               "ditscale: NCCL rank %d of %d: communicator finalize failed or timed out (%s); "
               "aborting it\n",
               rank_, size_, ncclGetErrorString(r));
  ncclCommAbort(comm);
}

void NcclComm::set_timeout_s(double timeout_s) {
  DS_CHECK(timeout_s > 0, "NCCL rank ", rank_, ": timeout_s must be > 0, got ", timeout_s);
  timeout_s_ = timeout_s;
}

void NcclComm::NotePending(std::string op) {
  if (pending_.size() < kMaxPendingKept) {
    pending_.push_back(std::move(op));
  } else {
    ++pending_dropped_;
  }
}

Failure NcclComm::Fail(const std::string& what) {
  if (!failed_) {
    std::string pending;
    for (const auto& p : pending_) pending += (pending.empty() ? "" : ", ") + p;
    if (pending_dropped_ > 0) pending += StrCat(" and ", pending_dropped_, " more");
    failure_ = StrCat("NCCL rank ", rank_, " of ", size_, " (device ", device_, "): ", what,
                      "; pending since the last Synchronize: [", pending.empty() ? "none" : pending,
                      "]; the communicator was aborted (create a new one)");
    failed_ = true;
    if (comm_ != nullptr) {
      cuda::DeviceGuard guard(device_, std::nothrow);
      ncclResult_t r = ncclCommAbort(static_cast<ncclComm_t>(comm_));
      if (r != ncclSuccess) failure_ += StrCat("; ncclCommAbort: ", ncclGetErrorString(r));
      comm_ = nullptr;
    }
  }
  return Failure::BackendError(failure_);
}

bool NcclComm::WaitReady(const std::string& what) {
  auto comm = static_cast<ncclComm_t>(comm_);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s_);
  Backoff backoff;
  while (true) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) {
      Fail(StrCat(what, ": ncclCommGetAsyncError failed: ", NcclText(r, comm)));
      return false;
    }
    if (state == ncclSuccess) return true;
    if (state != ncclInProgress) {
      Fail(StrCat(what, ": ", NcclText(state, comm)));
      return false;
    }
    if (Clock::now() >= deadline) {
      Fail(StrCat(what, ": timed out after ", timeout_s_,
                  " s (a peer that never joined or never posted its matching operation?)"));
      return false;
    }
    backoff.Wait();
  }
}

void NcclComm::AfterCall(int result, const std::string& what) {
  auto r = static_cast<ncclResult_t>(result);
  if (r != ncclSuccess && r != ncclInProgress) {
    Fail(StrCat(what, " failed: ", NcclText(r, static_cast<ncclComm_t>(comm_))));
    return;
  }
  // Outside a group the op must be on the stream before we return, so that events recorded on
  // the stream afterwards cover it.
  if (group_depth_ == 0) WaitReady(what);
}

void NcclComm::GroupStart() {
  ncclResult_t r = ncclGroupStart();
  if (r != ncclSuccess) {
    if (!failed_) Fail(StrCat("ncclGroupStart failed: ", ncclGetErrorString(r)));
    return;
  }
  ++group_depth_;
}

void NcclComm::GroupEnd() {
  DS_CHECK(group_depth_ > 0, "NCCL rank ", rank_, ": GroupEnd without GroupStart");
  --group_depth_;
  ncclResult_t r = ncclGroupEnd();
  if (failed_) return;
  AfterCall(r, "ncclGroupEnd");
}

void NcclComm::Send(const void* buf, std::size_t bytes, int peer, void* stream) {
  internal::ThrowIf(internal::CheckPeer("NcclComm::Send", rank_, size_, peer));
  internal::ThrowIf(internal::CheckBytes("NcclComm::Send", rank_, peer, bytes, buf, "buf"));
  if (bytes == 0 || failed_) return;
  std::string op = StrCat("send ", bytes, " B to peer ", peer);
  NotePending(op);
  ncclResult_t r = ncclSend(buf, bytes, ncclUint8, peer, static_cast<ncclComm_t>(comm_),
                            static_cast<cudaStream_t>(stream));
  AfterCall(r, StrCat("ncclSend (", op, ")"));
}

void NcclComm::Recv(void* buf, std::size_t bytes, int peer, void* stream) {
  internal::ThrowIf(internal::CheckPeer("NcclComm::Recv", rank_, size_, peer));
  internal::ThrowIf(internal::CheckBytes("NcclComm::Recv", rank_, peer, bytes, buf, "buf"));
  if (bytes == 0 || failed_) return;
  std::string op = StrCat("recv ", bytes, " B from peer ", peer);
  NotePending(op);
  ncclResult_t r = ncclRecv(buf, bytes, ncclUint8, peer, static_cast<ncclComm_t>(comm_),
                            static_cast<cudaStream_t>(stream));
  AfterCall(r, StrCat("ncclRecv (", op, ")"));
}

void NcclComm::AllToAll(const void* send, void* recv, std::size_t block_bytes, void* stream) {
  DS_CHECK(block_bytes == 0 || block_bytes <= static_cast<std::size_t>(PTRDIFF_MAX) / size_,
           "NcclComm::AllToAll on rank ", rank_, ": block_bytes = ", block_bytes, " times ", size_,
           " ranks overflows (a negative count converted to size_t?)");
  internal::ThrowIf(
      internal::CheckBytes("NcclComm::AllToAll", rank_, -1, block_bytes, send, "send"));
  internal::ThrowIf(
      internal::CheckBytes("NcclComm::AllToAll", rank_, -1, block_bytes, recv, "recv"));
  if (block_bytes == 0 || failed_) return;
  const auto* s = static_cast<const unsigned char*>(send);
  auto* d = static_cast<unsigned char*>(recv);
  GroupStart();
  for (int peer = 0; peer < size_; ++peer) {
    Send(s + peer * block_bytes, block_bytes, peer, stream);
    Recv(d + peer * block_bytes, block_bytes, peer, stream);
  }
  GroupEnd();
}

Result<bool> NcclComm::Synchronize(void* stream) {
  if (failed_) return Failure::BackendError(failure_);
  if (group_depth_ != 0) {
    return Failure::InvalidArgument(
        StrCat("NCCL rank ", rank_, " of ", size_,
               ": Synchronize inside GroupStart/GroupEnd (the group is not launched yet)"));
  }
  auto comm = static_cast<ncclComm_t>(comm_);
  auto s = static_cast<cudaStream_t>(stream);
  cuda::DeviceGuard guard(device_, std::nothrow);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  Backoff backoff;
  while (true) {
    cudaError_t ce = cudaStreamQuery(s);
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return Fail(StrCat("ncclCommGetAsyncError failed: ", NcclText(r, comm)));
    if (state != ncclSuccess && state != ncclInProgress) {
      return Fail(StrCat("asynchronous NCCL error: ", NcclText(state, comm)));
    }
    if (ce == cudaSuccess) {
      pending_.clear();
      pending_dropped_ = 0;
      return true;
    }
    if (ce != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return Fail(StrCat("cudaStreamQuery failed: ", CudaErrorText(ce)));
    }
    if (Clock::now() >= deadline) {
      return Fail(StrCat("Synchronize timed out after ", timeout_s_,
                         " s waiting for the stream (a peer that never posted its matching "
                         "operation, or a hung kernel)"));
    }
    backoff.Wait();
  }
}

#else  // !DITSCALE_HAVE_NCCL

namespace {
const char* kNoNccl =
    "ditscale was built without NCCL (install NCCL with the CUDA toolkit or set NCCL_HOME, "
    "then rebuild)";
}  // namespace

bool NcclAvailable() { return false; }
Result<NcclId> NcclNewId() { return Failure::Unavailable(kNoNccl); }

NcclComm::NcclComm(int rank, int size, int device, double timeout_s)
    : rank_(rank), size_(size), device_(device), timeout_s_(timeout_s) {}

Result<std::unique_ptr<NcclComm>> NcclComm::Create(const NcclId&, int nranks, int rank, int device,
                                                   double, int) {
  std::string bad = internal::CheckRankArgs("NcclComm::Create", nranks, rank, device);
  if (!bad.empty()) return Failure::InvalidArgument(bad);
  return Failure::Unavailable(kNoNccl);
}
NcclComm::~NcclComm() = default;
void NcclComm::set_timeout_s(double timeout_s) { timeout_s_ = timeout_s; }
void NcclComm::GroupStart() { DS_FAIL(kNoNccl); }
void NcclComm::GroupEnd() { DS_FAIL(kNoNccl); }
void NcclComm::Send(const void*, std::size_t, int, void*) { DS_FAIL(kNoNccl); }
void NcclComm::Recv(void*, std::size_t, int, void*) { DS_FAIL(kNoNccl); }
void NcclComm::AllToAll(const void*, void*, std::size_t, void*) { DS_FAIL(kNoNccl); }
Result<bool> NcclComm::Synchronize(void*) { return Failure::Unavailable(kNoNccl); }
void NcclComm::AfterCall(int, const std::string&) {}
bool NcclComm::WaitReady(const std::string&) { return false; }
Failure NcclComm::Fail(const std::string& what) { return Failure::BackendError(what); }
void NcclComm::NotePending(std::string) {}

#endif  // DITSCALE_HAVE_NCCL

}  // namespace ditscale::comm
