// Ulysses: the head-parallel all-to-all of q, k, v in (chunked for Torus), out back, and the
// plain (non-pipelined) step 0: the whole gathered ring chunk attended at once.
#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {

// Chunk `chunk` of the q/k/v all-to-all: every rank receives, from each Ulysses peer of its
// ring chunk, sub-chunk `chunk` of the peer's shard for the receiver's head group.
Phase HybridBuilder::PlanForward(int chunk) {
  Phase p;
  p.name = "a2a.in.c" + std::to_string(chunk);
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    const int64_t hq = kv_size_[l.u] * group_;
    for (const Slot& sl : l.slots) {
      if (sl.chunk != chunk) continue;
      const int src = RankOf(sl.src_u, l.i);
      const RankLayout& sl_owner = lay_[src];
      const Region q{sl_owner.q, sl.src_offset, sl.tokens, kv_begin_[l.u] * group_, hq};
      const Region k{sl_owner.k, sl.src_offset, sl.tokens, kv_begin_[l.u], kv_size_[l.u]};
      const Region v{sl_owner.v, sl.src_offset, sl.tokens, kv_begin_[l.u], kv_size_[l.u]};
      p.transfers.push_back(
          MakeTransfer(p.name, "q", src, q, r, Region{l.gq, sl.offset, sl.tokens, 0, hq}));
      p.transfers.push_back(MakeTransfer(p.name, "k", src, k, r,
                                         Region{l.gk, sl.offset, sl.tokens, 0, kv_size_[l.u]}));
      p.transfers.push_back(MakeTransfer(p.name, "v", src, v, r,
                                         Region{l.gv, sl.offset, sl.tokens, 0, kv_size_[l.u]}));
    }
  }
  return p;
}

// The out all-to-all back: each gathered slot's output returns to the shard it came from, into
// the sender's head group of the owner's `out`.
Phase HybridBuilder::PlanBack(int chunk) {
  Phase p;
  p.name = "a2a.out.c" + std::to_string(chunk);
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    const int64_t hq = kv_size_[l.u] * group_;
    for (const Slot& sl : l.slots) {
      if (sl.chunk != chunk) continue;
      const int owner = RankOf(sl.src_u, l.i);
      const Region src{l.acc.out, sl.offset, sl.tokens, 0, hq};
      const Region dst{lay_[owner].out, sl.src_offset, sl.tokens, kv_begin_[l.u] * group_, hq};
      p.transfers.push_back(MakeTransfer(p.name, "out", r, src, owner, dst));
    }
  }
  return p;
}

// The stationary part of the all-to-all: own shard, own head group, copied locally.
void HybridBuilder::CopyOwnIn(int r) {
  if (U_ == 1) return;
  const RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t n = l.shard_tokens;
  b.Copy(OpKind::kCopy, Stream::kCompute, QHeads(r, l.q, 0, n),
         Region{l.gq, 0, n, 0, kv_size_[l.u] * group_}, "a2a own q");
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.k, 0, n),
         Region{l.gk, 0, n, 0, kv_size_[l.u]}, "a2a own k");
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.v, 0, n),
         Region{l.gv, 0, n, 0, kv_size_[l.u]}, "a2a own v");
}

void HybridBuilder::CopyOwnOut(int r) {
  const RankLayout& l = lay_[r];
  const int64_t n = l.shard_tokens;
  b_[r].Copy(OpKind::kCopy, Stream::kCompute, Region{l.acc.out, 0, n, 0, kv_size_[l.u] * group_},
             QHeads(r, l.out, 0, n), "a2a own out");
}

void HybridBuilder::Step0(int r) {
  RankLayout& l = lay_[r];
  if (U_ > 1) Consume(fwd_[0], r, false);
  CopyOwnIn(r);
  const int64_t L = l.chunk_tokens;
  const Region q = QHeads(r, l.gq, 0, L);
  const Region k = KvHeads(r, l.gk, 0, L);
  const Region v = KvHeads(r, l.gv, 0, L);
  AttendInto(r, q, k, v, &l.acc, 0, "step 0 attention");
  if (shape_.text_tokens > 0) {
    const Region tk = KvHeads(r, l.tk, 0, shape_.text_tokens);
    const Region tv = KvHeads(r, l.tv, 0, shape_.text_tokens);
    AttendInto(r, q, tk, tv, &l.acc, 0, "image q x text kv");
    if (l.tq_tokens > 0) {
      const Region tq = QHeads(r, l.tq, l.tq_begin, l.tq_tokens);
      AttendInto(r, tq, k, v, &l.tacc, 0, "text q x step 0 kv");
      AttendInto(r, tq, tk, tv, &l.tacc, 0, "text q x text kv");
    }
  }
}

}  // namespace ditscale::sp::internal
