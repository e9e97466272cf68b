#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "ditscale/comm/nccl_comm.h"
#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/comm/peer_arena.h"
#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/attn_merge.h"
#include "ditscale/kernels/layout.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/runtime/internal/stream_mem_ops.h"
#include "ditscale/runtime/sm_partition.h"

namespace ditscale::runtime {
namespace {

// Fills `n` 32-bit words (or 16-bit halves) with `pattern`.
__global__ void Fill32(uint32_t* p, int64_t n, uint32_t pattern) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = pattern;
  }
}
__global__ void Fill16(uint16_t* p, int64_t n, uint16_t pattern) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = pattern;
  }
}

void FillNegInf(void* p, int64_t bytes, int element_bytes, kernels::DType dtype,
                cudaStream_t stream) {
  const int threads = 256;
  if (element_bytes == 4) {
    const int64_t n = bytes / 4;
    const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
    if (n > 0) Fill32<<<blocks, threads, 0, stream>>>(static_cast<uint32_t*>(p), n, 0xff800000u);
  } else {
    DS_CHECK(element_bytes == 2, "sp executor: -inf fill of ", element_bytes, "-byte elements");
    const uint16_t pattern = dtype == kernels::DType::kFloat16 ? 0xfc00 : 0xff80;
    const int64_t n = bytes / 2;
    const int blocks = static_cast<int>(std::min<int64_t>((n + threads - 1) / threads, 4096));
    if (n > 0) Fill16<<<blocks, threads, 0, stream>>>(static_cast<uint16_t*>(p), n, pattern);
  }
  DS_CHECK_CUDA(cudaGetLastError());
}

// Compute-only replay: the arena's received rows never arrive, and zeros would run the tensor
// cores below their power draw on real data (the H200 is power-capped: faster clocks, a wrong
// measurement). Fills n 16-bit elements (fp16 or bf16) with hashed values of mean 0 and
// variance 1 like the caller's randn inputs (a sum of four uniforms: Irwin-Hall, scaled).
__global__ void FillNoise16(uint16_t* p, int64_t n, bool fp16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b1u ^ static_cast<uint32_t>(i >> 32);
    float sum = 0;
    for (int k = 0; k < 4; ++k) {
      h ^= h >> 15;
      h *= 0x2c1b3c6du;
      h ^= h >> 12;
      h += 0x6a09e667u;
      sum += static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    }
    const float u = (sum - 2.0f) * 1.7320508f;
    if (fp16) {
      p[i] = __half_as_ushort(__float2half_rn(u));
    } else {
      p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(u));
    }
  }
}

kernels::DType DTypeOfBuffer(const sp::BufferDecl& d, kernels::DType layer) {
  if (d.element_bytes == 4) return kernels::DType::kFloat32;
  return layer;
}

// The caller's tensor behind a binding (null for kNone or a tensor the caller did not give).
char* UserPointer(UserBinding b, const LayerIo& io) {
  const void* p = nullptr;
  switch (b) {
    case UserBinding::kQ:
      p = io.q;
      break;
    case UserBinding::kK:
      p = io.k;
      break;
    case UserBinding::kV:
      p = io.v;
      break;
    case UserBinding::kTextQ:
      p = io.text_q;
      break;
    case UserBinding::kTextK:
      p = io.text_k;
      break;
    case UserBinding::kTextV:
      p = io.text_v;
      break;
    case UserBinding::kOut:
      p = io.out;
      break;
    case UserBinding::kTextOut:
      p = io.text_out;
      break;
    case UserBinding::kNone:
      break;
  }
  return static_cast<char*>(const_cast<void*>(p));
}

bool IsInput(UserBinding b) {
  return b != UserBinding::kNone && b != UserBinding::kOut && b != UserBinding::kTextOut;
}

// The ops a compute-only replay skips.
bool IsTransfer(sp::OpKind k) {
  return k == sp::OpKind::kSend || k == sp::OpKind::kRecv || k == sp::OpKind::kPut ||
         k == sp::OpKind::kSignal || k == sp::OpKind::kWait;
}

