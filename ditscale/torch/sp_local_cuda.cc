// The GPU executor's one-GPU diagnostics as torch ops (sp_diagnostics.h): sp_run_local.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/runtime/local_peers.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/torch/sp_aten_attention.h"
#include "ditscale/torch/sp_diagnostics.h"
#include "ditscale/torch/sp_layer_io.h"

namespace ditscale::torch_ext {

using at::Tensor;

namespace {

using Executors = std::vector<std::unique_ptr<runtime::GpuExecutor>>;

// Warm-up, every rank's compute alone (no transfers, so no waits): the attention backend's
// one-time calibration (it reads a result back: a stream synchronization) and cuDNN's plan
// building for every call shape happen here. In the real layers one host thread issues all
// ranks, so a synchronizing call while rank 0's streams wait for rank 1's signals, which are not
// issued yet, would never return.
void WarmUp(const char* who, const sp::Schedule& schedule, const sp::AttentionShape& shape,
            kernels::DType dt, int device, AtenAttention& attention, bool joint,
            const at::TensorOptions& opts) {
  runtime::Transports replay;
  replay.compute_only = true;
  auto warm_stream = c10::cuda::getStreamFromPool(false, device);
  for (int r = 0; r < static_cast<int>(schedule.ranks.size()); ++r) {
    auto e = runtime::GpuExecutor::Create(schedule, r, dt, device, replay, &attention);
    TORCH_CHECK(e.ok(), who, ": rank ", r, ": ", e.failure().ToString());
    const sp::RankProgram& p = schedule.ranks[r];
    Tensor wq = at::zeros({shape.batch, p.image_token_count, shape.heads, shape.head_dim}, opts);
    Tensor wk = at::zeros({shape.batch, p.image_token_count, shape.kv_heads, shape.head_dim}, opts);
    Tensor wo = at::empty_like(wq), wt, wtk, wto;
    if (joint) {
      wt = at::zeros({shape.batch, shape.text_tokens, shape.heads, shape.head_dim}, opts);
      wtk = at::zeros({shape.batch, shape.text_tokens, shape.kv_heads, shape.head_dim}, opts);
      wto = at::empty_like(wt);
    }
    (*e)->Run(IoOf(wq, wk, wk, wo, wt, wtk, wtk, wto), warm_stream.stream());
    C10_CUDA_CHECK(cudaStreamSynchronize(warm_stream.stream()));
  }
}

// One executor per rank on the copy-engine engine over `peers`; refuses a strategy with
// two-sided transfers on this mesh.
Executors MakeExecutors(const char* who, const sp::Schedule& schedule, const SpRunArgs& args,
                        const sp::SpConfig& cfg, kernels::DType dt, int device,
                        const std::vector<std::unique_ptr<comm::PeerArena>>& peers,
                        AtenAttention& attention) {
  Executors ex;
  for (int r = 0; r < static_cast<int>(peers.size()); ++r) {
    runtime::Transports t;
    t.peers = peers[r].get();
    t.engine = runtime::OneSidedEngine::kCopyEngine;
    t.signal_by_copy = args.signal_by_copy;
    auto e = runtime::GpuExecutor::Create(schedule, r, dt, device, t, &attention);
    TORCH_CHECK(e.ok(), who, ": rank ", r, ": ", e.failure().ToString());
    TORCH_CHECK(!(*e)->plan().uses_nccl, who, ": strategy '", sp::StrategyName(cfg.strategy),
                "' has two-sided transfers on this mesh (they need NCCL: one process per GPU)");
    ex.push_back(std::move(e).value());
  }
  return ex;
}

// Every rank's inputs and outputs: its image-token shard of q, k, v (contiguous copies), the
// whole text stream (joint), and output buffers.
struct LocalIo {
  Tensor qc, tqc, tkc, tvc;
  std::vector<Tensor> qs, ks, vs, outs, touts;
};

LocalIo ShardInputs(const sp::Schedule& schedule, const Tensor& q, const Tensor& k, const Tensor& v,
                    const std::optional<Tensor>& tq, const std::optional<Tensor>& tk,
                    const std::optional<Tensor>& tv, bool joint) {
  LocalIo io;
  io.qc = q.contiguous();
  Tensor kc = k.contiguous(), vc = v.contiguous();
  if (joint) {
    io.tqc = tq->contiguous();
    io.tkc = tk->contiguous();
    io.tvc = tv->contiguous();
  }
  for (const sp::RankProgram& p : schedule.ranks) {
    io.qs.push_back(io.qc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    io.ks.push_back(kc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    io.vs.push_back(vc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    io.outs.push_back(at::empty_like(io.qs.back()));
    io.touts.push_back(joint ? at::empty_like(io.tqc) : Tensor());
  }
  return io;
}

// The full output: each rank's shard at its image tokens (the schedule's placement: TAS and
// torus put a machine's ranks on non-adjacent shards).
Tensor Gather(const sp::Schedule& schedule, const LocalIo& io) {
  Tensor full = at::empty_like(io.qc);
  for (int r = 0; r < static_cast<int>(schedule.ranks.size()); ++r) {
    const sp::RankProgram& p = schedule.ranks[r];
    full.narrow(1, p.image_token_begin, p.image_token_count).copy_(io.outs[r]);
  }
  return full;
}

// Issues `layers` layers, each rank's on its own stream (a rank's Waits block only its streams);
// returns the output after the first layer when there are several (undefined otherwise).
Tensor RunLayers(const Executors& ex, const sp::Schedule& schedule, LocalIo& io,
                 const std::vector<c10::cuda::CUDAStream>& streams,
                 const c10::cuda::CUDAStream& current, int64_t layers) {
  Tensor first;
  for (int64_t l = 0; l < layers; ++l) {
    for (int r = 0; r < static_cast<int>(ex.size()); ++r) {
      ex[r]->Run(
          IoOf(io.qs[r], io.ks[r], io.vs[r], io.outs[r], io.tqc, io.tkc, io.tvc, io.touts[r]),
          streams[r].stream());
    }
    if (l == 0 && layers > 1) {
      for (const auto& st : streams) {
        at::cuda::CUDAEvent done;
        done.record(st);
        done.block(current);
      }
      c10::cuda::CUDAStreamGuard sg(current);
      first = Gather(schedule, io);  // on the caller's stream, after every rank's first layer
      at::cuda::CUDAEvent copied;
      copied.record(current);
      for (const auto& st : streams) copied.block(st);
    }
  }
  return first;
}

// Waits for every rank's stream, failing (without waiting longer) past timeout_s.
void WaitRanks(const char* who, const std::vector<c10::cuda::CUDAStream>& streams,
               double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int r = 0; r < static_cast<int>(streams.size()); ++r) {
    while (true) {
      const cudaError_t e = cudaStreamQuery(streams[r].stream());
      if (e == cudaSuccess) break;
      TORCH_CHECK(e == cudaErrorNotReady, who, ": rank ", r, ": ", cudaGetErrorString(e));
      TORCH_CHECK(std::chrono::steady_clock::now() < deadline, who, ": rank ", r,
                  " did not finish within ", timeout_s,
                  " s (a Wait whose signal never came?); its streams stay blocked: exit the "
                  "process");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
}

// One line on the run: engine, arena per rank, ranks, device, compute SMs.
std::string RunInfo(const SpRunArgs& args, const Executors& ex, int device) {
  std::ostringstream info;
  info << "engine " << runtime::ToString(ex[0]->engine())
       << (args.signal_by_copy ? " (signals by copy)" : "") << ", arena " << ex[0]->arena_bytes()
       << " bytes per rank, " << ex.size() << " ranks on device " << device;
  if (ex[0]->compute_sms() > 0) info << ", compute streams on " << ex[0]->compute_sms() << " SMs";
  return info.str();
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, std::string> sp_run_local(
    SpConfigText config, int64_t machines, int64_t gpus_per_machine, Tensor q, Tensor k, Tensor v,
    std::optional<Tensor> tq, std::optional<Tensor> tk, std::optional<Tensor> tv, int64_t layers,
    double timeout_s) {
  const char* who = "ditscale.sp.run_local";
  SpRunArgs args = RunArgsOf(config, who);
  CheckMesh(who, machines, gpus_per_machine);
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), who, ": q, k, v must be CUDA tensors");
  CheckIntArg(who, "layers", layers, 1, 1000);
  TORCH_CHECK(std::isfinite(timeout_s) && timeout_s > 0 && timeout_s <= 3600, who,
              ": timeout_s: ", timeout_s, " is out of range (0, 3600]");
  const sp::AttentionShape shape = CheckedShape(who, "S", q, k, v, tq, tk, tv, q.size(1));
  const bool joint = tq.has_value() && tq->defined();
  const int device = q.device().index();
  c10::cuda::CUDAGuard guard(q.device());
  const kernels::DType dt = DTypeOf(q.scalar_type(), who);
  sp::SpMesh mesh{static_cast<int>(machines), static_cast<int>(gpus_per_machine)};
  sp::SpConfig cfg = args.config;
  // One-sided on every link: the copy-engine engine over runtime::LocalPeers.
  cfg.one_sided = true;
  cfg.one_sided_inter = true;
  cfg.attention_slots = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  auto sched = sp::BuildSchedule(mesh, cfg, shape);
  TORCH_CHECK(sched.ok(), who, ": ", sched.failure().ToString());
  const sp::Schedule schedule = std::move(sched).value();
  const int n = mesh.ranks();
  auto peers = runtime::MakeLocalPeers(std::vector<int>(n, device));
  AtenAttention attention(device);
  WarmUp(who, schedule, shape, dt, device, attention, joint, q.options());
  const Executors ex = MakeExecutors(who, schedule, args, cfg, dt, device, peers, attention);
  LocalIo io = ShardInputs(schedule, q, k, v, tq, tk, tv, joint);
  auto current = c10::cuda::getCurrentCUDAStream(device);
  std::vector<c10::cuda::CUDAStream> streams;
  for (int r = 0; r < n; ++r) streams.push_back(c10::cuda::getStreamFromPool(false, device));
  at::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(current);
  for (auto& st : streams) inputs_ready.block(st);
  Tensor first = RunLayers(ex, schedule, io, streams, current, layers);
  WaitRanks(who, streams, timeout_s);
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  Tensor last = Gather(schedule, io);
  if (!first.defined()) first = last;
  return {first, last, joint ? at::stack(io.touts) : at::empty({0}, q.options()),
          RunInfo(args, ex, device)};
}

}  // namespace ditscale::torch_ext
