// The sequence-parallel attention runtime as a TorchScript class,
// `torch.classes.ditscale.SpRuntime` (driven by python/ditscale/sp): one per process group. It owns
// the NCCL communicators (one per comm stream kind: intra-machine and inter-machine), the NVSHMEM
// state (optional, created on first use of a one-sided strategy), cuDNN attention through ATen as
// the executor's attention backend, and one GpuExecutor per (configuration, shape, dtype), created
// on first use and reused. Compiled only when ditscale's CUDA kernels are built and torch has CUDA.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <sstream>
#include <thread>
#include <tuple>

#include "ditscale/comm/nccl_comm.h"
#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/runtime/local_peers.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/torch/sp_args.h"

namespace ditscale::torch_ext {
namespace {

using at::Tensor;

template <typename Id>
Id IdFromTensor(const Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.numel() == comm::kUniqueIdBytes,
              "ditscale.sp: ", what, " must be a uint8 tensor of ", comm::kUniqueIdBytes, " bytes");
  Tensor c = t.to(at::kCPU).contiguous();
  Id id;
  std::memcpy(id.bytes.data(), c.data_ptr(), comm::kUniqueIdBytes);
  return id;
}

template <typename Id>
Tensor IdToTensor(const Id& id) {
  Tensor t = at::empty({comm::kUniqueIdBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(t.data_ptr(), id.bytes.data(), comm::kUniqueIdBytes);
  return t;
}

Tensor sp_nccl_id() {
  auto id = comm::NcclNewId();
  TORCH_CHECK(id.ok(), "ditscale.sp: ", id.failure().ToString());
  return IdToTensor(id.value());
}

Tensor sp_nvshmem_id() {
  auto id = comm::NvshmemNewId();
  TORCH_CHECK(id.ok(), "ditscale.sp: ", id.failure().ToString());
  return IdToTensor(id.value());
}

// "" when one-sided transfers can run, else why not.
std::string sp_nvshmem_unavailable() {
  return comm::NvshmemAvailable() ? std::string() : comm::NvshmemUnavailableReason();
}

at::ScalarType ScalarOf(kernels::DType d) {
  switch (d) {
    case kernels::DType::kBFloat16:
      return at::kBFloat16;
    case kernels::DType::kFloat16:
      return at::kHalf;
    default:
      return at::kFloat;
  }
}

// [B, T, H, W] strided view -> a [B, H, T, W] tensor over the same memory.
Tensor AsBhtd(const runtime::StridedView& v, at::ScalarType dtype, int device) {
  return at::from_blob(v.data, {v.batch, v.heads, v.tokens, v.width},
                       {v.stride_b, v.stride_h, v.stride_t, 1},
                       at::TensorOptions().dtype(dtype).device(at::kCUDA, device));
}

// cuDNN attention (flash as the fallback) through ATen, on the executor's compute stream.
class AtenAttention final : public runtime::AttentionBackend {
 public:
  explicit AtenAttention(int device) : device_(device) {}

  void Attention(const runtime::AttentionArgs& a, void* stream) override {
    c10::cuda::CUDAStreamGuard guard(
        c10::cuda::getStreamFromExternal(static_cast<cudaStream_t>(stream), device_));
    const at::ScalarType dt = ScalarOf(a.dtype);
    Tensor out = AsBhtd(a.out, dt, device_);
    Tensor lse = at::from_blob(a.lse.data, {a.lse.batch, a.lse.heads, a.lse.tokens},
                               {a.lse.stride_b, a.lse.stride_h, a.lse.stride_t},
                               at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, device_));
    if (a.q.tokens == 0 || a.q.heads == 0) return;
    if (a.k.tokens == 0) {  // no keys: the partial of an empty block
      out.zero_();
      lse.fill_(-std::numeric_limits<float>::infinity());
      return;
    }
    Tensor q = AsBhtd(a.q, dt, device_);
    Tensor k = AsBhtd(a.k, dt, device_);
    Tensor v = AsBhtd(a.v, dt, device_);
    if (k.size(1) != q.size(1)) {  // grouped queries: expand the kv heads
      const int64_t g = q.size(1) / k.size(1);
      k = k.repeat_interleave(g, 1);
      v = v.repeat_interleave(g, 1);
    }
    if (!checked_) Calibrate(q.options());
    Tensor o, l;
    if (use_cudnn_) {
      try {
        auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, true, 0.0, false,
                                                         false, a.scale);
        o = std::get<0>(r);
        l = std::get<1>(r);
        if (lse_scale_ != 1.0) l = l * lse_scale_;
      } catch (const std::exception& e) {  // a layout or size cuDNN refuses: flash from now on
        TORCH_WARN("ditscale.sp: cuDNN attention failed on q ", q.sizes(), " strides ", q.strides(),
                   " (", e.what(), "); switching to flash attention");
        use_cudnn_ = false;
      }
    }
    if (!use_cudnn_) {
      auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, false, false, a.scale);
      o = std::get<0>(r);
      l = std::get<1>(r);
    }
    out.copy_(o);
    lse.copy_(l.reshape({q.size(0), q.size(1), q.size(2)}));
  }