// acc (+ acc_lse) := the log-sum-exp merge of acc and part (attn_merge.h).
void LaunchMerge(const StridedView& acc, const StridedView& acc_lse, const StridedView& part,
                 const StridedView& part_lse, int64_t batch, kernels::DType dtype,
                 cudaStream_t st) {
  const kernels::AttnMergeParams p = kernels::attn_merge_pair_params(
      batch, acc.tokens, acc.heads, acc.width, dtype,
      kernels::AttnOutDst{acc.data, acc.stride_b, acc.stride_t, acc.stride_h},
      kernels::LseDst{static_cast<float*>(acc_lse.data), acc_lse.stride_b, acc_lse.stride_t,
                      acc_lse.stride_h},
      kernels::AttnOutView{part.data, part.stride_b, part.stride_t, part.stride_h},
      kernels::LseView{static_cast<const float*>(part_lse.data), part_lse.stride_b,
                       part_lse.stride_t, part_lse.stride_h});
  kernels::attn_merge_cuda(p, st);
}

// d := s, one strided copy (layout.h: pack, unpack, copy); nothing for an empty region.
void LaunchLayoutCopy(const StridedView& s, const StridedView& d, kernels::DType dtype,
                      int64_t batch, cudaStream_t st) {
  if (s.tokens == 0 || s.heads == 0) return;
  kernels::LayoutCopyParams p;
  p.dtype = dtype;
  p.batch = batch;
  p.head_dim = s.width;
  p.num_copies = 1;
  p.copies[0] = kernels::LayoutCopy{s.data,     s.stride_b, s.stride_t, s.stride_h, d.data,
                                    d.stride_b, d.stride_t, d.stride_h, s.tokens,   s.heads};
  kernels::layout_copy_cuda(p, st);
}

// The plans of a schedule that an executor of `rank` can run in `dtype`: the arguments, the
// schedule's validity and the NCCL order checked.
Result<std::vector<ExecPlan>> PlanSchedule(const sp::Schedule& schedule, int rank,
                                           kernels::DType dtype,
                                           const AttentionBackend* attention) {
  if (rank < 0 || rank >= static_cast<int>(schedule.ranks.size())) {
    return Failure::InvalidArgument("rank " + std::to_string(rank) + " is not in the schedule's " +
                                        std::to_string(schedule.ranks.size()) + " ranks",
                                    "rank");
  }
  if (attention == nullptr) return Failure::InvalidArgument("no attention backend", "attention");
  if (static_cast<int>(kernels::dtype_size(dtype)) != schedule.shape.dtype_bytes) {
    return Failure::InvalidArgument("dtype " + std::string(kernels::dtype_name(dtype)) +
                                        " does not match the schedule's dtype_bytes " +
                                        std::to_string(schedule.shape.dtype_bytes),
                                    "dtype");
  }
  const sp::ValidationReport rep = sp::ValidateSchedule(schedule);
  if (!rep.ok()) return Failure::InvalidArgument("invalid schedule:\n" + rep.ToString());
  auto plans = BuildExecPlans(schedule, {});
  if (!plans) return plans.failure();
  const std::string order = CheckNcclOrder(schedule, plans.value());
  if (!order.empty()) {
    return Failure::Infeasible("the schedule's Send/Recv order cannot match in NCCL:\n" + order);
  }
  return plans;
}

}  // namespace

bool GpuExecutorAvailable() { return true; }

const char* ToString(OneSidedEngine e) {
  switch (e) {
    case OneSidedEngine::kAuto:
      return "auto";
    case OneSidedEngine::kNvshmem:
      return "nvshmem";
    case OneSidedEngine::kCopyEngine:
      return "copy-engine";
  }
  return "?";
}

// Destroyed in reverse order: the memory first, then the events, then the streams (the
// destructor has waited for the streams).
struct GpuExecutor::Impl {
  cuda::Stream streams[sp::kNumStreams];
  cuda::Event start, ready;
  cuda::Event end[sp::kNumStreams];
  std::vector<cuda::Event> unit_events;  // per unit (empty when no other stream waits)
  // Tracing: timing events, created on the first SetTrace(true).
  bool trace = false;
  bool traced_run = false;  // the last Run was traced
  cuda::Event trace_start;
  std::vector<cuda::Event> trace_begin, trace_end;
  cuda::DeviceBuffer arena;           // the arena of a two-sided (or compute-only) schedule
  comm::PeerAllocation shared_arena;  // the arena of a one-sided schedule
  cuda::DeviceBuffer signal_src;      // kCopyEngine + signal_by_copy
};

