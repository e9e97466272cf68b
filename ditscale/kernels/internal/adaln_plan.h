// Host-side launch planning of the AdaLN CUDA launchers (adaln.cu, adaln_bwd.cu), plain C++ (no
// CUDA headers, always built) so that the CPU tests pin the plan chosen for each shape
// (adaln_plan_test.cc):
//   * the register budgets of the kernels (elements per thread -> largest block), which are also
//     their __launch_bounds__;
//   * choose_vec_plan, the vectors-per-thread x threads-per-row choice of the vector kernels;
//   * choose_fwd_plan / choose_bwd_plan: which kernel and which instantiation a call takes (the
//     launchers only add what depends on the device: grids from the occupancy calculator and the
//     backward's register-capped instantiation, FwdPlan / BwdPlan say where);
//   * the sequence tiling of the backward's coalesced reduction and the workspace layout of its
//     fp32 partial sums (also used by adaln_backward_workspace_bytes).
// The choices are the measured winners of lab/adaln-kernel-notes.md (v1-v13); the
// variants that lost are listed there ("Removed variants").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_tuning.h"

namespace ditscale::kernels::internal {

// ---- Register budgets: elements a thread holds -> the largest block (0 = not supported) ----

// First forward vector kernel: <= 8 elements 1024 threads, <= 24 512, else 256 (64 / 128 / 255
// registers per thread, ptxas: no spills).
constexpr int fwd_vec_max_threads(int elems) {
  return elems <= 8 ? 1024 : (elems <= 24 ? 512 : 256);
}

// Pipelined (cp.async) forward, `rows` rows per thread (the kernel's kRows; the plans use 1):
// registers ~ (rows + 2) * elems (data and the two coefficient arrays) + ~56 (indices,
// pointers), held under the launch bound's limit without spills (ptxas -v).
constexpr int fwd_pipe_max_threads(int elems, int rows = 1) {
  const int est = (rows + 2) * elems + 56;
  return est <= 128 ? 512 : (est <= 240 ? 256 : 0);
}

// Bulk-copy forward: registers ~ data (+ two coefficient arrays unless reloaded per row) + ~56.
constexpr int fwd_tma_max_threads(int elems, bool coef_reload) {
  const int est = (coef_reload ? 1 : 3) * elems + 56;
  return est <= 128 ? 512 : (est <= 240 ? 256 : 0);
}

// Warp-per-row forward: most 16-byte vectors per lane (rows of <= 256 vectors).
inline constexpr int kFwdWarpMaxVecs = 8;

// First backward vector kernel: <= 8 elements per thread 512 threads (128 registers), else 256
// (255 registers; ptxas -v: no spills for any instantiation on sm_80 / sm_90a).
constexpr int bwd_vec_max_threads(int elems) { return elems <= 8 ? 512 : 256; }

// Pipelined backward: elements per thread -> block size cap (registers without spills).
constexpr int bwd_pipe_max_threads(int elems) { return elems <= 8 ? 512 : (elems <= 32 ? 256 : 0); }

// Rows of 16-byte chunks per stage of the pipelined backward's ring: x and dy; gated: residual,
// dy and branch (h is recomputed from them), and dh_out where the caller passes it.
constexpr int bwd_pipe_streams(bool gated, bool has_dh) { return gated ? (has_dh ? 4 : 3) : 2; }

// The pipelined backward's register-capped instantiation (lean bf16, two-row ring, 4 vectors per
// thread): its launch bound caps the registers at kBwdRegCap per thread so that more blocks fit
// per SM (a few bytes spilled). Launch bound of an instantiation: the plan's thread cap, or with
// reg_cap > 0 the block size at which one block may use reg_cap registers per thread.
inline constexpr int kBwdRegCap = 128;
constexpr int bwd_pipe_bound(int elems, int reg_cap) {
  return reg_cap > 0 ? 65536 / reg_cap / 32 * 32 : bwd_pipe_max_threads(elems);
}

// ---- Vectors per thread ----

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

// Elements-per-thread choice: for each candidate K (vectors per thread) the row takes
// tpr = round_up(ceil(nvec / K), 32) threads; a candidate is valid when tpr <= max_threads(K).
// Pick the least idle slots (tpr * K - nvec); ties go to the higher rank(K, tpr) (default: all
// equal), then to tpr closest to `target_tpr`, then to the smaller K. Returns K = 0 when no
// candidate fits (the caller takes the next kernel).
struct VecPlan {
  int vecs = 0;     // K
  int threads = 0;  // tpr, threads per row
};

struct EqualRank {
  int operator()(int /*vecs*/, std::int64_t /*threads*/) const { return 0; }
};

template <typename MaxThreadsFn, typename RankFn = EqualRank>
VecPlan choose_vec_plan(std::int64_t nvec, const int* candidates, int num_candidates,
                        MaxThreadsFn max_threads, int target_tpr, RankFn rank = {}) {
  VecPlan best;
  std::int64_t best_waste = 0;
  int best_rank = 0;
  for (int i = 0; i < num_candidates; ++i) {
    const int k = candidates[i];
    const std::int64_t tpr = round_up((nvec + k - 1) / k, 32);
    if (tpr > max_threads(k)) continue;
    const std::int64_t waste = tpr * k - nvec;
    const int r = rank(k, tpr);
    const bool closer = std::llabs(tpr - target_tpr) < std::llabs(best.threads - target_tpr);
    const bool better = best.vecs == 0 || waste < best_waste ||
                        (waste == best_waste && (r != best_rank ? r > best_rank : closer));
    if (better) {
      best.vecs = k;
      best.threads = static_cast<int>(tpr);
      best_waste = waste;
      best_rank = r;
    }
  }
  return best;
}

// ---- Which kernel a call takes ----

enum class FwdKernel : int {
  kWarp = 0,     // warp per row, row in registers (adaln_fwd_warp.cuh)
  kTma = 1,      // bulk copies through a shared-memory ring, sm_90+ (adaln_fwd_tma.cuh)
  kPipe = 2,     // cp.async ring, persistent (adaln_fwd_pipe.cuh)
  kVec = 3,      // first vector kernel, one row per block (adaln.cu)
  kGeneral = 4,  // any D, any alignment, 256 threads per row (adaln.cu)
};

// The forward's plan. Instantiation parameters of the chosen kernel; the others keep defaults.
struct FwdPlan {
  FwdKernel kernel = FwdKernel::kGeneral;
  int vecs = 0;            // 16-byte vectors per thread (warp: per lane, 7 runs as 8); 0: general
  int threads = 0;         // threads per row (warp: 32)
  int rows_per_block = 1;  // pipe / vec: rows of one block (blockDim.y)
  int stages = 0;          // ring depth in rows: pipe 3, tma 4
  // Warp kernel: scale/shift loaded packed `ahead` vectors ahead of use (0: at use); the
  // persistent grid with the next rows prefetched (grid from the occupancy calculator);
  // streaming cache hints on x / y.
  int ahead = 0;
  bool prefetch = false;
  bool evict_first = false;
  // Bulk-copy kernel: y through bulk stores (else per-thread 16-byte stores); coefficients
  // recomputed per row (else kept in registers across a sample's rows).
  bool bulk_store = false;
  bool coef_reload = false;
};

// `tma_available`: the device is sm_90+ and the build holds sm_90 code for it (else the bulk-copy
// kernel is skipped). Expects params that passed adaln_check(p, true).
FwdPlan choose_fwd_plan(const AdaLNFwdParams& p, bool tma_available,
                        const AdaLNTuning& tune = AdaLNTuning{});

enum class BwdKernel : int {
  kPipe = 0,     // cp.async ring, dscale/dshift partials in registers (adaln_bwd_pipe.cuh)
  kVec = 1,      // first vector kernel, shared-memory slots (adaln_bwd.cu)
  kGeneral = 2,  // any D, any alignment (adaln_bwd.cu)
};

// The backward's main-kernel plan (the partials reduction that follows is the same for all).
struct BwdPlan {
  BwdKernel kernel = BwdKernel::kGeneral;
  int vecs = 0;       // 16-byte vectors per thread; 0: general
  int threads = 0;    // threads per row (= per block)
  int stages = 0;     // pipe: ring depth in rows (2 lean bf16 and gated 16-bit, else 3)
  bool lean = false;  // pipe: no affine, no gate (those paths compiled out)
  // pipe: the register-capped instantiation (kBwdRegCap) is a candidate; the launcher takes it
  // where the occupancy calculator fits more of its blocks per SM than of the uncapped one's,
  // when the uncapped one fits at most 2 (adaln_bwd.cu).
  bool reg_cap_candidate = false;
};

BwdPlan choose_bwd_plan(const AdaLNBwdParams& p, const AdaLNTuning& tune = AdaLNTuning{});

// "warp 6x32 ahead 2", "tma 5x64 s4 bulk", "pipe 4x160 s2 lean cap?": the plan in one line (test
// and benchmark output).
std::string describe(const FwdPlan& plan);
std::string describe(const BwdPlan& plan);

// ---- The backward's reduction ----

// Target number of (b, n_tile) blocks of the backward kernel: ~10 per SM of an H100/H200 (132
// SMs) so the grid fills the machine in a few even waves while the partials stay small
// (tiles * D * 4 bytes per reduced quantity). Depends on the shape only, never on the device,
// so the reduction order (and thus the bits) is a function of the inputs.
inline constexpr std::int64_t kBwdTargetTiles = 1320;

// The workspace is sized for these tiles; the pipelined backward uses at most as many (one wave
// of resident blocks: B x tiles <= occupancy x SMs), so its bits are fixed per GPU model.
// Rows of one sequence tile of the backward (a tile never straddles two samples).
inline std::int64_t bwd_rows_per_tile(std::int64_t batch, std::int64_t seq_len) {
  const std::int64_t rows = (batch * seq_len + kBwdTargetTiles - 1) / kBwdTargetTiles;
  return std::clamp<std::int64_t>(rows, 1, seq_len);
}

inline std::int64_t bwd_num_tiles(std::int64_t batch, std::int64_t seq_len) {
  const std::int64_t rows = bwd_rows_per_tile(batch, seq_len);
  return (seq_len + rows - 1) / rows;
}

// Which reduced gradients the backward produces, and where their partials live in the
// workspace: each present quantity owns a [B, num_tiles, D] fp32 block, in this order.
struct BwdWorkspaceLayout {
  bool dscale = false;   // per-sample dscale reduced over n
  bool dshift = false;   // per-sample dshift reduced over n
  bool dgate = false;    // per-sample dgate reduced over n
  bool dweight = false;  // dweight reduced over b and n
  bool dbias = false;    // dbias reduced over b and n
  std::int64_t num_tiles = 0;
  std::int64_t rows_per_tile = 0;
  std::int64_t block_floats = 0;  // B * num_tiles * D

