// The AdaLN launch plans (internal/adaln_plan.h): which kernel and instantiation each call takes.
// Plain C++ (built with or without CUDA); the measurements behind every choice are in
// lab/adaln-kernel-notes.md.
#include "ditscale/kernels/internal/adaln_plan.h"

#include <cstdint>
#include <iterator>
#include <string>

namespace ditscale::kernels::internal {
namespace {

constexpr int kFwdVecCandidates[] = {1, 2, 3, 4, 5, 6, 8};
constexpr int kNumFwdVecCandidates = static_cast<int>(std::size(kFwdVecCandidates));
constexpr int kBwdVecCandidates[] = {1, 2, 3, 4};
constexpr int kNumBwdVecCandidates = static_cast<int>(std::size(kBwdVecCandidates));
// Forward rings above this take the next kernel (several blocks per SM must fit in 227 KB).
constexpr std::int64_t kMaxFwdRingBytes = 112 * 1024;
// Backward: shared-memory accumulators of the first kernel above this take the general kernel
// (fits A100 and H100/H200); ring + slots of the pipelined kernel above this take the first one.
constexpr std::int64_t kMaxAccSmemBytes = 96 * 1024;
constexpr std::int64_t kMaxPipeSmemBytes = 160 * 1024;

bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// True when every 16-byte vector of `v` at a feature index that is a multiple of the vector width
// is 16-byte aligned (absent views pass). Strides of size-1 dimensions do not matter.
bool view_aligned(const RowsView& v, std::int64_t batch, std::int64_t seq_len) {
  if (v.data == nullptr) return true;
  const auto esize = static_cast<std::int64_t>(dtype_size(v.dtype));
  const bool sb_ok = batch == 1 || (v.stride_b * esize) % 16 == 0;
  const bool sn_ok = seq_len == 1 || (v.stride_n * esize) % 16 == 0;
  return aligned16(v.data) && sb_ok && sn_ok;
}

// Elements of `dtype` in one 16-byte vector.
int vec_width(DType dtype) { return 16 / static_cast<int>(dtype_size(dtype)); }

bool fwd_aligned(const AdaLNFwdParams& p) {
  const std::int64_t B = p.batch, N = p.seq_len;
  return p.dim % vec_width(p.dtype) == 0 && view_aligned(p.x, B, N) &&
         view_aligned(p.residual, B, N) && view_aligned(p.branch, B, N) &&
         view_aligned(p.gate, B, N) && view_aligned(p.scale, B, N) && view_aligned(p.shift, B, N) &&
         aligned16(p.weight) && aligned16(p.bias) && aligned16(p.y) && aligned16(p.h);
}

// The warp-per-row kernel for plain rows of <= kFwdWarpMaxVecs * 32 vectors. Coefficients
// packed ahead of use where they can be (scale and shift in x's dtype, no affine): 2 vectors
// ahead per sample, all with the row's x loads per token; then one row per warp, a grid of all
// rows, no streaming hints (notes v6). Otherwise coefficients at use, with streaming hints
// (notes v5) and, in bf16, the persistent grid that prefetches the next rows (+0-1.5 points at
// D = 1024-1536).
bool plan_fwd_warp(const AdaLNFwdParams& p, FwdPlan& plan) {
  const int vec = vec_width(p.dtype);
  const std::int64_t nvec = p.dim / vec;
  const std::int64_t vecs = (nvec + 31) / 32;
  if (vecs < 1 || vecs > kFwdWarpMaxVecs) return false;
  const bool packed = p.scale.dtype != DType::kFloat32 && p.shift.dtype != DType::kFloat32 &&
                      p.weight == nullptr && p.bias == nullptr;
  const bool per_token = is_per_token(p.scale) || is_per_token(p.shift);
  plan.kernel = FwdKernel::kWarp;
  plan.vecs = vecs == 7 ? 8 : static_cast<int>(vecs);
  plan.threads = 32;
  plan.ahead = !packed ? 0 : (per_token ? plan.vecs : std::min(plan.vecs, 2));
  plan.prefetch = !packed && p.dtype == DType::kBFloat16;
  plan.evict_first = !packed;
  return true;
}

// The bulk-copy kernel for plain rows of >= 64 vectors: among the vector plans that pad a row
// least, bf16 prefers 5 vectors per thread, then 3 in whole 4-warp groups (notes v13), then the
// threads closest to 128. Coefficients are recomputed per row when a thread holds more than 40
// elements (notes v11). One row per block iteration (row groups lost, notes v4), a ring of 4;
// bf16 rows of 2, 3 or 5 vectors per thread store per thread up to 4 KB, larger ones and every
// other plan through bulk stores.
bool plan_fwd_tma(const AdaLNFwdParams& p, FwdPlan& plan) {
  const int vec = vec_width(p.dtype);
  const std::int64_t nvec = p.dim / vec;
  if (nvec < 64) return false;
  const bool bf16 = p.dtype == DType::kBFloat16;
  auto reload_for = [](int elems) { return elems > 40; };
  const VecPlan v = choose_vec_plan(
      nvec, kFwdVecCandidates, kNumFwdVecCandidates,
      [&](int k) { return fwd_tma_max_threads(k * vec, reload_for(k * vec)); }, 128,
      [&](int k, std::int64_t tpr) {
        if (!bf16) return 0;
        return k == 5 ? 2 : (k == 3 && tpr % 128 == 0 ? 1 : 0);
      });
  if (v.vecs == 0) return false;
  const std::int64_t row_bytes = nvec * 16;
  constexpr int kStages = 4;
  if (kStages * row_bytes > kMaxFwdRingBytes) return false;
  const bool per_thread_stores = bf16 && (v.vecs == 2 || v.vecs == 3 || v.vecs == 5);
  plan.kernel = FwdKernel::kTma;
  plan.vecs = v.vecs;
  plan.threads = v.threads;
  plan.stages = kStages;
  plan.coef_reload = reload_for(v.vecs * vec);
  plan.bulk_store = !per_thread_stores || row_bytes > 4096;
  return true;
}

// The cp.async kernel (every gated call; plain rows where the others do not apply): one row per
// thread (two lost, notes v2), a ring of 3, 128 / threads rows per block.
bool plan_fwd_pipe(const AdaLNFwdParams& p, FwdPlan& plan) {
  const int vec = vec_width(p.dtype);
  const VecPlan v = choose_vec_plan(
      p.dim / vec, kFwdVecCandidates, kNumFwdVecCandidates,
      [&](int k) { return fwd_pipe_max_threads(k * vec); }, 128);
  if (v.vecs == 0) return false;
  constexpr int kStages = 3;
  const int rows_per_block = std::max(1, 128 / v.threads);
  const std::int64_t streams = p.gate.data != nullptr ? 2 : 1;
  const std::int64_t ring =
      std::int64_t{kStages} * streams * rows_per_block * v.threads * v.vecs * 16;
  if (ring > kMaxFwdRingBytes) return false;
  plan.kernel = FwdKernel::kPipe;
  plan.vecs = v.vecs;
  plan.threads = v.threads;
  plan.rows_per_block = rows_per_block;
  plan.stages = kStages;
  return true;
}

}  // namespace

FwdPlan choose_fwd_plan(const AdaLNFwdParams& p, bool tma_available, const AdaLNTuning& tune) {
  FwdPlan plan;
  const bool aligned = fwd_aligned(p);
  const bool plain = p.gate.data == nullptr;
  // The pipelined kernels index rows with 32-bit arithmetic.
  if (aligned && tune.pipelined && p.batch * p.seq_len < (std::int64_t{1} << 31)) {
    const bool warp_ok = tune.fwd_kernel == 0 || tune.fwd_kernel == 3;
    const bool tma_ok = tune.fwd_kernel != 1 && tma_available;
    if (plain && warp_ok && plan_fwd_warp(p, plan)) return plan;
    if (plain && tma_ok && plan_fwd_tma(p, plan)) return plan;
    if (plan_fwd_pipe(p, plan)) return plan;
  }
  if (aligned) {
    const int vec = vec_width(p.dtype);
    const VecPlan v = choose_vec_plan(
        p.dim / vec, kFwdVecCandidates, kNumFwdVecCandidates,
        [&](int k) { return fwd_vec_max_threads(k * vec); }, 128);
    if (v.vecs != 0) {
      plan.kernel = FwdKernel::kVec;
      plan.vecs = v.vecs;
      plan.threads = v.threads;
      plan.rows_per_block = std::max(1, 128 / v.threads);
      return plan;
    }
  }
  plan.kernel = FwdKernel::kGeneral;
  return plan;
}

BwdPlan choose_bwd_plan(const AdaLNBwdParams& p, const AdaLNTuning& tune) {
  const int vec = vec_width(p.dtype);
  const std::int64_t B = p.batch, N = p.seq_len, nvec = p.dim / vec;
  const bool aligned =
      p.dim % vec == 0 && view_aligned(p.x, B, N) && view_aligned(p.residual, B, N) &&
      view_aligned(p.dy, B, N) && view_aligned(p.dh_out, B, N) && view_aligned(p.branch, B, N) &&
      view_aligned(p.gate, B, N) && view_aligned(p.scale, B, N) && aligned16(p.weight) &&
      aligned16(p.bias) && aligned16(p.dx) && aligned16(p.dbranch) && aligned16(p.dscale) &&
      aligned16(p.dshift) && aligned16(p.dgate);
  const BwdWorkspaceLayout layout = bwd_workspace_layout(p);
  BwdPlan plan;
  // Pipelined kernel: dscale / dshift partials in registers, the others in shared-memory slots.
  // Threads per row: 128 for lean 16-bit rows of more than 3 KB (3 vectors x 128 instead of
  // 4 x 96 at D = 3072, +5-6 points, notes v9), 96 for gated 16-bit rows, 64 otherwise (notes
  // v8). Two-row ring for lean bf16 (+1 to +16 points over 3, notes v9) and gated 16-bit rows,
  // else 3. Gated bf16 at D = 1536 (2 x 96 with a two-row ring against 3 x 64 with three rows;
  // the ring carries dh_out too): 67% -> 85-86% of the copy rate (notes v14).
  plan.lean = p.gate.data == nullptr && p.weight == nullptr && p.bias == nullptr;
  if (aligned && tune.pipelined) {
    const bool gated = p.gate.data != nullptr;
    const bool gated16 = gated && p.dtype != DType::kFloat32;
    const bool lean_bf16 = plan.lean && p.dtype == DType::kBFloat16;
    const int target = plan.lean && vec == 8 && nvec > 192 ? 128 : (gated16 ? 96 : 64);
    const int stages = lean_bf16 || gated16 ? 2 : 3;
    const VecPlan v = choose_vec_plan(
        nvec, kBwdVecCandidates, kNumBwdVecCandidates,
        [&](int k) { return bwd_pipe_max_threads(k * vec); }, target);
    const std::int64_t slots = layout.dgate + layout.dweight + layout.dbias;
    // Sized for the deepest ring any instantiation had (4 stages of 2 streams), which keeps the
    // plans of every shape as they were measured; the gated ring is `stages` rows of 3 or 4
    // (bwd_pipe_streams: residual, dy, branch, dh_out; h is recomputed).
    const std::int64_t ring_chunks =
        gated ? stages * bwd_pipe_streams(true, p.dh_out.data != nullptr) : 4 * 2;
    const std::int64_t smem = ring_chunks * v.threads * v.vecs * 16 + slots * p.dim * 4;
    if (v.vecs != 0 && smem <= kMaxPipeSmemBytes) {
      plan.kernel = BwdKernel::kPipe;
      plan.vecs = v.vecs;
      plan.threads = v.threads;
      plan.stages = stages;
      plan.reg_cap_candidate = lean_bf16 && v.vecs == 4;
      return plan;
    }
  }
  plan.lean = false;
  const std::int64_t acc_smem = std::int64_t{layout.count()} * p.dim * 4;
  if (aligned && acc_smem <= kMaxAccSmemBytes) {
    // Ties: more threads, fewer registers per thread.
    const VecPlan v = choose_vec_plan(
        nvec, kBwdVecCandidates, kNumBwdVecCandidates,
        [&](int k) { return bwd_vec_max_threads(k * vec); }, 512);
    if (v.vecs != 0) {
      plan.kernel = BwdKernel::kVec;
      plan.vecs = v.vecs;
      plan.threads = v.threads;
      return plan;
    }
  }
  plan.kernel = BwdKernel::kGeneral;
  return plan;
}

namespace {

// " <vecs>x<threads>"
void append_shape(std::string& s, int vecs, int threads) {
  s += ' ';
  s += std::to_string(vecs);
  s += 'x';
  s += std::to_string(threads);
}

void append_int(std::string& s, const char* label, int v) {
  s += label;
  s += std::to_string(v);
}

}  // namespace

std::string describe(const FwdPlan& plan) {
  static const char* const kNames[] = {"warp", "tma", "pipe", "vec", "general"};
  std::string s = kNames[static_cast<int>(plan.kernel)];
  if (plan.kernel == FwdKernel::kGeneral) return s;
  append_shape(s, plan.vecs, plan.threads);
  if (plan.rows_per_block > 1) append_int(s, " rows ", plan.rows_per_block);
  if (plan.stages > 0) append_int(s, " s", plan.stages);
  if (plan.kernel == FwdKernel::kWarp) {
    if (plan.ahead > 0) {
      append_int(s, " ahead ", plan.ahead);
    } else {
      s += " at-use";
    }
    if (plan.prefetch) s += " prefetch";
    if (plan.evict_first) s += " hints";
  }
  if (plan.kernel == FwdKernel::kTma) {
    s += plan.bulk_store ? " bulk" : " thread-stores";
    if (plan.coef_reload) s += " reload";
  }
  return s;
}

std::string describe(const BwdPlan& plan) {
  static const char* const kNames[] = {"pipe", "vec", "general"};
  std::string s = kNames[static_cast<int>(plan.kernel)];
  if (plan.kernel == BwdKernel::kGeneral) return s;
  append_shape(s, plan.vecs, plan.threads);
  if (plan.kernel == BwdKernel::kPipe) {
    append_int(s, " s", plan.stages);
    if (plan.lean) s += " lean";
    if (plan.reg_cap_candidate) s += " cap?";
  }
  return s;
}

}  // namespace ditscale::kernels::internal