Result<std::unique_ptr<GpuExecutor>> GpuExecutor::Create(sp::Schedule schedule, int rank,
                                                         kernels::DType dtype, int device,
                                                         Transports transports,
                                                         AttentionBackend* attention) {
  auto plans = PlanSchedule(schedule, rank, dtype, attention);
  if (!plans.ok()) return plans.failure();
  std::unique_ptr<GpuExecutor> ex(new GpuExecutor());
  ex->plans_ = std::move(plans).value();
  ex->counters_ = BuildCounterTable(schedule);
  ex->schedule_ = std::move(schedule);
  ex->rank_ = rank;
  ex->device_ = device;
  ex->dtype_ = dtype;
  ex->transports_ = transports;
  ex->attention_ = attention;
  if (auto f = ex->BindTransports()) return *std::move(f);
  cuda::DeviceGuard guard(device);
  ex->impl_ = std::make_unique<Impl>();
  if (auto f = ex->MakeStreamsAndEvents()) return *std::move(f);
  if (auto f = ex->AllocateMemory()) return *std::move(f);
  return Result<std::unique_ptr<GpuExecutor>>(std::move(ex));
}

std::optional<Failure> GpuExecutor::BindTransports() {
  const Transports& t = transports_;
  const sp::RankProgram& prog = schedule_.ranks[rank_];
  const int ranks = schedule_.mesh.ranks();
  const std::string want = std::to_string(rank_) + " of " + std::to_string(ranks);
  // Transports the program needs (none for a compute-only replay).
  for (const sp::Op& o : prog.ops) {
    if (t.compute_only) break;
    if (o.kind != sp::OpKind::kSend && o.kind != sp::OpKind::kRecv) continue;
    comm::NcclComm* c = o.stream == sp::Stream::kCommInter ? t.inter : t.intra;
    if (c == nullptr) {
      return Failure::InvalidArgument(std::string("the schedule sends on the ") +
                                          sp::ToString(o.stream) +
                                          " stream but no NCCL communicator was given for it",
                                      "transports");
    }
    if (c->size() != ranks || c->rank() != rank_) {
      return Failure::InvalidArgument("NCCL communicator is rank " + std::to_string(c->rank()) +
                                          " of " + std::to_string(c->size()) +
                                          ", the schedule wants rank " + want,
                                      "transports");
    }
  }
  symmetric_ = plans_[rank_].uses_nvshmem && !t.compute_only;
  if (!symmetric_) return std::nullopt;
  comm::PeerArena* heap = t.peers != nullptr ? t.peers : t.shmem;
  if (heap == nullptr) {
    return Failure::Unavailable(
        "one-sided schedule but no NVSHMEM transport: " + comm::NvshmemUnavailableReason(),
        "transports");
  }
  if (heap->size() != ranks || heap->rank() != rank_) {
    return Failure::InvalidArgument(std::string(t.peers ? "peer arena" : "NVSHMEM PE") + " rank " +
                                        std::to_string(heap->rank()) + " of " +
                                        std::to_string(heap->size()) + " does not match rank " +
                                        want,
                                    "transports");
  }
  peer_arena_ = heap;
  OneSidedEngine engine = t.engine;
  if (t.peers != nullptr) {
    if (engine == OneSidedEngine::kNvshmem) {
      return Failure::InvalidArgument(
          "the NVSHMEM engine needs the symmetric heap (Transports::shmem), not a peer "
          "arena (Transports::peers)",
          "engine");
    }
    engine = OneSidedEngine::kCopyEngine;
  }
  if (engine == OneSidedEngine::kNvshmem && t.shmem == nullptr) {
    return Failure::InvalidArgument("the NVSHMEM engine needs Transports::shmem", "engine");
  }
  if (engine != OneSidedEngine::kNvshmem) {
    auto slots = BuildSlotSignals(schedule_);
    if (slots.ok()) {
      slots_ = std::move(slots).value();
      engine = OneSidedEngine::kCopyEngine;
    } else if (engine == OneSidedEngine::kCopyEngine) {
      return Failure::Infeasible(
          "the copy-engine engine cannot signal this schedule: " + slots.failure().ToString(),
          "engine");
    } else {
      engine = OneSidedEngine::kNvshmem;  // the same decision on every rank (schedule-wide)
    }
  }
  engine_ = engine;
  return std::nullopt;
}

