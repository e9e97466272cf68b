#include "ditscale/comm/nvshmem_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "ditscale/core/error.h"

#if DITSCALE_HAVE_NVSHMEM
#include <cuda_runtime.h>
#include <nvshmem_host.h>

#include "ditscale/core/cuda_check.h"
#endif

namespace ditscale::comm {

using ::ditscale::internal::StrCat;

#if DITSCALE_HAVE_NVSHMEM

static_assert(sizeof(nvshmemx_uniqueid_t) == kUniqueIdBytes, "NvshmemId must hold the unique id");

namespace {

// NVSHMEM state is per process: one live Nvshmem object at a time.
std::mutex g_mu;
bool g_live = false;

}  // namespace

bool NvshmemAvailable() { return true; }
std::string NvshmemUnavailableReason() { return {}; }

Result<NvshmemId> NvshmemNewId() {
  nvshmemx_uniqueid_t uid;
  std::memset(&uid, 0, sizeof(uid));
  int rc = nvshmemx_get_uniqueid(&uid);
  if (rc != 0) {
    return Failure::BackendError(
        StrCat("nvshmemx_get_uniqueid failed with status ", rc,
               " (is nvshmem_bootstrap_uid.so.3 next to libnvshmem_host.so.3, or "
               "NVSHMEM_BOOTSTRAP_UID_PLUGIN set? NVSHMEM_DEBUG=WARN tells more)"));
  }
  NvshmemId id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

Result<std::unique_ptr<Nvshmem>> Nvshmem::Init(const NvshmemId& id, int nranks, int rank,
                                               int device) {
  std::string bad = internal::CheckRankArgs("Nvshmem::Init", nranks, rank, device);
  if (!bad.empty()) return Failure::InvalidArgument(bad);
  std::lock_guard<std::mutex> lock(g_mu);
  const std::string who = StrCat("Nvshmem::Init: rank ", rank, " of ", nranks);
  if (g_live) {
    return Failure::InvalidArgument(
        StrCat(who,
               ": NVSHMEM is already initialized in this process (one Nvshmem "
               "per process; destroy the first one before Init again)"));
  }
  if (nvshmemx_init_status() != NVSHMEM_STATUS_NOT_INITIALIZED) {
    return Failure::Unavailable(
        StrCat(who, ": NVSHMEM was already initialized in this process by other code"));
  }
  int ndev = 0;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    return Failure::Unavailable(
        StrCat(who, ": cudaGetDeviceCount failed: ", CudaErrorText(ce), " (no usable GPU?)"));
  }
  if (device >= ndev) {
    return Failure::InvalidArgument(
        StrCat(who, ": device ", device, " does not exist (", ndev, " CUDA devices)"));
  }
  ce = cudaSetDevice(device);
  if (ce != cudaSuccess) {
    (void)cudaGetLastError();
    return Failure::BackendError(
        StrCat(who, ": cudaSetDevice(", device, ") failed: ", CudaErrorText(ce)));
  }
  // NVSHMEM (with its own, statically linked CUDA runtime) binds to the context current in this
  // thread: make sure the primary context of `device` exists and is current.
  ce = cudaFree(nullptr);
  if (ce != cudaSuccess) {
    return Failure::BackendError(StrCat(who, ": creating the CUDA context on device ", device,
                                        " failed: ", CudaErrorText(ce)));
  }
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, id.bytes.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &attr);
  if (rc != 0) {
    return Failure::BackendError(
        StrCat(who, ": nvshmemx_set_attr_uniqueid_args failed with status ", rc));
  }
  rc = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (rc != 0) {
    return Failure::BackendError(
        StrCat(who, " (device ", device,
               "): nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID) failed with "
               "status ",
               rc,
               " (all ranks must call Init with the same id; NVSHMEM_DEBUG=WARN "
               "tells more)"));
  }
  const int my_pe = nvshmem_my_pe();
  const int n_pes = nvshmem_n_pes();
  if (my_pe != rank || n_pes != nranks) {
    nvshmemx_hostlib_finalize();
    return Failure::BackendError(StrCat(who, ": NVSHMEM reports PE ", my_pe, " of ", n_pes,
                                        " after init; expected PE ", rank, " of ", nranks));
  }
  g_live = true;
  return std::unique_ptr<Nvshmem>(new Nvshmem(rank, nranks, device));
}

