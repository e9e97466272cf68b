// Ring: kv blocks of the ring group rotate to the next rank while the current one is attended.
// Block s (from ring index i - s) lives in ring_loc[s]: the own buffer for s = 0, then one extra
// buffer alternating with the own one (double buffering; a second extra buffer only when the own
// buffer is smaller than the largest ring chunk). One-sided: a rank puts block s into the next
// rank's location of block s + 1 once that rank has released it ("ring.free"), and the data
// arrival is the put's signal on the phase counter. A ring link that is two-sided
// (one_sided_inter = false across machines) uses Send / Recv and no "ring.free" signals.
#include <algorithm>

#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {
namespace {

int PrevOccupant(const RankLayout& l, int s) {
  for (int t = s - 1; t >= 0; --t) {
    if (l.ring_loc[t] == l.ring_loc[s]) return t;
  }
  return -1;
}

bool Reused(const RankLayout& l, int t) {
  for (size_t x = t + 1; x < l.ring_loc.size(); ++x) {
    if (l.ring_loc[x] == l.ring_loc[t]) return true;
  }
  return false;
}

// Number of "ring.free" signals rank l has sent after releasing blocks 0..t.
int64_t FreeCount(const RankLayout& l, int t) {
  int64_t count = 0;
  for (int x = 0; x <= t; ++x) count += Reused(l, x);
  return count;
}

}  // namespace

void HybridBuilder::PlanRingLocations(int r) {
  RankLayout& l = lay_[r];
  l.ring_loc.assign(1, {l.gk, l.gv});
  if (R_ == 1) return;
  ProgramBuilder& b = b_[r];
  int64_t max_chunk = 0;
  for (int j = 0; j < R_; ++j) max_chunk = std::max(max_chunk, RingChunkTokens(j));
  const int64_t hkv = kv_size_[l.u];
  const int64_t d = shape_.head_dim;
  const int e = shape_.dtype_bytes;
  const bool own_fits = b.decl(l.gk).tokens >= max_chunk;
  const int extra = (own_fits || R_ == 2) ? 1 : 2;
  std::vector<std::pair<int, int>> bufs = {{l.gk, l.gv}};
  for (int x = 1; x <= extra; ++x) {
    const std::string s = std::to_string(x);
    bufs.emplace_back(b.AddBuffer("ring" + s + ".k", BufferRole::kWork, BufferInit::kUndefined,
                                  max_chunk, hkv, d, e),
                      b.AddBuffer("ring" + s + ".v", BufferRole::kWork, BufferInit::kUndefined,
                                  max_chunk, hkv, d, e));
  }
  for (int s = 1; s < R_; ++s) {
    l.ring_loc.push_back(extra == 1 ? bufs[s % 2] : bufs[s % 2 == 1 ? 1 : 2]);
  }
}

Phase HybridBuilder::PlanRingStep(int s) {
  Phase p;
  p.name = "ring.s" + std::to_string(s);
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    const int nx = RankOf(l.u, (l.i + 1) % R_);
    const RankLayout& ln = lay_[nx];
    const int64_t L = RingChunkTokens(((l.i - s) % R_ + R_) % R_);
    const int64_t hkv = kv_size_[l.u];
    const int occupant = PrevOccupant(ln, s + 1);
    const int64_t free_wait = occupant >= 0 ? FreeCount(ln, occupant) : 0;
    for (int kv = 0; kv < 2; ++kv) {
      const int src_buf = kv == 0 ? l.ring_loc[s].first : l.ring_loc[s].second;
      const int dst_buf = kv == 0 ? ln.ring_loc[s + 1].first : ln.ring_loc[s + 1].second;
      Transfer t = MakeTransfer(p.name, kv == 0 ? "k" : "v", r, Region{src_buf, 0, L, 0, hkv}, nx,
                                Region{dst_buf, 0, L, 0, hkv});
      t.free_wait = free_wait;
      p.transfers.push_back(std::move(t));
    }
  }
  return p;
}

void HybridBuilder::RingCompute(int s, int r) {
  RankLayout& l = lay_[r];
  const int64_t L = RingChunkTokens(((l.i - s) % R_ + R_) % R_);
  const Region k = KvHeads(r, l.ring_loc[s].first, 0, L);
  const Region v = KvHeads(r, l.ring_loc[s].second, 0, L);
  const std::string tag = "ring step " + std::to_string(s);
  // Joint text: q = [text rows; image rows] in one call (qoff = 0 otherwise).
  AttendInto(r, QHeads(r, l.gq, 0, l.qoff + l.chunk_tokens), k, v, &l.acc, 0, tag + " attention");
}

void HybridBuilder::RingRelease(int s, int r) {
  const RankLayout& l = lay_[r];
  if (R_ == 1 || !Reused(l, s)) return;
  ProgramBuilder& b = b_[r];
  const int pv = RankOf(l.u, (l.i - 1 + R_) % R_);
  // A Recv target needs no "free" signal: the Recv is ordered after the block's readers on this
  // rank (local deps), and the sender's Send waits for it (and skips free_wait, see Issue).
  if (!OneSidedBetween(pv, r)) return;
  b.Signal(Stream::kCompute, pv, LinkOf(r, pv), "ring.free", 1,
           {b.Whole(l.ring_loc[s].first), b.Whole(l.ring_loc[s].second)}, {},
           "ring release block " + std::to_string(s));
}

}  // namespace ditscale::sp::internal
