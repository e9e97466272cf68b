// The GPU executor's one-GPU diagnostics as torch ops (sp_diagnostics.h): sp_replay_compute.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <string>
#include <tuple>

#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/torch/sp_aten_attention.h"
#include "ditscale/torch/sp_diagnostics.h"
#include "ditscale/torch/sp_layer_io.h"

namespace ditscale::torch_ext {

using at::Tensor;

std::tuple<Tensor, std::string> sp_replay_compute(SpConfigText config, int64_t machines,
                                                  int64_t gpus_per_machine, int64_t rank,
                                                  int64_t batch, int64_t seq, int64_t text,
                                                  int64_t heads, int64_t kv_heads, int64_t head_dim,
                                                  int64_t iters, int64_t warmup) {
  const char* who = "ditscale.sp.replay_compute";
  const SpRunArgs args = RunArgsOf(config, who);
  CheckMesh(who, machines, gpus_per_machine);
  TORCH_CHECK(at::cuda::is_available(), who, ": no CUDA device");
  CheckIntArg(who, "iters", iters, 1, 10000);
  CheckIntArg(who, "warmup", warmup, 0, 10000);
  // The layer's sizes as for planning (python/src/sp_bindings.cc), before anything is allocated.
  CheckIntArg(who, "batch", batch, 1, 65536);
  CheckIntArg(who, "seq", seq, 1, int64_t{1} << 40);
  CheckIntArg(who, "text", text, 0, int64_t{1} << 40);
  CheckIntArg(who, "heads", heads, 1, 65536);
  CheckIntArg(who, "kv_heads", kv_heads, 0, 65536);
  CheckIntArg(who, "head_dim", head_dim, 1, 4096);
  const int device = c10::cuda::current_device();
  sp::SpMesh mesh{static_cast<int>(machines), static_cast<int>(gpus_per_machine)};
  sp::SpConfig cfg = args.config;
  cfg.attention_slots = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  sp::AttentionShape shape;
  shape.batch = batch;
  shape.seq_tokens = seq;
  shape.text_tokens = text;
  shape.heads = heads;
  shape.kv_heads = kv_heads;
  shape.head_dim = head_dim;
  shape.dtype_bytes = 2;
  auto sched = sp::BuildSchedule(mesh, cfg, shape);
  TORCH_CHECK(sched.ok(), who, ": ", sched.failure().ToString());
  TORCH_CHECK(rank >= 0 && rank < mesh.ranks(), who, ": rank ", rank, " not in [0, ", mesh.ranks(),
              ")");
  const sp::RankProgram prog = sched->ranks[rank];
  AtenAttention attention(device);
  runtime::Transports t;
  t.compute_only = true;
  auto ex = runtime::GpuExecutor::Create(std::move(sched).value(), static_cast<int>(rank),
                                         kernels::DType::kBFloat16, device, t, &attention);
  TORCH_CHECK(ex.ok(), who, ": ", ex.failure().ToString());
  const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA, device);
  const int64_t n = prog.image_token_count, hk = kv_heads > 0 ? kv_heads : heads;
  Tensor q = at::randn({batch, n, heads, head_dim}, opts);
  Tensor k = at::randn({batch, n, hk, head_dim}, opts), v = at::randn_like(k);
  Tensor out = at::empty_like(q);
  Tensor tq, tk, tv, tout;
  if (text > 0) {
    tq = at::randn({batch, text, heads, head_dim}, opts);
    tk = at::randn({batch, text, hk, head_dim}, opts);
    tv = at::randn_like(tk);
    tout = at::empty_like(tq);
  }
  const runtime::LayerIo io = IoOf(q, k, v, out, tq, tk, tv, tout);
  auto stream = c10::cuda::getCurrentCUDAStream(device);
  for (int64_t i = 0; i < warmup; ++i) (*ex)->Run(io, stream.stream());
  Tensor ms = at::empty({iters}, at::kDouble);
  cudaEvent_t a = nullptr, b = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&a));
  C10_CUDA_CHECK(cudaEventCreate(&b));
  for (int64_t i = 0; i < iters; ++i) {
    C10_CUDA_CHECK(cudaEventRecord(a, stream.stream()));
    (*ex)->Run(io, stream.stream());
    C10_CUDA_CHECK(cudaEventRecord(b, stream.stream()));
    C10_CUDA_CHECK(cudaEventSynchronize(b));
    float e = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&e, a, b));
    ms.data_ptr<double>()[i] = static_cast<double>(e);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  (*ex)->SetTrace(true);
  (*ex)->Run(io, stream.stream());
  auto tl = (*ex)->LastTimeline();
  TORCH_CHECK(tl.ok(), who, ": ", tl.failure().ToString());
  return {ms, runtime::PrintTimeline((*ex)->schedule(), (*ex)->plan(), tl.value())};
}

}  // namespace ditscale::torch_ext
