// GPU executor of sequence-parallel attention schedules (ditscale/sp/schedule.h).
//
// One executor per (schedule, rank, dtype): built once, run once per attention layer. It owns
// one CUDA stream per schedule stream (compute, intra-machine comm, inter-machine comm; the comm
// streams at high priority), one event per unit another stream waits for, and one device arena
// holding every work, scratch and staging buffer (cudaMalloc; NVSHMEM's symmetric heap for
// one-sided schedules). The host issues the whole layer without blocking (exec_plan.h gives the
// order); the caller's stream is joined at the start and waits for all three streams at the end,
// so the executor behaves like one asynchronous op on the caller's stream.
//
// With SpConfig::comm_sms > 0 the compute stream is a stream of a CUDA green context holding
// all but (at least) comm_sms of the GPU's SMs, so that the comm streams' kernels (NCCL's, packs,
// NVSHMEM's) run beside cuDNN's attention calls instead of after them (sm_partition.h).
//
// Ops: Send/Recv -> NCCL on the communicator of the op's comm stream (groups -> ncclGroupStart /
// End); Put/Signal/Wait -> NVSHMEM put-with-signal / signal / wait-until on the stream, or copy
// engines and stream memory operations (OneSidedEngine below); Attention
// -> the AttentionBackend (the torch layer passes cuDNN attention through ATen); Merge -> our
// log-sum-exp merge kernel (fp32 accumulation); Pack/Unpack/Copy -> our strided region copy
// kernel (a strided cudaMemcpy2DAsync within one GPU is a kernel too: it waits for an attention
// call like ours, lab/results/sp-overlap_h200_2026-12/pack-copy.md). Buffers with an initial value
// (zero, -inf) are filled at the start of every layer.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/kernels/dtype.h"
#include "ditscale/runtime/exec_plan.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::comm {
class NcclComm;
class Nvshmem;
class PeerArena;
}  // namespace ditscale::comm

namespace ditscale::runtime {

// A strided [batch, tokens, heads, width] device tensor, width contiguous; strides in elements.
struct StridedView {
  void* data = nullptr;
  int64_t batch = 0, tokens = 0, heads = 0, width = 0;
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
};

// softmax(q k^T * scale) v for every (batch, head): q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D]
// (Hq a multiple of Hkv: grouped queries), out [B, Tq, Hq, D] in `dtype`, lse [B, Tq, Hq, 1]
// fp32 natural-log log-sum-exp of the scaled scores. Enqueued on `stream` (a cudaStream_t).
struct AttentionArgs {
  StridedView q, k, v, out, lse;
  kernels::DType dtype = kernels::DType::kBFloat16;
  double scale = 1.0;
};
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;
  virtual void Attention(const AttentionArgs& args, void* stream) = 0;
};

// How Put/Signal/Wait run. kNvshmem: NVSHMEM's on-stream put-with-signal, signal and wait (each
// launches a kernel: it waits for SMs, e.g. for the end of a cuDNN attention call that holds
// them all), on one word per counter that signals add to. kCopyEngine: one word per (counter,
// sender) that signals set (SlotSignals, exec_plan.h); a put to a peer this GPU reaches by
// load/store (NVLink / PCIe P2P: comm::PeerArena::PeerAddress) is cudaMemcpyAsync into the peer's
// buffer (a copy engine), its signal cuStreamWriteValue64 on the peer's word; a put to another
// host is NVSHMEM's put-with-signal setting that word (a kernel); every Wait is one
// cuStreamWaitValue64 per sender. On one host nothing of it needs an SM, so transfers run beside
// the attention calls. kAuto: kCopyEngine unless the schedule's waits cannot be split by sender
// (then kNvshmem); a schedule-wide decision, the same on every rank.
enum class OneSidedEngine { kAuto = 0, kNvshmem, kCopyEngine };
const char* ToString(OneSidedEngine e);

struct Transports {
  comm::NcclComm* intra = nullptr;  // Send/Recv on the intra-machine comm stream
  comm::NcclComm* inter = nullptr;  // Send/Recv on the inter-machine comm stream
  comm::Nvshmem* shmem = nullptr;   // one-sided schedules (kNvshmem, and the arena of kCopyEngine)
  // The copy-engine engine's memory; null = `shmem` (the symmetric heap and nvshmem_ptr).
  comm::PeerArena* peers = nullptr;
  OneSidedEngine engine = OneSidedEngine::kAuto;
  // kCopyEngine: a signal to a load/store peer as an 8-byte cudaMemcpyAsync of a word written
  // locally (cuStreamWriteValue64 on own memory) instead of cuStreamWriteValue64 on the peer's
  // memory: the same order (the copy engine starts it after the put's copy), for drivers or
  // mappings where a stream memory operation cannot write a peer's memory.
  bool signal_by_copy = false;
  // Replay one rank's compute alone on one GPU: Send/Recv/Put/Signal/Wait are skipped (no
  // transport needed, the arena is plain device memory), everything else runs as scheduled.
  // What the rank's attention calls, merges and copies cost if communication were free; the
  // results are meaningless (remote data never arrives: the arena starts as noise, not zeros,
  // which would draw less power and run faster). For measurements only.
  bool compute_only = false;
};