Nvshmem::~Nvshmem() {
  std::lock_guard<std::mutex> lock(g_mu);
  nvshmemx_hostlib_finalize();
  g_live = false;
}

void Nvshmem::CheckSymmetric(const void* p, const char* what, const char* name) const {
  DS_CHECK(p != nullptr, what, " on PE ", rank_, ": ", name, " is null");
  // nvshmem_ptr(p, own PE) is non-null exactly for addresses inside the local symmetric heap.
  DS_CHECK(nvshmem_ptr(p, rank_) != nullptr, what, " on PE ", rank_, ": ", name, " = ", p,
           " is not a symmetric address (allocate it with Nvshmem::Malloc)");
}

void* Nvshmem::Malloc(std::size_t bytes) {
  DS_CHECK(bytes > 0 && bytes <= static_cast<std::size_t>(PTRDIFF_MAX), "Nvshmem::Malloc on PE ",
           rank_, ": bytes must be in [1, PTRDIFF_MAX], got ", bytes);
  void* p = nvshmem_malloc(bytes);
  DS_CHECK(p != nullptr, "nvshmem_malloc(", bytes, ") failed on PE ", rank_, " of ", size_,
           " (symmetric heap exhausted? raise NVSHMEM_SYMMETRIC_SIZE, default 1 GiB)");
  cudaError_t ce = cudaMemset(p, 0, bytes);
  if (ce == cudaSuccess) ce = cudaDeviceSynchronize();
  DS_CHECK(ce == cudaSuccess, "Nvshmem::Malloc on PE ", rank_, ": zeroing ", bytes,
           " bytes failed: ", CudaErrorText(ce));
  // Every PE has zeroed its copy before any PE can put into it.
  nvshmem_barrier_all();
  return p;
}

void Nvshmem::Free(void* p) {
  if (p == nullptr) return;
  CheckSymmetric(p, "Nvshmem::Free", "p");
  nvshmem_free(p);
}

void* Nvshmem::PeerAddress(void* local, int pe) const {
  internal::ThrowIf(internal::CheckPeer("Nvshmem::PeerAddress", rank_, size_, pe));
  CheckSymmetric(local, "Nvshmem::PeerAddress", "local");
  return nvshmem_ptr(local, pe);
}

void Nvshmem::PutSignal(void* dst, const void* src, std::size_t bytes, std::uint64_t* sig,
                        std::uint64_t add, int pe, void* stream, bool set) {
  internal::ThrowIf(internal::CheckPeer("Nvshmem::PutSignal", rank_, size_, pe));
  internal::ThrowIf(internal::CheckBytes("Nvshmem::PutSignal", rank_, pe, bytes, src, "src"));
  CheckSymmetric(sig, "Nvshmem::PutSignal", "sig");
  auto s = static_cast<cudaStream_t>(stream);
  const int op = set ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD;
  if (bytes == 0) {
    nvshmemx_signal_op_on_stream(sig, add, op, pe, s);
    return;
  }
  CheckSymmetric(dst, "Nvshmem::PutSignal", "dst");
  nvshmemx_putmem_signal_on_stream(dst, src, bytes, sig, add, op, pe, s);
}

void Nvshmem::Signal(std::uint64_t* sig, std::uint64_t add, int pe, void* stream, bool set) {
  internal::ThrowIf(internal::CheckPeer("Nvshmem::Signal", rank_, size_, pe));
  CheckSymmetric(sig, "Nvshmem::Signal", "sig");
  nvshmemx_signal_op_on_stream(sig, add, set ? NVSHMEM_SIGNAL_SET : NVSHMEM_SIGNAL_ADD, pe,
                               static_cast<cudaStream_t>(stream));
}