  std::string backend() const { return use_cudnn_ ? "cudnn" : "flash"; }

 private:
  // Once: does cuDNN attention run here, and in which base is its log-sum-exp? Compared with an
  // fp32 reference on a small random case (the executor's merges need natural logs).
  void Calibrate(const at::TensorOptions& opts) {
    checked_ = true;
    // Deterministic inputs without touching the global RNG.
    auto pattern = [&](int64_t t, double f) {
      return (at::arange(2 * t * 128, opts.dtype(at::kFloat)).reshape({1, 2, t, 128}) * f)
          .sin()
          .to(opts.dtype());
    };
    Tensor q = pattern(64, 0.37), k = pattern(80, 0.53), v = pattern(80, 0.71);
    const double scale = 1.0 / std::sqrt(128.0);
    Tensor ref =
        at::logsumexp(at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-1, -2)) * scale, -1);
    try {
      auto r = at::_scaled_dot_product_cudnn_attention(q, k, v, std::nullopt, true, 0.0, false,
                                                       false, scale);
      Tensor l = std::get<1>(r).reshape({1, 2, 64}).to(at::kFloat);
      const double e_nat = (l - ref).abs().max().item<double>();
      const double e_log2 = (l * std::log(2.0) - ref).abs().max().item<double>();
      if (e_nat < 5e-2) {
        use_cudnn_ = true;
        lse_scale_ = 1.0;
      } else if (e_log2 < 5e-2) {
        use_cudnn_ = true;
        lse_scale_ = std::log(2.0);
      } else {
        use_cudnn_ = false;
        TORCH_WARN("ditscale.sp: cuDNN attention's logsumexp matches neither base (errors ", e_nat,
                   ", ", e_log2, "); using flash attention");
      }
    } catch (const std::exception& e) {
      use_cudnn_ = false;
      TORCH_WARN("ditscale.sp: cuDNN attention unavailable (", e.what(), "); using flash");
    }
  }

  int device_;
  bool checked_ = false;
  bool use_cudnn_ = true;
  double lse_scale_ = 1.0;
};

// The executor's view of one layer's contiguous tensors (the text ones undefined without joint
// tokens).
runtime::LayerIo IoOf(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                      const Tensor& tq, const Tensor& tk, const Tensor& tv, const Tensor& tout) {
  runtime::LayerIo io;
  io.q = q.data_ptr();
  io.k = k.data_ptr();
  io.v = v.data_ptr();
  io.out = out.data_ptr();
  if (tq.defined()) {
    io.text_q = tq.data_ptr();
    io.text_k = tk.data_ptr();
    io.text_v = tv.data_ptr();
    io.text_out = tout.data_ptr();
  }
  return io;
}