std::optional<Failure> GpuExecutor::MakeStreamsAndEvents() {
  Impl& im = *impl_;
  int lo = 0, hi = 0;
  DS_CHECK_CUDA(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  const int comm_sms = schedule_.config.comm_sms;
  if (comm_sms > 0) {
    // The compute stream in an SM partition (sm_partition.h), the rest for the comm streams.
    auto sms = ComputeSmsForDevice(device_, comm_sms);
    if (!sms.ok()) return sms.failure();
    auto st = CreatePartitionStream(device_, *sms, lo);
    if (!st.ok()) return st.failure();
    im.streams[0] = cuda::Stream::Adopt(static_cast<cudaStream_t>(*st));
    compute_sms_ = *sms;
  } else {
    im.streams[0] = cuda::Stream::Create(lo);
  }
  // Comm streams at the highest priority: their kernels are short and gate other ranks.
  for (int s = 1; s < sp::kNumStreams; ++s) im.streams[s] = cuda::Stream::Create(hi);
  for (cuda::Event& e : im.end) e = cuda::Event::Create();
  im.start = cuda::Event::Create();
  im.ready = cuda::Event::Create();
  const ExecPlan& plan = plans_[rank_];
  im.unit_events.resize(plan.units.size());
  for (size_t u = 0; u < plan.units.size(); ++u) {
    if (plan.units[u].record_event) im.unit_events[u] = cuda::Event::Create();
  }
  return std::nullopt;
}

std::optional<Failure> GpuExecutor::AllocateMemory() {
  Impl& im = *impl_;
  const ExecPlan& plan = plans_[rank_];
  if (plan.arena_bytes > 0 && symmetric_) {
    im.shared_arena = comm::PeerAllocation::Allocate(peer_arena_, plan.arena_bytes);  // zeroed
    arena_ = static_cast<char*>(im.shared_arena.get());
  } else if (plan.arena_bytes > 0) {
    auto a = cuda::DeviceBuffer::Allocate(plan.arena_bytes);
    if (!a.ok()) return Failure::Unavailable("executor arena: " + a.failure().message, "memory");
    im.arena = std::move(a).value();
    arena_ = im.arena.data();
  }
  if (transports_.compute_only && plan.arena_bytes > 0) {
    const int64_t n = plan.arena_bytes / 2;
    FillNoise16<<<static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096)), 256>>>(
        reinterpret_cast<uint16_t*>(arena_), n, dtype_ == kernels::DType::kFloat16);
    DS_CHECK_CUDA(cudaGetLastError());
    DS_CHECK_CUDA(cudaDeviceSynchronize());
  }
  if (engine_ == OneSidedEngine::kCopyEngine) (void)internal::MemOps();  // fail here, not in Run
  if (engine_ == OneSidedEngine::kCopyEngine && transports_.signal_by_copy) {
    const size_t words = std::max<size_t>(schedule_.ranks[rank_].ops.size(), 1);
    auto b = cuda::DeviceBuffer::Allocate(words * sizeof(uint64_t));
    if (!b.ok()) return Failure::Unavailable("signal words: " + b.failure().message, "memory");
    im.signal_src = std::move(b).value();
    DS_CHECK_CUDA(cudaMemset(im.signal_src.data(), 0, im.signal_src.bytes()));
    signal_src_ = reinterpret_cast<uint64_t*>(im.signal_src.data());
  }
  return std::nullopt;
}

GpuExecutor::~GpuExecutor() {
  if (!impl_) return;
  cuda::DeviceGuard guard(device_, std::nothrow);
  for (const cuda::Stream& s : impl_->streams) {
    if (s && cudaStreamSynchronize(s.get()) != cudaSuccess) (void)cudaGetLastError();
  }
  impl_.reset();
}

void GpuExecutor::SetTrace(bool on) {
  Impl& im = *impl_;
  if (on && !im.trace_start) {
    cuda::DeviceGuard guard(device_);
    const size_t n = plans_[rank_].units.size();
    im.trace_start = cuda::Event::Create(cudaEventDefault);
    im.trace_begin.resize(n);
    im.trace_end.resize(n);
    for (size_t u = 0; u < n; ++u) {
      im.trace_begin[u] = cuda::Event::Create(cudaEventDefault);
      im.trace_end[u] = cuda::Event::Create(cudaEventDefault);
    }
  }
  im.trace = on;
}

bool GpuExecutor::trace() const { return impl_->trace; }

