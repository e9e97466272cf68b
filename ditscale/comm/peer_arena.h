// Peer-addressable device memory: what the GPU executor's copy-engine engine needs of a
// one-sided transport. Its puts are cudaMemcpyAsync into the peer's buffer and its signals
// cuStreamWriteValue64 on the peer's words, so it needs, for every rank it puts into, an address
// in this process that the copy engines and the stream's front end can write: NVLink or PCIe
// peer-to-peer mappings. Neither takes an SM, so both run beside a kernel that holds every SM
// (cuDNN's attention; lab/results/sp-overlap_h200_2026-12/primitives.json), where NVSHMEM's
// on-stream puts, signals and waits launch kernels and wait for it.
//
// Implementations: comm::Nvshmem (the symmetric heap; nvshmem_ptr gives a peer's address, null
// for a peer reached only through a network transport) and runtime::LocalPeers (ranks of one
// process, for tests on one GPU).
//
// PeerAllocation owns one allocation of a PeerArena (Release in its destructor).
#pragma once

#include <cstddef>
#include <cstdio>
#include <exception>
#include <utility>

namespace ditscale::comm {

class PeerArena {
 public:
  virtual ~PeerArena() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // `bytes` (> 0) of device memory, zeroed on every rank before any rank returns. COLLECTIVE:
  // every rank allocates the same sizes in the same order; the k-th allocations of all ranks
  // are peers of each other. Throws ditscale::Error when out of memory.
  virtual void* Allocate(std::size_t bytes) = 0;
  // Collective; work using `p` must have completed.
  virtual void Release(void* p) = 0;
  // The address in this process of rank `pe`'s copy of the local allocation address `local`
  // (anywhere inside an allocation), which this GPU's copy engines and streams can write; null
  // when `pe` is not reachable by load/store (another machine). `pe` == rank() gives `local`.
  virtual void* PeerAddress(void* local, int pe) const = 0;
};

// One allocation of a PeerArena, released in the destructor: move-only. Release is collective
// like Allocate, so every rank destroys its owners of an arena in the same order. A Release that
// throws (an arena already torn down) is reported on stderr: a destructor cannot throw.
class PeerAllocation {
 public:
  PeerAllocation() = default;
  // arena->Allocate(bytes) (throws ditscale::Error when out of memory).
  static PeerAllocation Allocate(PeerArena* arena, std::size_t bytes) {
    return PeerAllocation(arena, arena->Allocate(bytes));
  }
  ~PeerAllocation() { reset(); }
  PeerAllocation(PeerAllocation&& o) noexcept
      : arena_(std::exchange(o.arena_, nullptr)), p_(std::exchange(o.p_, nullptr)) {}
  PeerAllocation& operator=(PeerAllocation&& o) noexcept {
    if (this != &o) {
      reset();
      arena_ = std::exchange(o.arena_, nullptr);
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  PeerAllocation(const PeerAllocation&) = delete;
  PeerAllocation& operator=(const PeerAllocation&) = delete;

  void* get() const { return p_; }
  PeerArena* arena() const { return arena_; }
  // Releases the allocation now.
  void reset() noexcept {
    if (p_ == nullptr) return;
    try {
      arena_->Release(p_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ditscale: releasing a peer allocation failed: %s\n", e.what());
    }
    p_ = nullptr;
  }

 private:
  PeerAllocation(PeerArena* arena, void* p) : arena_(arena), p_(p) {}
  PeerArena* arena_ = nullptr;
  void* p_ = nullptr;
};

}  // namespace ditscale::comm