// $DITSCALE_SP_ONE_SIDED_ENGINE: auto (default), copy-engine or nvshmem
// (runtime::OneSidedEngine).
runtime::OneSidedEngine EngineFromEnv() {
  const char* env = std::getenv("DITSCALE_SP_ONE_SIDED_ENGINE");
  const std::string v = env ? env : "";
  if (v.empty() || v == "auto") return runtime::OneSidedEngine::kAuto;
  if (v == "copy-engine") return runtime::OneSidedEngine::kCopyEngine;
  if (v == "nvshmem") return runtime::OneSidedEngine::kNvshmem;
  TORCH_CHECK(false,
              "ditscale.sp: $DITSCALE_SP_ONE_SIDED_ENGINE must be auto, copy-engine or "
              "nvshmem, got '",
              v, "'");
}

// $DITSCALE_SP_CE_SIGNAL: write (default: cuStreamWriteValue64 on the peer's word) or copy
// (runtime::Transports::signal_by_copy).
bool SignalByCopyFromEnv() {
  const char* env = std::getenv("DITSCALE_SP_CE_SIGNAL");
  const std::string v = env ? env : "";
  TORCH_CHECK(v.empty() || v == "write" || v == "copy",
              "ditscale.sp: $DITSCALE_SP_CE_SIGNAL must be write or copy, got '", v, "'");
  return v == "copy";
}

kernels::DType DTypeOf(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    case at::kHalf:
      return kernels::DType::kFloat16;
    default:
      // cuDNN and flash attention run in 16-bit floats only.
      TORCH_CHECK(false, "ditscale.sp.attention: dtype ", t, " is not supported (bf16, fp16)");
  }
}

// The layer's shape from q [B, S, H, D], k and v [B, S, H_kv, D] (one dtype; `s_name` names S in
// the messages) and the optional
// joint text tensors ([B, T, H, D]; [B, T, H_kv, D] for k and v), with `seq_total` image tokens
// over all ranks; fails naming `who` when the tensors do not fit together.
sp::AttentionShape CheckedShape(const char* who, const char* s_name, const Tensor& q,
                                const Tensor& k, const Tensor& v, const std::optional<Tensor>& tq,
                                const std::optional<Tensor>& tk, const std::optional<Tensor>& tv,
                                int64_t seq_total) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who, ": q, k, v must be [B, ", s_name,
              ", H, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(1) == q.size(1) &&
                  k.size(3) == q.size(3),
              who, ": k and v must be [B, ", s_name, ", H_kv, D] like q");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), who,
              ": q, k, v must share a dtype");
  const bool joint = tq.has_value() && tq->defined();
  const int64_t T = joint ? tq->size(1) : 0;
  if (joint) {
    TORCH_CHECK(tk.has_value() && tv.has_value() && tk->defined() && tv->defined(), who,
                ": joint_q, joint_k and joint_v go together");
    TORCH_CHECK(tq->dim() == 4 && tq->size(0) == q.size(0) && tq->size(2) == q.size(2) &&
                    tq->size(3) == q.size(3) && tk->sizes() == tv->sizes() && tk->size(1) == T &&
                    tk->size(2) == k.size(2),
                who, ": joint tensors must be [B, T, H, D] (H_kv for k, v)");
  }
  sp::AttentionShape shape;
  shape.batch = q.size(0);
  shape.seq_tokens = seq_total;
  shape.text_tokens = T;
  shape.heads = q.size(2);
  shape.kv_heads = k.size(2);
  shape.head_dim = q.size(3);
  shape.dtype_bytes = static_cast<int>(kernels::dtype_size(DTypeOf(q.scalar_type())));
  return shape;
}

}  // namespace