Result<std::vector<UnitTiming>> GpuExecutor::LastTimeline() const {
  const Impl& im = *impl_;
  if (!im.traced_run) {
    return Failure::InvalidArgument("no traced layer has run (SetTrace(true), then Run)", "trace");
  }
  cuda::DeviceGuard guard(device_);
  std::vector<UnitTiming> out;
  for (size_t u = 0; u < im.trace_end.size(); ++u) {
    DS_CHECK_CUDA(cudaEventSynchronize(im.trace_end[u].get()));
    float b = 0, e = 0;
    DS_CHECK_CUDA(cudaEventElapsedTime(&b, im.trace_start.get(), im.trace_begin[u].get()));
    DS_CHECK_CUDA(cudaEventElapsedTime(&e, im.trace_start.get(), im.trace_end[u].get()));
    out.push_back(UnitTiming{static_cast<int>(u), b, e});
  }
  return out;
}

char* GpuExecutor::BufferBase(int buffer, const LayerIo& io) const {
  const ExecPlan& plan = plans_[rank_];
  if (plan.offset[buffer] >= 0) return arena_ + plan.offset[buffer];
  DS_CHECK(plan.binding[buffer] != UserBinding::kNone, "sp executor: buffer ", buffer,
           " has neither an arena offset nor a binding");
  return UserPointer(plan.binding[buffer], io);
}

StridedView GpuExecutor::View(const sp::Region& r, const LayerIo& io) const {
  const sp::BufferDecl& d = schedule_.ranks[rank_].buffers[r.buffer];
  StridedView v;
  v.batch = schedule_.shape.batch;
  v.tokens = r.tokens;
  v.heads = r.heads;
  v.width = d.width;
  v.stride_h = d.width;
  v.stride_t = d.heads * d.width;
  v.stride_b = d.tokens * d.heads * d.width;
  v.data = BufferBase(r.buffer, io) + RegionByteOffset(r, d);
  return v;
}

void GpuExecutor::Run(const LayerIo& io, void* stream) {
  const ExecPlan& plan = plans_[rank_];
  const sp::RankProgram& prog = schedule_.ranks[rank_];
  for (size_t b = 0; b < prog.buffers.size(); ++b) {
    const UserBinding bind = plan.binding[b];
    DS_CHECK(bind == UserBinding::kNone || UserPointer(bind, io) != nullptr,
             "sp executor: LayerIo.", ToString(bind), " is null");
  }
  cuda::DeviceGuard guard(device_);
  if (engine_ == OneSidedEngine::kCopyEngine && peer_base_.empty()) {
    // Every rank's arena has been allocated by the first layer (LocalPeers allocates per rank).
    for (int pe = 0; pe < schedule_.mesh.ranks(); ++pe) {
      peer_base_.push_back(static_cast<char*>(peer_arena_->PeerAddress(arena_, pe)));
    }
  }
  Impl& im = *impl_;
  cudaStream_t user = static_cast<cudaStream_t>(stream);
  cudaStream_t compute = im.streams[0].get();
  DS_CHECK_CUDA(cudaEventRecord(im.start.get(), user));
  DS_CHECK_CUDA(cudaStreamWaitEvent(compute, im.start.get(), 0));
  const bool trace = im.trace;
  if (trace) DS_CHECK_CUDA(cudaEventRecord(im.trace_start.get(), compute));
  // Inputs that live in the arena (one-sided put targets): copy in. Buffers with an initial
  // value (in the arena, or the caller's out if the schedule accumulates in it): fill.
  for (size_t b = 0; b < prog.buffers.size(); ++b) {
    const sp::BufferDecl& d = prog.buffers[b];
    const UserBinding bind = plan.binding[b];
    char* base = BufferBase(static_cast<int>(b), io);
    if (plan.offset[b] >= 0 && IsInput(bind)) {
      DS_CHECK_CUDA(cudaMemcpyAsync(base, UserPointer(bind, io), plan.bytes[b],
                                    cudaMemcpyDeviceToDevice, compute));
    } else if (d.init == sp::BufferInit::kZero) {
      DS_CHECK_CUDA(cudaMemsetAsync(base, 0, plan.bytes[b], compute));
    } else if (d.init == sp::BufferInit::kNegInf) {
      FillNegInf(base, plan.bytes[b], d.element_bytes, dtype_, compute);
    }
  }
  DS_CHECK_CUDA(cudaEventRecord(im.ready.get(), compute));
  for (int s = 1; s < sp::kNumStreams; ++s) {
    DS_CHECK_CUDA(cudaStreamWaitEvent(im.streams[s].get(), im.ready.get(), 0));
  }

  for (size_t u = 0; u < plan.units.size(); ++u) {
    const IssueUnit& unit = plan.units[u];
    cudaStream_t st = im.streams[static_cast<int>(unit.stream)].get();
    for (int w : unit.wait_units) {
      DS_CHECK_CUDA(cudaStreamWaitEvent(st, im.unit_events[w].get(), 0));
    }
    if (trace) DS_CHECK_CUDA(cudaEventRecord(im.trace_begin[u].get(), st));
    Issue(static_cast<int>(u), io);
    if (trace) DS_CHECK_CUDA(cudaEventRecord(im.trace_end[u].get(), st));
    if (unit.record_event) DS_CHECK_CUDA(cudaEventRecord(im.unit_events[u].get(), st));
  }
  for (int s = 0; s < sp::kNumStreams; ++s) {
    DS_CHECK_CUDA(cudaEventRecord(im.end[s].get(), im.streams[s].get()));
    DS_CHECK_CUDA(cudaStreamWaitEvent(user, im.end[s].get(), 0));
  }
  // Outputs that live in the arena: copy out on the caller's stream.
  for (size_t b = 0; b < prog.buffers.size(); ++b) {
    const UserBinding bind = plan.binding[b];
    if (plan.offset[b] < 0 || bind == UserBinding::kNone || IsInput(bind)) continue;
    DS_CHECK_CUDA(cudaMemcpyAsync(UserPointer(bind, io), arena_ + plan.offset[b], plan.bytes[b],
                                  cudaMemcpyDeviceToDevice, user));
  }
  im.traced_run = trace;
  ++layers_;
}

