// SpRuntime (sp_runtime.h): communicators, NVSHMEM and the cached executors of one mesh.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <sstream>

#include "ditscale/sp/strategies.h"
#include "ditscale/torch/sp_ids.h"
#include "ditscale/torch/sp_layer_io.h"
#include "ditscale/torch/sp_runtime.h"

namespace ditscale::torch_ext {

using at::Tensor;

SpRuntime::SpRuntime(int64_t rank, int64_t world, int64_t device, int64_t machines,
                     int64_t gpus_per_machine, Tensor nccl_id_intra, Tensor nccl_id_inter,
                     double timeout_s, int64_t net_channels_per_peer)
    : rank_(static_cast<int>(rank)),
      world_(static_cast<int>(world)),
      device_(static_cast<int>(device)),
      mesh_{static_cast<int>(machines), static_cast<int>(gpus_per_machine)},
      sm_count_(at::cuda::getDeviceProperties(static_cast<int>(device))->multiProcessorCount),
      attention_(static_cast<int>(device)) {
  TORCH_CHECK(machines >= 1 && gpus_per_machine >= 1 && machines * gpus_per_machine == world,
              "ditscale.sp: mesh ", machines, " x ", gpus_per_machine, " does not have ", world,
              " ranks");
  TORCH_CHECK(rank >= 0 && rank < world, "ditscale.sp: rank ", rank, " not in [0, ", world, ")");
  CheckIntArg("ditscale.sp", "net_channels_per_peer", net_channels_per_peer, 0, 64);
  // Collective: every rank builds the same communicators in the same order.
  if (gpus_per_machine > 1) intra_ = MakeComm(nccl_id_intra, "intra", timeout_s, 0);
  if (machines > 1) {
    inter_ = MakeComm(nccl_id_inter, "inter", timeout_s, static_cast<int>(net_channels_per_peer));
  }
}

void SpRuntime::init_nvshmem(Tensor id) {
  if (shmem_) return;
  static std::weak_ptr<comm::Nvshmem> process_shmem;
  if (auto existing = process_shmem.lock()) {
    TORCH_CHECK(existing->size() == world_ && existing->rank() == rank_,
                "ditscale.sp: NVSHMEM is already initialised in this process as PE ",
                existing->rank(), " of ", existing->size(), "; this mesh needs rank ", rank_,
                " of ", world_);
    shmem_ = existing;
    return;
  }
  auto s =
      comm::Nvshmem::Init(IdFromTensor<comm::NvshmemId>(id, "nvshmem id"), world_, rank_, device_);
  TORCH_CHECK(s.ok(), "ditscale.sp: NVSHMEM: ", s.failure().ToString());
  shmem_ = std::shared_ptr<comm::Nvshmem>(std::move(s).value());
  process_shmem = shmem_;
}

std::vector<Tensor> SpRuntime::attention(SpConfigDict config, int64_t seq_total, Tensor q, Tensor k,
                                         Tensor v, std::optional<Tensor> tq,
                                         std::optional<Tensor> tk, std::optional<Tensor> tv) {
  const char* who = "ditscale.sp.attention";
  const SpRunArgs args = RunArgsOf(config, who);
  TORCH_CHECK(q.is_cuda() && q.device().index() == device_, who, ": q must be on cuda:", device_);
  const sp::AttentionShape shape = CheckedShape(who, "S_local", q, k, v, tq, tk, tv, seq_total);
  const bool joint = tq.has_value() && tq->defined();
  c10::cuda::CUDAGuard guard(q.device());
  runtime::GpuExecutor& ex = Executor(args, shape, DTypeOf(q.scalar_type(), who));
  const sp::RankProgram& p = ex.schedule().ranks[rank_];
  TORCH_CHECK(p.image_token_count == q.size(1), who, ": rank ", rank_, " holds ", q.size(1),
              " image tokens, but strategy '", sp::StrategyName(args.config.strategy),
              "' on this mesh ", "gives it ", p.image_token_count, " of ", seq_total,
              " (shards must follow ditscale.sp.shard_range)");
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  Tensor out = at::empty_like(qc);
  Tensor tqc, tkc, tvc, tout;
  if (joint) {
    tqc = tq->contiguous();
    tkc = tk->contiguous();
    tvc = tv->contiguous();
    tout = at::empty_like(tqc);
  }
  auto stream = c10::cuda::getCurrentCUDAStream(device_);
  ex.Run(IoOf(qc, kc, vc, out, tqc, tkc, tvc, tout), stream.stream());
  return {out, joint ? tout : at::empty({0}, q.options())};
}

void SpRuntime::synchronize(double timeout_s) {
  auto stream = c10::cuda::getCurrentCUDAStream(device_);
  for (comm::NcclComm* c : {intra_.get(), inter_.get()}) {
    if (!c) continue;
    c->set_timeout_s(timeout_s);
    auto r = c->Synchronize(stream.stream());
    TORCH_CHECK(r.ok(), "ditscale.sp: ", r.failure().ToString());
  }
  if (shmem_) {
    auto r = shmem_->Synchronize(stream.stream(), timeout_s);
    TORCH_CHECK(r.ok(), "ditscale.sp: ", r.failure().ToString());
  }
  stream.synchronize();
}

std::string SpRuntime::describe(SpConfigDict config) {
  const std::string layer = RunArgsOf(config, "ditscale.sp.describe").LayerKey();
  std::ostringstream os;
  for (auto& [key, e] : executors_) {
    if (e.args.LayerKey() != layer) continue;
    const runtime::GpuExecutor& ex = *e.executor;
    os << "transport " << sp::TransportDescription(ex.schedule().config);
    if (ex.plan().uses_nvshmem) os << ", one-sided engine " << runtime::ToString(ex.engine());
    if (ex.compute_sms() > 0) {
      os << ", compute stream on " << ex.compute_sms() << " of " << sm_count_ << " SMs";
    }
    os << "\n";
    os << runtime::PrintPlan(ex.schedule(), ex.plan());
    os << "arena bytes " << ex.arena_bytes() << ", attention " << attention_.backend() << "\n";
  }
  return os.str();
}

void SpRuntime::set_trace(bool on) {
  trace_ = on;
  for (auto& [key, e] : executors_) e.executor->SetTrace(on);
}

std::string SpRuntime::timeline(SpConfigDict config) {
  const std::string layer = RunArgsOf(config, "ditscale.sp.timeline").LayerKey();
  std::ostringstream os;
  for (auto& [key, e] : executors_) {
    if (e.args.LayerKey() != layer) continue;
    auto t = e.executor->LastTimeline();
    if (!t.ok()) continue;
    const sp::Schedule& s = e.executor->schedule();
    os << "S " << s.shape.seq_tokens << " + " << s.shape.text_tokens << " text, transport "
       << sp::TransportDescription(s.config) << "\n"
       << runtime::PrintTimeline(s, e.executor->plan(), t.value());
  }
  return os.str();
}

std::unique_ptr<comm::NcclComm> SpRuntime::MakeComm(const Tensor& id, const char* what,
                                                    double timeout_s, int channels) {
  auto c = comm::NcclComm::Create(IdFromTensor<comm::NcclId>(id, what), world_, rank_, device_,
                                  timeout_s, channels);
  TORCH_CHECK(c.ok(), "ditscale.sp: NCCL ", what, " communicator: ", c.failure().ToString());
  return std::move(c).value();
}

runtime::GpuExecutor& SpRuntime::Executor(const SpRunArgs& args, const sp::AttentionShape& s,
                                          kernels::DType dt) {
  std::ostringstream key;
  key << args.Key() << " b" << s.batch << " s" << s.seq_tokens << " t" << s.text_tokens << " h"
      << s.heads << "/" << s.kv_heads << " d" << s.head_dim << " dt" << static_cast<int>(dt);
  auto it = executors_.find(key.str());
  if (it != executors_.end()) return *it->second.executor;
  if (args.config.one_sided) {
    const std::string why = sp_nvshmem_unavailable();
    TORCH_CHECK(shmem_ != nullptr, "ditscale.sp: one-sided strategy without NVSHMEM (",
                why.empty() ? std::string("call init_nvshmem first") : why, ")");
  }
  sp::SpConfig cfg = args.config;
  // Waves of the attention kernel (cuDNN's forward: one 128-row CTA per SM at a time,
  // lab/results/sp-attn-split_h200_2026-12/), for strategies that cut the call on whole waves.
  cfg.attention_slots = sm_count_;
  auto sched = sp::BuildSchedule(mesh_, cfg, s);
  TORCH_CHECK(sched.ok(), "ditscale.sp.attention: ", sched.failure().ToString());
  runtime::Transports t{intra_.get(), inter_.get(), shmem_.get()};
  t.engine = args.engine;
  t.signal_by_copy = args.signal_by_copy;
  auto ex =
      runtime::GpuExecutor::Create(std::move(sched).value(), rank_, dt, device_, t, &attention_);
  TORCH_CHECK(ex.ok(), "ditscale.sp.attention: ", ex.failure().ToString());
  Entry& slot = executors_[key.str()];
  slot.args = args;
  slot.executor = std::move(ex).value();
  if (trace_) slot.executor->SetTrace(true);
  return *slot.executor;
}

}  // namespace ditscale::torch_ext
