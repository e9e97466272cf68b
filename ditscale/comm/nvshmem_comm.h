// One-sided transport: NVSHMEM through its host library only (the *_on_stream APIs).
//
// NVSHMEM is process-global: one Nvshmem object per process (one process per GPU), so a second
// Init while one is alive is an error. Only host-side APIs are used, so nothing here needs
// relocatable device code or libnvshmem_device.a: the library links libnvshmem_host.so.3 and
// initializes with nvshmemx_hostlib_init_attr (the host-library entry point, which also returns
// an error code instead of calling exit() like the inline nvshmemx_init_attr of the header).
//
// Run time: libnvshmem_host.so.3 loads its bootstrap plugin nvshmem_bootstrap_uid.so.3 by name;
// the wheel's libnvshmem_host carries RPATH $ORIGIN, so the plugin next to it is found with no
// environment variable, also when ditscale is loaded from a Python extension. The loader must find
// libnvshmem_host.so.3 itself: ditscale_comm adds the wheel's lib folder to the RPATH of whatever
// links it (see ditscale/comm/CMakeLists.txt); NVSHMEM_BOOTSTRAP_UID_PLUGIN=<full path> overrides
// the plugin. On the lent machines keep NVSHMEM_DISABLE_NVLS=1.
//
// Streams are cudaStream_t passed as void*; symmetric addresses come from Malloc. Argument errors
// (PE out of range, an address outside the symmetric heap) throw ditscale::Error.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ditscale/comm/comm_common.h"
#include "ditscale/comm/peer_arena.h"
#include "ditscale/core/result.h"

namespace ditscale::comm {

// An nvshmemx_uniqueid_t as plain bytes (sizeof == 128, checked in nvshmem_comm.cc).
struct NvshmemId {
  std::array<unsigned char, kUniqueIdBytes> bytes{};
};

// True when ditscale was compiled with NVSHMEM.
bool NvshmemAvailable();
// Why NVSHMEM is unavailable ("" when it is available).
std::string NvshmemUnavailableReason();
// nvshmemx_get_uniqueid; one process (rank 0 by convention) calls it and sends the bytes on.
Result<NvshmemId> NvshmemNewId();

// Also a PeerArena (Allocate = Malloc, Release = Free, PeerAddress = nvshmem_ptr): the GPU
// executor's copy-engine engine moves data between NVLink peers through the symmetric heap.
class Nvshmem final : public PeerArena {
 public:
  // cudaSetDevice(device); nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
  // nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr), a collective of all `nranks`
  // processes; then checks nvshmem_my_pe() == rank and nvshmem_n_pes() == nranks.
  static Result<std::unique_ptr<Nvshmem>> Init(const NvshmemId& id, int nranks, int rank,
                                               int device);
  // nvshmemx_hostlib_finalize (collective: every PE destroys its object). Never throws.
  ~Nvshmem() override;
  Nvshmem(const Nvshmem&) = delete;
  Nvshmem& operator=(const Nvshmem&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const { return device_; }

  // nvshmem_malloc of `bytes` (> 0) from the symmetric heap (NVSHMEM_SYMMETRIC_SIZE, default
  // 1 GiB). COLLECTIVE: every PE calls it with the same size in the same order. The memory is
  // ZEROED on every PE before Malloc returns on any PE (memset, then a barrier), so signal words
  // in it start at 0 and a peer's early put cannot be overwritten by our memset. Throws
  // ditscale::Error when the heap is exhausted.
  void* Malloc(std::size_t bytes);
  // nvshmem_free; collective. Work enqueued on `p` must have completed.
  void Free(void* p);
  void* Allocate(std::size_t bytes) override { return Malloc(bytes); }
  void Release(void* p) override { Free(p); }
  // nvshmem_ptr(local, pe): non-null for this PE and for peers the heap is mapped from (NVLink /
  // PCIe peer-to-peer); throws unless `local` is a symmetric address.
  void* PeerAddress(void* local, int pe) const override;

  // Enqueued on `stream`: copies `bytes` bytes from local device memory `src` to the symmetric
  // address `dst` on PE `pe` (dst is the LOCAL symmetric address; NVSHMEM maps it to pe's copy),
  // then atomically adds `add` to the uint64 symmetric signal `sig` on `pe` once the data is
  // visible there (nvshmemx_putmem_signal_on_stream with NVSHMEM_SIGNAL_ADD; with `set`, SETS the
  // signal to `add` instead: NVSHMEM_SIGNAL_SET). bytes == 0 sends only the signal. pe == rank()
  // is allowed.
  void PutSignal(void* dst, const void* src, std::size_t bytes, std::uint64_t* sig,
                 std::uint64_t add, int pe, void* stream, bool set = false);
  // Enqueued on `stream`: atomically adds `add` to `sig` on `pe`, no data
  // (nvshmemx_signal_op_on_stream with NVSHMEM_SIGNAL_ADD). Ordered after earlier puts to `pe`
  // only through Quiet (or use PutSignal, whose signal is ordered after its own data).
  void Signal(std::uint64_t* sig, std::uint64_t add, int pe, void* stream, bool set = false);
  // Blocks `stream` until the local symmetric signal `*sig` >= `value`
  // (nvshmemx_signal_wait_until_on_stream with NVSHMEM_CMP_GE).
  void WaitGE(std::uint64_t* sig, std::uint64_t value, void* stream);
  // nvshmemx_quiet_on_stream: puts and signals enqueued before it on `stream` are complete.
  void Quiet(void* stream);
  // nvshmemx_barrier_all_on_stream: quiet + barrier over all PEs, on `stream`.
  void BarrierAll(void* stream);
  // Waits until `stream` is idle, at most timeout_s seconds (polls cudaStreamQuery). NVSHMEM has
  // no abort: after a timeout (a WaitGE whose signal never comes) the stream stays blocked and the
  // process should exit; the Failure says so.
  Result<bool> Synchronize(void* stream, double timeout_s = 60);

 private:
  Nvshmem(int rank, int size, int device) : rank_(rank), size_(size), device_(device) {}
  // Throws unless `p` is in the local symmetric heap.
  void CheckSymmetric(const void* p, const char* what, const char* name) const;

  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
};

}  // namespace ditscale::comm