void GpuExecutor::Issue(int unit_index, const LayerIo& io) {
  const ExecPlan& plan = plans_[rank_];
  const IssueUnit& unit = plan.units[unit_index];
  const sp::RankProgram& prog = schedule_.ranks[rank_];
  cudaStream_t st = impl_->streams[static_cast<int>(unit.stream)].get();
  const int64_t batch = schedule_.shape.batch;
  comm::NcclComm* nccl =
      unit.stream == sp::Stream::kCommInter ? transports_.inter : transports_.intra;
  const bool group = unit.ops.size() > 1 && nccl != nullptr;
  bool grouped_nccl = false;
  for (int i : unit.ops) {
    const sp::OpKind k = prog.ops[i].kind;
    grouped_nccl = grouped_nccl || k == sp::OpKind::kSend || k == sp::OpKind::kRecv;
  }
  if (group && grouped_nccl) nccl->GroupStart();
  for (int i : unit.ops) {
    const sp::Op& o = prog.ops[i];
    if (transports_.compute_only && IsTransfer(o.kind)) continue;
    switch (o.kind) {
      case sp::OpKind::kSend: {
        const sp::BufferDecl& d = prog.buffers[o.src.buffer];
        nccl->Send(BufferBase(o.src.buffer, io) + RegionByteOffset(o.src, d),
                   sp::RegionBytes(o.src, d, batch), o.peer, st);
        break;
      }
      case sp::OpKind::kRecv: {
        const sp::BufferDecl& d = prog.buffers[o.dst.buffer];
        nccl->Recv(BufferBase(o.dst.buffer, io) + RegionByteOffset(o.dst, d),
                   sp::RegionBytes(o.dst, d, batch), o.peer, st);
        break;
      }
      case sp::OpKind::kPut:
      case sp::OpKind::kSignal:
      case sp::OpKind::kWait:
        if (engine_ == OneSidedEngine::kCopyEngine) {
          IssueCopyEngine(i, io, st);
          break;
        }
        IssueNvshmem(i, io, st);
        break;
      case sp::OpKind::kAttention: {
        AttentionArgs a;
        a.q = View(o.src, io);
        a.k = View(o.key, io);
        a.v = View(o.value, io);
        a.out = View(o.dst, io);
        a.lse = View(o.dst_lse, io);
        a.dtype = dtype_;
        a.scale = 1.0 / std::sqrt(static_cast<double>(schedule_.shape.head_dim));
        attention_->Attention(a, st);
        break;
      }
      case sp::OpKind::kMerge:
        LaunchMerge(View(o.dst, io), View(o.dst_lse, io), View(o.src, io), View(o.src_lse, io),
                    batch, dtype_, st);
        break;
      case sp::OpKind::kPack:
      case sp::OpKind::kUnpack:
      case sp::OpKind::kCopy:
        LaunchLayoutCopy(View(o.src, io), View(o.dst, io),
                         DTypeOfBuffer(prog.buffers[o.src.buffer], dtype_), batch, st);
        break;
    }
  }
  if (group && grouped_nccl) nccl->GroupEnd();
}

}  // namespace ditscale::runtime
