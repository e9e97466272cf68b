#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/core/error.h"
#include "ditscale/runtime/local_peers.h"

namespace ditscale::runtime {
namespace {

// One rank's allocation; freed when released, or with the group (the last LocalPeer destroyed).
struct Allocation {
  cuda::DeviceBuffer memory;  // empty once released (the index stays: allocations stay paired)
  std::size_t bytes = 0;
  char* base() const { return memory.data(); }
};

struct Group {
  std::vector<int> devices;
  std::vector<std::vector<bool>> reachable;  // [rank][peer]
  std::mutex mu;
  std::vector<std::vector<Allocation>> allocs;  // [rank][k]
  ~Group() {
    for (std::size_t r = 0; r < allocs.size(); ++r) {
      cuda::DeviceGuard guard(devices[r], std::nothrow);
      allocs[r].clear();
    }
  }
};

class LocalPeer final : public comm::PeerArena {
 public:
  LocalPeer(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(g_->devices.size()); }

  void* Allocate(std::size_t bytes) override {
    DS_CHECK(bytes > 0, "LocalPeers::Allocate on rank ", rank_, ": bytes must be > 0");
    cuda::DeviceGuard guard(g_->devices[rank_]);
    auto memory = cuda::DeviceBuffer::Allocate(bytes);
    if (!memory.ok())
      DS_FAIL("LocalPeers::Allocate on rank ", rank_, ": ", memory.failure().message);
    char* p = memory->data();
    DS_CHECK_CUDA(cudaMemset(p, 0, bytes));
    DS_CHECK_CUDA(cudaDeviceSynchronize());
    std::lock_guard<std::mutex> lock(g_->mu);
    g_->allocs[rank_].push_back(Allocation{std::move(memory).value(), bytes});
    return p;
  }

  void Release(void* p) override {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(g_->mu);
    for (Allocation& a : g_->allocs[rank_]) {
      if (a.base() != nullptr && a.base() == p) {
        cuda::DeviceGuard guard(g_->devices[rank_], std::nothrow);
        a.memory.reset();  // keeps the index: later allocations stay paired
        return;
      }
    }
    DS_FAIL("LocalPeers::Release on rank ", rank_, ": ", p, " is not an allocation of this rank");
  }

  void* PeerAddress(void* local, int pe) const override {
    DS_CHECK(pe >= 0 && pe < size(), "LocalPeers::PeerAddress on rank ", rank_, ": peer ", pe,
             " not in [0, ", size(), ")");
    std::lock_guard<std::mutex> lock(g_->mu);
    const auto* c = static_cast<const char*>(local);
    const std::vector<Allocation>& mine = g_->allocs[rank_];
    for (std::size_t k = 0; k < mine.size(); ++k) {
      const Allocation& a = mine[k];
      if (a.base() == nullptr || c < a.base() || c >= a.base() + a.bytes) continue;
      if (!g_->reachable[rank_][pe]) return nullptr;
      DS_CHECK(k < g_->allocs[pe].size() && g_->allocs[pe][k].base() != nullptr,
               "LocalPeers::PeerAddress on rank ", rank_, ": rank ", pe, " has not made its ",
               k + 1, "-th allocation (every rank allocates the same sizes in the same order)");
      DS_CHECK(g_->allocs[pe][k].bytes == a.bytes, "LocalPeers: allocation ", k, " is ", a.bytes,
               " bytes on rank ", rank_, " but ", g_->allocs[pe][k].bytes, " on rank ", pe);
      return g_->allocs[pe][k].base() + (c - a.base());
    }
    DS_FAIL("LocalPeers::PeerAddress on rank ", rank_, ": ", local,
            " is not inside an allocation of this rank");
  }

 private:
  std::shared_ptr<Group> g_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<comm::PeerArena>> MakeLocalPeers(const std::vector<int>& devices) {
  DS_CHECK(!devices.empty(), "MakeLocalPeers: no ranks");
  auto g = std::make_shared<Group>();
  g->devices = devices;
  const int n = static_cast<int>(devices.size());
  g->allocs.resize(n);
  g->reachable.assign(n, std::vector<bool>(n, true));
  for (int r = 0; r < n; ++r) {
    for (int p = 0; p < n; ++p) {
      if (devices[r] == devices[p]) continue;
      int can = 0;
      DS_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, devices[r], devices[p]));
      if (!can) {
        g->reachable[r][p] = false;
        continue;
      }
      cuda::DeviceGuard guard(devices[r]);
      const cudaError_t e = cudaDeviceEnablePeerAccess(devices[p], 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
      } else {
        DS_CHECK(e == cudaSuccess, "MakeLocalPeers: cudaDeviceEnablePeerAccess(", devices[p],
                 ") on device ", devices[r], " failed: ", CudaErrorText(e));
      }
    }
  }
  std::vector<std::unique_ptr<comm::PeerArena>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<LocalPeer>(g, r));
  return out;
}

}  // namespace ditscale::runtime