void Nvshmem::WaitGE(std::uint64_t* sig, std::uint64_t value, void* stream) {
  CheckSymmetric(sig, "Nvshmem::WaitGE", "sig");
  nvshmemx_signal_wait_until_on_stream(sig, NVSHMEM_CMP_GE, value,
                                       static_cast<cudaStream_t>(stream));
}

void Nvshmem::Quiet(void* stream) { nvshmemx_quiet_on_stream(static_cast<cudaStream_t>(stream)); }

void Nvshmem::BarrierAll(void* stream) {
  nvshmemx_barrier_all_on_stream(static_cast<cudaStream_t>(stream));
}

Result<bool> Nvshmem::Synchronize(void* stream, double timeout_s) {
  using Clock = std::chrono::steady_clock;
  auto s = static_cast<cudaStream_t>(stream);
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  int sleep_us = 20;
  while (true) {
    cudaError_t ce = cudaStreamQuery(s);
    if (ce == cudaSuccess) return true;
    if (ce != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return Failure::BackendError(StrCat("NVSHMEM PE ", rank_, " of ", size_,
                                          ": cudaStreamQuery failed: ", CudaErrorText(ce)));
    }
    if (Clock::now() >= deadline) {
      return Failure::BackendError(
          StrCat("NVSHMEM PE ", rank_, " of ", size_, " (device ", device_,
                 "): stream not idle after ", timeout_s,
                 " s (a WaitGE whose signal never came?); NVSHMEM cannot abort, so the "
                 "stream stays blocked: exit the process"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, 1000);
  }
}

#else  // !DITSCALE_HAVE_NVSHMEM

namespace {
const char* kNoNvshmem =
    "ditscale was built without NVSHMEM (pip install nvidia-nvshmem-cu13, rebuild with CUDA and "
    "-DDITSCALE_NVSHMEM=AUTO or ON)";
}  // namespace

bool NvshmemAvailable() { return false; }
std::string NvshmemUnavailableReason() { return kNoNvshmem; }
Result<NvshmemId> NvshmemNewId() { return Failure::Unavailable(kNoNvshmem); }

Result<std::unique_ptr<Nvshmem>> Nvshmem::Init(const NvshmemId&, int nranks, int rank, int device) {
  std::string bad = internal::CheckRankArgs("Nvshmem::Init", nranks, rank, device);
  if (!bad.empty()) return Failure::InvalidArgument(bad);
  return Failure::Unavailable(kNoNvshmem);
}
Nvshmem::~Nvshmem() = default;
void Nvshmem::CheckSymmetric(const void*, const char*, const char*) const { DS_FAIL(kNoNvshmem); }
void* Nvshmem::Malloc(std::size_t) { DS_FAIL(kNoNvshmem); }
void Nvshmem::Free(void*) { DS_FAIL(kNoNvshmem); }
void* Nvshmem::PeerAddress(void*, int) const { DS_FAIL(kNoNvshmem); }
void Nvshmem::PutSignal(void*, const void*, std::size_t, std::uint64_t*, std::uint64_t, int, void*,
                        bool) {
  DS_FAIL(kNoNvshmem);
}
void Nvshmem::Signal(std::uint64_t*, std::uint64_t, int, void*, bool) { DS_FAIL(kNoNvshmem); }
void Nvshmem::WaitGE(std::uint64_t*, std::uint64_t, void*) { DS_FAIL(kNoNvshmem); }
void Nvshmem::Quiet(void*) { DS_FAIL(kNoNvshmem); }
void Nvshmem::BarrierAll(void*) { DS_FAIL(kNoNvshmem); }
Result<bool> Nvshmem::Synchronize(void*, double) { return Failure::Unavailable(kNoNvshmem); }

#endif  // DITSCALE_HAVE_NVSHMEM

}  // namespace ditscale::comm
