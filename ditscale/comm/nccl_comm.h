// Two-sided transport: an NCCL communicator for one rank, with hang detection.
//
// One NcclComm per (rank, GPU); one thread drives it (NCCL groups are per thread). Streams are
// cudaStream_t passed as void* so this header needs no CUDA include.
//
// Failure model. The communicator is created non-blocking (ncclConfig_t::blocking = 0): every
// NCCL call returns at once, possibly with ncclInProgress while a proxy thread connects peers, and
// this class polls ncclCommGetAsyncError until the call is really enqueued. Any wait (init, the
// enqueue of an op outside a group, Synchronize) gives up after `timeout_s`: the communicator is
// then aborted (ncclCommAbort, which also stops NCCL kernels already spinning on the GPU) and the
// failure is kept. After a failure, later enqueue calls are skipped and Synchronize returns that
// first failure; create a new communicator to continue. Argument errors (peer out of range, a null
// buffer) are programming errors: they throw ditscale::Error at once.
//
// Byte counts: bytes == 0 is a no-op (both sides must agree on the size, as with any send/recv).
#pragma once

#include <array>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "ditscale/comm/comm_common.h"
#include "ditscale/core/result.h"

namespace ditscale::comm {

// An ncclUniqueId as plain bytes, so that it can be broadcast by any channel (a pipe,
// torch.distributed, a file).
struct NcclId {
  std::array<unsigned char, kUniqueIdBytes> bytes{};
};

// True when ditscale was compiled with NCCL.
bool NcclAvailable();

// ncclGetUniqueId. One rank (rank 0 by convention) calls it and sends the bytes to the others.
Result<NcclId> NcclNewId();

class NcclComm {
 public:
  // ncclCommInitRankConfig for `rank` of `nranks` on CUDA device `device` (cudaSetDevice(device)
  // first; the calling thread keeps that device current). Waits until all `nranks` ranks have
  // joined with the same `id`, at most `timeout_s` seconds (> 0); a Failure names the rank, the
  // number of ranks and what it waited for.
  // channels_per_net_peer > 0 sets ncclConfig_t::nChannelsPerNetPeer (NCCL >= 2.28): how many
  // channels, hence sockets / network flows, a send/recv to one peer over the network transport
  // uses (0 = NCCL's default; must be in [0, 64]). Kernels launch as single CTAs
  // (ncclConfig_t::cgaClusterSize 1), so that they fit beside a partitioned compute stream.
  static Result<std::unique_ptr<NcclComm>> Create(const NcclId& id, int nranks, int rank,
                                                  int device, double timeout_s = 60,
                                                  int channels_per_net_peer = 0);
  // ncclCommFinalize + ncclCommDestroy (waits at most timeout_s for outstanding work), or
  // ncclCommAbort when the communicator failed. Never throws.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  double timeout_s() const { return timeout_s_; }
  // Changes the limit of later waits (e.g. a long one for init, a short one for each step).
  void set_timeout_s(double timeout_s);
  void* raw() const { return comm_; }  // ncclComm_t; null after an abort
  // False after a failure (timeout, async NCCL error); the failure is in failure().
  bool ok() const { return !failed_; }
  const std::string& failure() const { return failure_; }

  // ncclGroupStart/ncclGroupEnd. Sends and receives between them are fused into one launch, so a
  // rank may post a send to and a receive from the same peer without deadlock. Groups nest.
  void GroupStart();
  void GroupEnd();
  // Enqueue on `stream`: send `bytes` bytes of device memory at `buf` to rank `peer`, or receive
  // `bytes` bytes from `peer` into `buf`. The matching Recv/Send on `peer` must use the same size.
  // peer == rank() is allowed inside a group (a local copy).
  void Send(const void* buf, std::size_t bytes, int peer, void* stream);
  void Recv(void* buf, std::size_t bytes, int peer, void* stream);
  // All-to-all of equal blocks of `block_bytes` bytes (one group): block j of `send`
  // (send + j * block_bytes) goes to rank j, block i of `recv` comes from rank i. `send` and
  // `recv` hold size() blocks each and must not overlap.
  void AllToAll(const void* send, void* recv, std::size_t block_bytes, void* stream);
  // Waits until `stream` is idle: polls cudaStreamQuery and ncclCommGetAsyncError, at most
  // timeout_s. Returns true when the stream finished; a Failure (and the communicator aborted) on
  // an NCCL or CUDA error or on timeout, naming the rank, the number of ranks and the operations
  // enqueued since the last successful Synchronize.
  Result<bool> Synchronize(void* stream);

 private:
  NcclComm(int rank, int size, int device, double timeout_s);
  // After an NCCL call: on ncclInProgress outside a group, polls until it is enqueued; on error
  // or timeout, Fail()s. `what` names the call for the message.
  void AfterCall(int result, const std::string& what);
  // Polls ncclCommGetAsyncError until the communicator is no longer in progress (timeout_s).
  bool WaitReady(const std::string& what);
  // Records the first failure, aborts the communicator. Returns the failure.
  Failure Fail(const std::string& what);
  void NotePending(std::string op);

  void* comm_ = nullptr;  // ncclComm_t
  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  double timeout_s_ = 60;
  int group_depth_ = 0;
  bool failed_ = false;
  std::string failure_;
  std::vector<std::string> pending_;  // ops enqueued since the last successful Synchronize
  std::size_t pending_dropped_ = 0;   // ops beyond the kept list
};

}  // namespace ditscale::comm