// The caller's tensors of one layer: dense row-major [B, tokens, heads, head_dim] device memory
// (q/k/v/out: the rank's image-token shard; text_*: all T joint tokens; null when T == 0).
struct LayerIo {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* text_q = nullptr;
  const void* text_k = nullptr;
  const void* text_v = nullptr;
  void* out = nullptr;
  void* text_out = nullptr;
};

bool GpuExecutorAvailable();  // built with CUDA

class GpuExecutor {
 public:
  // Validates the schedule, plans it (exec_plan.h, NCCL order check included), allocates the
  // arena (collective for one-sided schedules: every rank creates its executor in the same
  // order) and the streams/events on `device`. `attention` must outlive the executor. Every
  // call of the executor (Create, Run, SetTrace, LastTimeline, the destructor) works on `device`
  // and leaves the caller's current device as it was.
  static Result<std::unique_ptr<GpuExecutor>> Create(sp::Schedule schedule, int rank,
                                                     kernels::DType dtype, int device,
                                                     Transports transports,
                                                     AttentionBackend* attention);
  // Waits for the executor's streams, then frees its memory (collective for one-sided
  // schedules), events and streams. Never throws.
  ~GpuExecutor();
  GpuExecutor(const GpuExecutor&) = delete;
  GpuExecutor& operator=(const GpuExecutor&) = delete;

  // Enqueues one layer after the work already on `stream` (a cudaStream_t); `stream` waits for
  // its end. Throws ditscale::Error on a CUDA launch error or bad io (null pointer).
  void Run(const LayerIo& io, void* stream);

  // Tracing (diagnosis): while on, every Run records a timing event before and after each unit
  // on its stream (two events per unit; some overhead). LastTimeline waits for the last traced
  // layer and returns when each unit could start and when it ended, in ms after the layer's start
  // on this rank (PrintTimeline formats it). Fails when no traced layer ran.
  void SetTrace(bool on);
  bool trace() const;
  Result<std::vector<UnitTiming>> LastTimeline() const;

  const sp::Schedule& schedule() const { return schedule_; }
  const ExecPlan& plan() const { return plans_[rank_]; }
  int64_t arena_bytes() const { return plans_[rank_].arena_bytes; }
  // The engine of the one-sided ops (kAuto resolved; kAuto when the schedule has none).
  OneSidedEngine engine() const { return engine_; }
  // The SMs the compute stream runs on when the schedule keeps some for communication
  // (SpConfig::comm_sms > 0: a CUDA green context, sm_partition.h); 0 = the whole GPU.
  int compute_sms() const { return compute_sms_; }
  int64_t layers_run() const { return layers_; }

 private:
  GpuExecutor() = default;
  struct Impl;  // the CUDA resources (gpu_executor.cu)
  // Create's steps: the transports the program needs and the one-sided engine; the streams and
  // events; the arena. Each returns the Failure that ends Create, if any.
  std::optional<Failure> BindTransports();
  std::optional<Failure> MakeStreamsAndEvents();
  std::optional<Failure> AllocateMemory();
  void Issue(int unit, const LayerIo& io);
  // A put's target in `peer_arena` (the peer's arena as this process addresses it, or the local
  // symmetric arena for NVSHMEM), and its source and size.
  char* PutTarget(const sp::Op& o, char* peer_arena) const;
  char* PutSource(const sp::Op& o, const LayerIo& io, int64_t* bytes) const;
  void IssueNvshmem(int op, const LayerIo& io, void* stream);
  void IssueCopyEngine(int op, const LayerIo& io, void* stream);
  char* BufferBase(int buffer, const LayerIo& io) const;
  StridedView View(const sp::Region& r, const LayerIo& io) const;

  sp::Schedule schedule_;
  std::vector<ExecPlan> plans_;
  CounterTable counters_;
  int rank_ = 0;
  int device_ = 0;
  kernels::DType dtype_ = kernels::DType::kBFloat16;
  Transports transports_;
  AttentionBackend* attention_ = nullptr;
  char* arena_ = nullptr;  // owned by impl_ (device memory, or an allocation of peer_arena_)
  bool symmetric_ = false;
  OneSidedEngine engine_ = OneSidedEngine::kAuto;
  int compute_sms_ = 0;
  comm::PeerArena* peer_arena_ = nullptr;  // one-sided schedules: where arena_ lives
  std::vector<char*> peer_base_;           // kCopyEngine: each rank's arena, resolved at first Run
  SlotSignals slots_;                      // kCopyEngine
  uint64_t* signal_src_ = nullptr;  // kCopyEngine + signal_by_copy: one word per op (in impl_)
  int64_t layers_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ditscale::runtime
