// The one-sided engines of the GPU executor (gpu_executor.h, OneSidedEngine): NVSHMEM's
// put-with-signal, and copy-engine copies with stream memory operations on the signal words.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/comm/peer_arena.h"
#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/runtime/internal/stream_mem_ops.h"

namespace ditscale::runtime {


char* GpuExecutor::PutTarget(const sp::Op& o, char* peer_arena) const {
  const sp::BufferDecl& dd = schedule_.ranks[o.peer].buffers[o.dst.buffer];
  return peer_arena + plans_[o.peer].offset[o.dst.buffer] + RegionByteOffset(o.dst, dd);
}

char* GpuExecutor::PutSource(const sp::Op& o, const LayerIo& io, int64_t* bytes) const {
  const sp::BufferDecl& sd = schedule_.ranks[rank_].buffers[o.src.buffer];
  *bytes = sp::RegionBytes(o.src, sd, schedule_.shape.batch);
  return BufferBase(o.src.buffer, io) + RegionByteOffset(o.src, sd);
}

void GpuExecutor::IssueNvshmem(int op, const LayerIo& io, void* stream) {
  const ExecPlan& plan = plans_[rank_];
  const sp::Op& o = schedule_.ranks[rank_].ops[op];
  auto* words = reinterpret_cast<uint64_t*>(arena_ + plan.signal_offset);
  switch (o.kind) {
    case sp::OpKind::kPut: {
      const int c =
          o.counter.empty() ? static_cast<int>(counters_.names.size()) : counters_.index(o.counter);
      int64_t bytes = 0;
      const char* src = PutSource(o, io, &bytes);
      transports_.shmem->PutSignal(PutTarget(o, arena_), src, bytes, words + c,
                                   o.counter.empty() ? 0 : static_cast<uint64_t>(o.count), o.peer,
                                   stream);
      break;
    }
    case sp::OpKind::kSignal:
      transports_.shmem->Signal(words + counters_.index(o.counter), static_cast<uint64_t>(o.count),
                                o.peer, stream);
      break;
    case sp::OpKind::kWait: {
      const int c = counters_.index(o.counter);
      // Signal words are never reset: layer L waits for L * (per-layer growth) + count.
      const uint64_t target =
          static_cast<uint64_t>(layers_) * counters_.per_layer_total[rank_][c] + o.count;
      transports_.shmem->WaitGE(words + c, target, stream);
      break;
    }
    default:
      DS_FAIL("sp executor: op ", op, " is not one-sided");
  }
}

void GpuExecutor::IssueCopyEngine(int op, const LayerIo& io, void* stream) {
  const ExecPlan& plan = plans_[rank_];
  const sp::Op& o = schedule_.ranks[rank_].ops[op];
  auto st = static_cast<cudaStream_t>(stream);
  const internal::StreamMemOps& mem = internal::MemOps();
  auto word_value = [&](int64_t value, int64_t per_layer) {
    return static_cast<cuuint64_t>(layers_ * per_layer + value);  // never reset, as NVSHMEM's
  };
  if (o.kind == sp::OpKind::kWait) {
    for (const SlotWait& w : slots_.waits[rank_][op]) {
      const auto addr =
          reinterpret_cast<CUdeviceptr>(arena_ + plan.signal_offset + w.slot * sizeof(uint64_t));
      DS_CHECK_CU(mem.wait(st, addr, word_value(w.value, w.per_layer), CU_STREAM_WAIT_VALUE_GEQ));
    }
    return;
  }
  DS_CHECK(o.kind == sp::OpKind::kPut || o.kind == sp::OpKind::kSignal, "sp executor: op ", op,
           " is not one-sided");
  char* peer = peer_base_[o.peer];
  const SlotWrite& w = slots_.writes[rank_][op];
  if (peer == nullptr) {
    // Not reachable by load/store (another host): NVSHMEM's put-with-signal, SETTING the same
    // per-sender word (a kernel: it waits for the SMs, as NVSHMEM's transfers always do).
    DS_CHECK(transports_.shmem != nullptr, "sp executor: rank ", rank_, " cannot reach rank ",
             o.peer,
             "'s arena by load/store and has no NVSHMEM transport for it (ranks of one process on "
             "devices without peer access?)");
    const int64_t word = w.slot >= 0 ? w.slot : slots_.words;  // the scratch word: no signal
    auto* sig = reinterpret_cast<uint64_t*>(arena_ + plan.signal_offset) + word;
    const uint64_t value = w.slot >= 0 ? word_value(w.value, w.per_layer) : 0;
    // Untested across hosts (no multi-host lease yet): the words stay monotone as long as
    // NVSHMEM delivers one PE's signals to a peer in issue order.
    if (o.kind == sp::OpKind::kPut) {
      int64_t bytes = 0;
      const char* src = PutSource(o, io, &bytes);
      transports_.shmem->PutSignal(PutTarget(o, arena_), src, bytes, sig, value, o.peer, stream,
                                   true);
    } else {
      transports_.shmem->Signal(sig, value, o.peer, stream, true);
    }
    return;
  }
  if (o.kind == sp::OpKind::kPut) {
    int64_t bytes = 0;
    const char* src = PutSource(o, io, &bytes);
    if (bytes > 0) {
      DS_CHECK_CUDA(cudaMemcpyAsync(PutTarget(o, peer), src, bytes, cudaMemcpyDefault, st));
    }
  }
  if (w.slot < 0) return;
  char* word = peer + plan.signal_offset + w.slot * sizeof(uint64_t);
  if (signal_src_ != nullptr) {
    // The value into our own word, then 8 bytes by the copy engine after the put's copy.
    DS_CHECK_CU(mem.write(st, reinterpret_cast<CUdeviceptr>(signal_src_ + op),
                          word_value(w.value, w.per_layer), CU_STREAM_WRITE_VALUE_DEFAULT));
    DS_CHECK_CUDA(cudaMemcpyAsync(word, signal_src_ + op, sizeof(uint64_t), cudaMemcpyDefault, st));
    return;
  }
  // The default flags fence the stream's earlier writes (the copy above) before the word.
  DS_CHECK_CU(mem.write(st, reinterpret_cast<CUdeviceptr>(word), word_value(w.value, w.per_layer),
                        CU_STREAM_WRITE_VALUE_DEFAULT));
}

}  // namespace ditscale::runtime
