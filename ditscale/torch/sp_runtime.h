// The sequence-parallel attention runtime as a TorchScript class,
// `torch.classes.ditscale.SpRuntime` (driven by python/ditscale/sp/gpu_runtime.py): one per process
// group. It owns the NCCL communicators (one per comm stream kind: intra-machine and
// inter-machine), the NVSHMEM state (optional, created on first use of a one-sided strategy),
// cuDNN attention through ATen as the executor's attention backend (sp_aten_attention.h), and
// one GpuExecutor per (configuration, shape, dtype), created on first use and reused.
// Configurations are the ops' configuration texts (sp_config_text.h). Compiled only when
// ditscale's CUDA kernels are built and torch has CUDA.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ditscale/comm/nccl_comm.h"
#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/torch/sp_aten_attention.h"
#include "ditscale/torch/sp_config_text.h"

namespace ditscale::torch_ext {

struct SpRuntime : torch::CustomClassHolder {
  // Collective: every rank builds the same communicators in the same order. The mesh is
  // machines x gpus_per_machine == world ranks; ids from sp_nccl_id() on rank 0, broadcast;
  // net_channels_per_peer: NCCL channels per peer of the inter-machine communicator, [0, 64]
  // (0 = NCCL's choice).
  SpRuntime(int64_t rank, int64_t world, int64_t device, int64_t machines, int64_t gpus_per_machine,
            at::Tensor nccl_id_intra, at::Tensor nccl_id_inter, double timeout_s,
            int64_t net_channels_per_peer);

  // Collective over all ranks; `id` from sp_nvshmem_id() on rank 0, broadcast.
  // NVSHMEM is process-global: every SpRuntime of the process (one per mesh over the same
  // ranks) shares one instance; a second process group of another size cannot use it.
  void init_nvshmem(at::Tensor id);
  bool has_nvshmem() const { return shmem_ != nullptr; }

  // Runs one attention layer; returns [out, text_out] (text_out empty when there are no joint
  // tokens). q, k, v: [B, S_local, H, D] CUDA tensors of this rank's shard; seq_total: S of all
  // ranks; text_*: [B, T, H, D] or undefined.
  std::vector<at::Tensor> attention(SpConfigText config, int64_t seq_total, at::Tensor q,
                                    at::Tensor k, at::Tensor v, std::optional<at::Tensor> tq,
                                    std::optional<at::Tensor> tk, std::optional<at::Tensor> tv);

  // Waits for the current stream with hang detection on the communicators (debugging aid).
  void synchronize(double timeout_s);

  // The schedule of the cached executors of a configuration (every shape it ran) as text
  // (PrintPlan), with transport, engine, SM partition, arena bytes and the attention backend.
  std::string describe(SpConfigText config);

  // Tracing (diagnosis): every executor records per-unit timing events while on.
  void set_trace(bool on);

  // The per-unit timeline of the last traced layer of a configuration (every shape that ran
  // traced), as text (runtime::PrintTimeline); waits for that layer.
  std::string timeline(SpConfigText config);

  int64_t executors() const { return static_cast<int64_t>(executors_.size()); }
  void clear() { executors_.clear(); }

 private:
  struct Entry {
    SpRunArgs args;
    std::unique_ptr<runtime::GpuExecutor> executor;
  };

  std::unique_ptr<comm::NcclComm> MakeComm(const at::Tensor& id, const char* what, double timeout_s,
                                           int channels);
  runtime::GpuExecutor& Executor(const SpRunArgs& args, const sp::AttentionShape& s,
                                 kernels::DType dt);

  int rank_, world_, device_;
  sp::SpMesh mesh_;
  // Attention waves for the schedule builder. Every rank must build the same schedule, so a mesh
  // mixes only GPUs of one SM count (the lent hosts do).
  int sm_count_;
  AtenAttention attention_;
  std::unique_ptr<comm::NcclComm> intra_, inter_;
  std::shared_ptr<comm::Nvshmem> shmem_;
  // Executors before the transports in destruction order: declared after them. Keyed by
  // SpRunArgs::Key(), the shape and the dtype.
  std::map<std::string, Entry> executors_;
  bool trace_ = false;
};

}  // namespace ditscale::torch_ext