struct SpRuntime : torch::CustomClassHolder {
  SpRuntime(int64_t rank, int64_t world, int64_t device, int64_t machines, int64_t gpus_per_machine,
            Tensor nccl_id_intra, Tensor nccl_id_inter, double timeout_s)
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
    // Collective: every rank builds the same communicators in the same order.
    if (gpus_per_machine > 1) intra_ = MakeComm(nccl_id_intra, "intra", timeout_s);
    if (machines > 1) inter_ = MakeComm(nccl_id_inter, "inter", timeout_s);
  }

  // Collective over all ranks; `id` from sp_nvshmem_id() on rank 0, broadcast.
  // NVSHMEM is process-global: every SpRuntime of the process (one per mesh over the same
  // ranks) shares one instance; a second process group of another size cannot use it.
  void init_nvshmem(Tensor id) {
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
    auto s = comm::Nvshmem::Init(IdFromTensor<comm::NvshmemId>(id, "nvshmem id"), world_, rank_,
                                 device_);
    TORCH_CHECK(s.ok(), "ditscale.sp: NVSHMEM: ", s.failure().ToString());
    shmem_ = std::shared_ptr<comm::Nvshmem>(std::move(s).value());
    process_shmem = shmem_;
  }

  bool has_nvshmem() const { return shmem_ != nullptr; }

  // Runs one attention layer; returns [out, text_out] (text_out empty when there are no joint
  // tokens). q, k, v: [B, S_local, H, D] CUDA tensors of this rank's shard; seq_total: S of all
  // ranks; text_*: [B, T, H, D] or undefined. one_sided_inter (with one_sided): puts also between
  // machines; false = puts within machines, NCCL between them (SpConfig::one_sided_inter).
  // comm_sms > 0: the compute stream in an SM partition leaving that many SMs (SpConfig::comm_sms).
  std::vector<Tensor> attention(std::string strategy, int64_t ulysses, int64_t ring, int64_t chunks,
                                bool one_sided, bool one_sided_inter, int64_t comm_sms,
                                int64_t seq_total, Tensor q, Tensor k, Tensor v,
                                std::optional<Tensor> tq, std::optional<Tensor> tk,
                                std::optional<Tensor> tv) {
    TORCH_CHECK(q.is_cuda() && q.device().index() == device_,
                "ditscale.sp.attention: q must be on cuda:", device_);
    const sp::AttentionShape shape =
        CheckedShape("ditscale.sp.attention", "S_local", q, k, v, tq, tk, tv, seq_total);
    const bool joint = tq.has_value() && tq->defined();
    c10::cuda::CUDAGuard guard(q.device());
    const kernels::DType dt = DTypeOf(q.scalar_type());
    runtime::GpuExecutor& ex =
        Executor(strategy, ulysses, ring, chunks, one_sided, one_sided_inter, comm_sms, shape, dt);
    const sp::RankProgram& p = ex.schedule().ranks[rank_];
    TORCH_CHECK(p.image_token_count == q.size(1), "ditscale.sp.attention: rank ", rank_, " holds ",
                q.size(1), " image tokens, but strategy '", strategy, "' on this mesh ",
                "gives it ", p.image_token_count, " of ", seq_total,
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
    const runtime::LayerIo io = IoOf(qc, kc, vc, out, tqc, tkc, tvc, tout);
    auto stream = c10::cuda::getCurrentCUDAStream(device_);
    ex.Run(io, stream.stream());
    return {out, joint ? tout : at::empty({0}, q.options())};
  }

  // Waits for the current stream with hang detection on the communicators (debugging aid).
  void synchronize(double timeout_s) {
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

  // The schedule of a cached configuration as text (PrintSchedule) and the executor's plan.
  std::string describe(std::string strategy, int64_t ulysses, int64_t ring, int64_t chunks,
                       bool one_sided, bool one_sided_inter) {
    std::ostringstream os;
    const bool inter = !one_sided || one_sided_inter;  // the key's canonical form
    for (auto& [key, ex] : executors_) {
      if (std::get<0>(key) == strategy && std::get<1>(key) == ulysses && std::get<2>(key) == ring &&
          std::get<3>(key) == chunks && std::get<4>(key) == one_sided &&
          std::get<5>(key) == inter) {
        os << "transport " << sp::TransportDescription(ex->schedule().config);
        if (ex->plan().uses_nvshmem) os << ", one-sided engine " << runtime::ToString(ex->engine());
        if (ex->compute_sms() > 0) {
          os << ", compute stream on " << ex->compute_sms() << " of " << sm_count_ << " SMs";
        }
        os << "\n";
        os << runtime::PrintPlan(ex->schedule(), ex->plan());
        os << "arena bytes " << ex->arena_bytes() << ", attention " << attention_.backend() << "\n";
      }
    }
    return os.str();
  }

  // Tracing (diagnosis): every executor records per-unit timing events while on.
  void set_trace(bool on) {
    trace_ = on;
    for (auto& [key, ex] : executors_) ex->SetTrace(on);
  }

  // The per-unit timeline of the last traced layer of a cached configuration (every shape that
  // ran traced), as text (runtime::PrintTimeline); waits for that layer.
  std::string timeline(std::string strategy, int64_t ulysses, int64_t ring, int64_t chunks,
                       bool one_sided, bool one_sided_inter) {
    std::ostringstream os;
    const bool inter = !one_sided || one_sided_inter;
    for (auto& [key, ex] : executors_) {
      if (std::get<0>(key) != strategy || std::get<1>(key) != ulysses || std::get<2>(key) != ring ||
          std::get<3>(key) != chunks || std::get<4>(key) != one_sided ||
          std::get<5>(key) != inter) {
        continue;
      }
      auto t = ex->LastTimeline();
      if (!t.ok()) continue;
      const sp::AttentionShape& sh = ex->schedule().shape;
      os << "S " << sh.seq_tokens << " + " << sh.text_tokens << " text, transport "
         << sp::TransportDescription(ex->schedule().config) << "\n"
         << runtime::PrintTimeline(ex->schedule(), ex->plan(), t.value());
    }
    return os.str();
  }

  int64_t executors() const { return static_cast<int64_t>(executors_.size()); }
  void clear() { executors_.clear(); }

 private:
  // (strategy, U, R, chunks, one_sided, one_sided_inter, comm_sms, shape..., dtype).
  using Key = std::tuple<std::string, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, int>;

  std::unique_ptr<comm::NcclComm> MakeComm(const Tensor& id, const char* what, double timeout_s) {
    // $DITSCALE_SP_NET_CHANNELS_PER_PEER: NCCL channels per peer over the network transport of
    // the inter-machine communicator (more channels = more concurrent sockets / flows).
    int channels = 0;
    if (std::string(what) == "inter") {
      if (const char* env = std::getenv("DITSCALE_SP_NET_CHANNELS_PER_PEER"); env && *env) {
        char* end = nullptr;
        const long v = std::strtol(env, &end, 10);
        TORCH_CHECK(end && *end == '\0' && v >= 1 && v <= 64,
                    "ditscale.sp: $DITSCALE_SP_NET_CHANNELS_PER_PEER must be an integer in "
                    "[1, 64], got '",
                    env, "'");
        channels = static_cast<int>(v);
      }
    }
    auto c = comm::NcclComm::Create(IdFromTensor<comm::NcclId>(id, what), world_, rank_, device_,
                                    timeout_s, channels);
    TORCH_CHECK(c.ok(), "ditscale.sp: NCCL ", what, " communicator: ", c.failure().ToString());
    return std::move(c).value();
  }

  runtime::GpuExecutor& Executor(const std::string& strategy, int64_t u, int64_t r, int64_t chunks,
                                 bool one_sided, bool one_sided_inter, int64_t comm_sms,
                                 const sp::AttentionShape& s, kernels::DType dt) {
    // The scope means nothing without one_sided: one key for the two-sided executor.
    const bool inter = !one_sided || one_sided_inter;
    const Key key =
        std::make_tuple(strategy, u, r, chunks, one_sided, inter, comm_sms, s.batch, s.seq_tokens,
                        s.text_tokens, s.heads, s.kv_heads, s.head_dim, static_cast<int>(dt));
    auto it = executors_.find(key);
    if (it != executors_.end()) return *it->second;
    if (one_sided) {
      TORCH_CHECK(shmem_ != nullptr, "ditscale.sp: one-sided strategy without NVSHMEM (",
                  sp_nvshmem_unavailable().empty() ? std::string("call init_nvshmem first")
                                                   : sp_nvshmem_unavailable(),
                  ")");
    }
    sp::SpConfig cfg = SpConfigOf(strategy, u, r, chunks, one_sided, inter, comm_sms);
    // Waves of the attention kernel (cuDNN's forward: one 128-row CTA per SM at a time,
    // bench/results/sp-attn-split-h200/), for strategies that cut the call on whole waves.
    cfg.attention_slots = sm_count_;
    auto sched = sp::BuildSchedule(mesh_, cfg, s);
    TORCH_CHECK(sched.ok(), "ditscale.sp.attention: ", sched.failure().ToString());
    runtime::Transports t{intra_.get(), inter_.get(), shmem_.get()};
    t.engine = EngineFromEnv();
    t.signal_by_copy = SignalByCopyFromEnv();
    auto ex =
        runtime::GpuExecutor::Create(std::move(sched).value(), rank_, dt, device_, t, &attention_);
    TORCH_CHECK(ex.ok(), "ditscale.sp.attention: ", ex.failure().ToString());
    auto& slot = executors_[key];
    slot = std::move(ex).value();
    if (trace_) slot->SetTrace(true);
    return *slot;
  }

  int rank_, world_, device_;
  sp::SpMesh mesh_;
  // Attention waves for the schedule builder. Every rank must build the same schedule, so a mesh
  // mixes only GPUs of one SM count (the lent hosts do).
  int sm_count_;
  AtenAttention attention_;
  std::unique_ptr<comm::NcclComm> intra_, inter_;
  std::shared_ptr<comm::Nvshmem> shmem_;
  // Executors before the transports in destruction order: declared after them.
  std::map<Key, std::unique_ptr<runtime::GpuExecutor>> executors_;
  bool trace_ = false;
};

// One rank's compute of a strategy's schedule, replayed alone on the current GPU with every
// transfer skipped (runtime::Transports::compute_only): its attention calls, merges and copies as
// the executor issues them, as if communication were free. Random bf16 inputs; the output is
// meaningless. Returns (ms of each of `iters` timed layers after `warmup`, the traced per-unit
// timeline of one more layer). Measures, on one GPU, what a schedule's cuts cost in compute.
std::tuple<Tensor, std::string> sp_replay_compute(std::string strategy, int64_t ulysses,
                                                  int64_t ring, int64_t chunks, bool one_sided,
                                                  int64_t machines, int64_t gpus_per_machine,
                                                  int64_t rank, int64_t batch, int64_t seq,
                                                  int64_t text, int64_t heads, int64_t kv_heads,
                                                  int64_t head_dim, int64_t iters, int64_t warmup,
                                                  int64_t comm_sms) {
  TORCH_CHECK(at::cuda::is_available(), "ditscale.sp.replay_compute: no CUDA device");
  TORCH_CHECK(iters >= 1 && warmup >= 0, "ditscale.sp.replay_compute: iters >= 1, warmup >= 0");
  const int device = c10::cuda::current_device();
  sp::SpMesh mesh{static_cast<int>(machines), static_cast<int>(gpus_per_machine)};
  sp::SpConfig cfg = SpConfigOf(strategy, ulysses, ring, chunks, one_sided, true, comm_sms);
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
  TORCH_CHECK(sched.ok(), "ditscale.sp.replay_compute: ", sched.failure().ToString());
  TORCH_CHECK(rank >= 0 && rank < mesh.ranks(), "ditscale.sp.replay_compute: rank ", rank,
              " not in [0, ", mesh.ranks(), ")");
  const sp::RankProgram prog = sched->ranks[rank];
  AtenAttention attention(device);
  runtime::Transports t;
  t.compute_only = true;
  auto ex = runtime::GpuExecutor::Create(std::move(sched).value(), static_cast<int>(rank),
                                         kernels::DType::kBFloat16, device, t, &attention);
  TORCH_CHECK(ex.ok(), "ditscale.sp.replay_compute: ", ex.failure().ToString());
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
  TORCH_CHECK(tl.ok(), "ditscale.sp.replay_compute: ", tl.failure().ToString());
  return {ms, runtime::PrintTimeline((*ex)->schedule(), (*ex)->plan(), tl.value())};
}

// Every rank of a one-sided schedule in this process on the current GPU: the real executors
// (one per rank, each on its own stream), their puts, signals and waits through the copy-engine
// engine over runtime::LocalPeers. q, k, v: the FULL [B, S, H, D] inputs (text_*: [B, T, H, D]),
// split into the ranks' shards as the schedule says. Runs `layers` layers (the signal words grow
// across them) and returns (out of the first layer, out of the last, each rank's text out of the
// last stacked [ranks, B, T, H, D] (empty without text), a description: engine, arena bytes).
// Fails after timeout_s when the ranks do not finish (a Wait whose signal never came; the streams
// stay blocked: exit the process). Checks the executor and the strategies on one GPU.
std::tuple<Tensor, Tensor, Tensor, std::string> sp_run_local(
    std::string strategy, int64_t ulysses, int64_t ring, int64_t chunks, int64_t machines,
    int64_t gpus_per_machine, Tensor q, Tensor k, Tensor v, std::optional<Tensor> tq,
    std::optional<Tensor> tk, std::optional<Tensor> tv, int64_t layers, double timeout_s,
    int64_t comm_sms) {
  const char* who = "ditscale.sp.run_local";
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), who, ": q, k, v must be CUDA tensors");
  TORCH_CHECK(layers >= 1, who, ": layers >= 1");
  const sp::AttentionShape shape = CheckedShape(who, "S", q, k, v, tq, tk, tv, q.size(1));
  const bool joint = tq.has_value() && tq->defined();
  const int device = q.device().index();
  c10::cuda::CUDAGuard guard(q.device());
  const kernels::DType dt = DTypeOf(q.scalar_type());
  sp::SpMesh mesh{static_cast<int>(machines), static_cast<int>(gpus_per_machine)};
  sp::SpConfig cfg = SpConfigOf(strategy, ulysses, ring, chunks, true, true, comm_sms);
  cfg.attention_slots = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  auto sched = sp::BuildSchedule(mesh, cfg, shape);
  TORCH_CHECK(sched.ok(), who, ": ", sched.failure().ToString());
  const sp::Schedule schedule = std::move(sched).value();
  const int n = mesh.ranks();
  auto peers = runtime::MakeLocalPeers(std::vector<int>(n, device));
  AtenAttention attention(device);
  {
    // Warm-up, every rank's compute alone (no transfers, so no waits): the attention backend's
    // one-time calibration (it reads a result back: a stream synchronization) and cuDNN's plan
    // building for every call shape happen here. In the real layers one host thread issues all
    // ranks, so a synchronizing call while rank 0's streams wait for rank 1's signals, which
    // are not issued yet, would never return.
    runtime::Transports replay;
    replay.compute_only = true;
    auto warm_stream = c10::cuda::getStreamFromPool(false, device);
    for (int r = 0; r < n; ++r) {
      auto e = runtime::GpuExecutor::Create(schedule, r, dt, device, replay, &attention);
      TORCH_CHECK(e.ok(), who, ": rank ", r, ": ", e.failure().ToString());
      const sp::RankProgram& p = schedule.ranks[r];
      Tensor wq =
          at::zeros({shape.batch, p.image_token_count, shape.heads, shape.head_dim}, q.options());
      Tensor wk = at::zeros({shape.batch, p.image_token_count, shape.kv_heads, shape.head_dim},
                            q.options());
      Tensor wo = at::empty_like(wq), wt, wtk, wto;
      if (joint) {
        wt = at::zeros({shape.batch, shape.text_tokens, shape.heads, shape.head_dim}, q.options());
        wtk = at::zeros({shape.batch, shape.text_tokens, shape.kv_heads, shape.head_dim},
                        q.options());
        wto = at::empty_like(wt);
      }
      (*e)->Run(IoOf(wq, wk, wk, wo, wt, wtk, wtk, wto), warm_stream.stream());
      C10_CUDA_CHECK(cudaStreamSynchronize(warm_stream.stream()));
    }
  }
  std::vector<std::unique_ptr<runtime::GpuExecutor>> ex;
  for (int r = 0; r < n; ++r) {
    runtime::Transports t;
    t.peers = peers[r].get();
    t.engine = runtime::OneSidedEngine::kCopyEngine;
    t.signal_by_copy = SignalByCopyFromEnv();
    auto e = runtime::GpuExecutor::Create(schedule, r, dt, device, t, &attention);
    TORCH_CHECK(e.ok(), who, ": rank ", r, ": ", e.failure().ToString());
    TORCH_CHECK(!(*e)->plan().uses_nccl, who, ": strategy '", strategy,
                "' has two-sided transfers on this mesh (they need NCCL: one process per GPU)");
    ex.push_back(std::move(e).value());
  }
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  Tensor tqc, tkc, tvc;
  if (joint) {
    tqc = tq->contiguous();
    tkc = tk->contiguous();
    tvc = tv->contiguous();
  }
  std::vector<Tensor> qs, ks, vs, outs, touts;
  for (int r = 0; r < n; ++r) {
    const sp::RankProgram& p = schedule.ranks[r];
    qs.push_back(qc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    ks.push_back(kc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    vs.push_back(vc.narrow(1, p.image_token_begin, p.image_token_count).contiguous());
    outs.push_back(at::empty_like(qs.back()));
    touts.push_back(joint ? at::empty_like(tqc) : Tensor());
  }
  auto current = c10::cuda::getCurrentCUDAStream(device);
  std::vector<c10::cuda::CUDAStream> streams;
  for (int r = 0; r < n; ++r) streams.push_back(c10::cuda::getStreamFromPool(false, device));
  at::cuda::CUDAEvent inputs_ready;
  inputs_ready.record(current);
  for (auto& st : streams) inputs_ready.block(st);
  // The full output: each rank's shard at its image tokens (the schedule's placement: TAS and
  // torus put a machine's ranks on non-adjacent shards).
  auto gather = [&] {
    Tensor full = at::empty_like(qc);
    for (int r = 0; r < n; ++r) {
      const sp::RankProgram& p = schedule.ranks[r];
      full.narrow(1, p.image_token_begin, p.image_token_count).copy_(outs[r]);
    }
    return full;
  };
  Tensor first;
  for (int64_t l = 0; l < layers; ++l) {
    // Each rank's layer on its own stream: a rank's Waits block only its streams.
    for (int r = 0; r < n; ++r) {
      ex[r]->Run(IoOf(qs[r], ks[r], vs[r], outs[r], tqc, tkc, tvc, touts[r]), streams[r].stream());
    }
    if (l == 0 && layers > 1) {
      for (auto& st : streams) {
        at::cuda::CUDAEvent done;
        done.record(st);
        done.block(current);
      }
      c10::cuda::CUDAStreamGuard sg(current);
      first = gather();  // on the caller's stream, after every rank's first layer
      at::cuda::CUDAEvent copied;
      copied.record(current);
      for (auto& st : streams) copied.block(st);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int r = 0; r < n; ++r) {
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
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  Tensor last = gather();
  if (!first.defined()) first = last;
  std::ostringstream info;
  info << "engine " << runtime::ToString(ex[0]->engine())
       << (SignalByCopyFromEnv() ? " (signals by copy)" : "") << ", arena " << ex[0]->arena_bytes()
       << " bytes per rank, " << n << " ranks on device " << device;
  if (ex[0]->compute_sms() > 0) info << ", compute streams on " << ex[0]->compute_sms() << " SMs";
  return {first, last, joint ? at::stack(touts) : at::empty({0}, q.options()), info.str()};
}

TORCH_LIBRARY_FRAGMENT(ditscale, m) {
  m.def("sp_replay_compute", &sp_replay_compute);
  m.def("sp_run_local", &sp_run_local);
  m.def("sp_nccl_id", &sp_nccl_id);
  m.def("sp_nvshmem_id", &sp_nvshmem_id);
  m.def("sp_nvshmem_unavailable", &sp_nvshmem_unavailable);
  m.class_<SpRuntime>("SpRuntime")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, Tensor, Tensor, double>())
      .def("init_nvshmem", &SpRuntime::init_nvshmem)
      .def("has_nvshmem", &SpRuntime::has_nvshmem)
      .def("attention", &SpRuntime::attention)
      .def("synchronize", &SpRuntime::synchronize)
      .def("describe", &SpRuntime::describe)
      .def("set_trace", &SpRuntime::set_trace)
      .def("timeline", &SpRuntime::timeline)
      .def("executors", &SpRuntime::executors)
      .def("clear", &SpRuntime::clear);
}

}  // namespace ditscale::torch_ext