  int count() const { return dscale + dshift + dgate + dweight + dbias; }
  std::size_t bytes() const {
    return static_cast<std::size_t>(count()) * static_cast<std::size_t>(block_floats) * 4u;
  }
  // Offset in floats of quantity `k` (0 = first present one) from the workspace start.
  std::int64_t offset(int k) const { return static_cast<std::int64_t>(k) * block_floats; }
};

inline BwdWorkspaceLayout bwd_workspace_layout(const AdaLNBwdParams& p) {
  BwdWorkspaceLayout l;
  const bool gated = p.gate.data != nullptr;
  l.dscale = p.dscale != nullptr && !is_per_token(p.scale);
  l.dshift = p.dshift != nullptr && !is_per_token(p.shift);
  l.dgate = gated && p.dgate != nullptr && !is_per_token(p.gate);
  l.dweight = p.weight != nullptr && p.dweight != nullptr;
  l.dbias = p.bias != nullptr && p.dbias != nullptr;
  l.rows_per_tile = bwd_rows_per_tile(p.batch, p.seq_len);
  l.num_tiles = bwd_num_tiles(p.batch, p.seq_len);
  l.block_floats = p.batch * l.num_tiles * p.dim;
  return l;
}

// Rows of AdaLNBwdParams::dmod that the backward zeroes (those no per-sample dscale / dshift /
// dgate points at), ascending; empty without dmod. Expects params that passed adaln_check
// (adaln_check.cc).
std::vector<std::int64_t> dmod_zero_rows(const AdaLNBwdParams& p);

}  // namespace ditscale::kernels::internal
