// Host-side launch planning shared by the CUDA launchers (adaln.cu) and the workspace query
// (adaln_ref.cc, always built): the sequence tiling of the backward's coalesced reduction and the
// workspace layout of its fp32 partial sums. Plain C++, no CUDA headers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ditscale/kernels/adaln.h"

namespace ditscale::kernels::internal {

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
