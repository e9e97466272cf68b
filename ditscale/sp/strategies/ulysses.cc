// Ulysses: the head-parallel all-to-all of q, k, v in (chunked for Torus), out back, and the
// plain (non-pipelined) step 0: the whole gathered ring chunk attended at once.
#include <string>

#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {
namespace {

// "<base>c<chunk>" (torus chunk of the whole head group) or "<base>h<head_chunk>".
std::string PhaseName(const char* base, int chunk, int head_chunk) {
  std::string s = base;
  s += head_chunk < 0 ? 'c' : 'h';
  s += std::to_string(head_chunk < 0 ? chunk : head_chunk);
  return s;
}

}  // namespace

HeadSel HybridBuilder::Heads(int r, int head_chunk) const {
  const RankLayout& l = lay_[r];
  if (head_chunk >= 0) return l.heads[head_chunk];
  HeadSel h;
  h.kv_heads = kv_size_[l.u];
  h.q_heads = h.kv_heads * group_;
  h.gq = l.gq;
  h.gk = l.gk;
  h.gv = l.gv;
  return h;
}

// Chunk `chunk` of the q/k/v all-to-all: every rank receives, from each Ulysses peer of its
// ring chunk, sub-chunk `chunk` of the peer's shard for the receiver's head group (or, with
// head_chunk >= 0, for that head chunk of it: head-chunked Ulysses, where chunk is 0).
Phase HybridBuilder::PlanForward(int chunk, int head_chunk) {
  Phase p;
  p.name = PhaseName("a2a.in.", chunk, head_chunk);
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    const HeadSel h = Heads(r, head_chunk);
    const int64_t qh = kv_begin_[l.u] * group_ + h.q_begin, kh = kv_begin_[l.u] + h.kv_begin;
    for (const Slot& sl : l.slots) {
      if (sl.chunk != chunk) continue;
      const int src = RankOf(sl.src_u, l.i);
      const RankLayout& o = lay_[src];
      p.transfers.push_back(
          MakeTransfer(p.name, "q", src, Region{o.q, sl.src_offset, sl.tokens, qh, h.q_heads}, r,
                       Region{h.gq, l.qoff + sl.offset, sl.tokens, 0, h.q_heads}));
      p.transfers.push_back(
          MakeTransfer(p.name, "k", src, Region{o.k, sl.src_offset, sl.tokens, kh, h.kv_heads}, r,
                       Region{h.gk, l.kvoff + sl.offset, sl.tokens, 0, h.kv_heads}));
      p.transfers.push_back(
          MakeTransfer(p.name, "v", src, Region{o.v, sl.src_offset, sl.tokens, kh, h.kv_heads}, r,
                       Region{h.gv, l.kvoff + sl.offset, sl.tokens, 0, h.kv_heads}));
    }
  }
  return p;
}

// The out all-to-all back: each gathered slot's output returns to the shard it came from, into
// the sender's head group (or head chunk) of the owner's `out`.
Phase HybridBuilder::PlanBack(int chunk, int head_chunk) {
  Phase p;
  p.name = PhaseName("a2a.out.", chunk, head_chunk);
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    const HeadSel h = Heads(r, head_chunk);
    const int acc = head_chunk < 0 ? l.acc.out : l.heads[head_chunk].acc.out;
    for (const Slot& sl : l.slots) {
      if (sl.chunk != chunk) continue;
      const int owner = RankOf(sl.src_u, l.i);
      const Region src{acc, l.qoff + sl.offset, sl.tokens, 0, h.q_heads};
      const Region dst{lay_[owner].out, sl.src_offset, sl.tokens,
                       kv_begin_[l.u] * group_ + h.q_begin, h.q_heads};
      p.transfers.push_back(MakeTransfer(p.name, "out", r, src, owner, dst));
    }
  }
  return p;
}

// The stationary part of the all-to-all: own shard, own head group, copied locally.
void HybridBuilder::CopyOwnIn(int r) {
  const RankLayout& l = lay_[r];
  if (l.gq == l.q) return;  // pure ring without joint text: attends the caller's tensors
  ProgramBuilder& b = b_[r];
  const int64_t n = l.shard_tokens;
  const std::string tag = U_ > 1 ? "a2a own " : "ring own ";
  // k, v before q: with U == 1 the ring forwards the own block from gk / gv once they are in.
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.k, 0, n),
         Region{l.gk, l.kvoff, n, 0, kv_size_[l.u]}, tag + "k");
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.v, 0, n),
         Region{l.gv, l.kvoff, n, 0, kv_size_[l.u]}, tag + "v");
  b.Copy(OpKind::kCopy, Stream::kCompute, QHeads(r, l.q, 0, n),
         Region{l.gq, l.qoff, n, 0, kv_size_[l.u] * group_}, tag + "q");
}

void HybridBuilder::CopyOwnOut(int r) {
  const RankLayout& l = lay_[r];
  const int64_t n = l.shard_tokens;
  b_[r].Copy(OpKind::kCopy, Stream::kCompute,
             Region{l.acc.out, l.qoff, n, 0, kv_size_[l.u] * group_}, QHeads(r, l.out, 0, n),
             U_ > 1 ? "a2a own out" : "ring own out");
}

// Joint text: the rank's text query rows (its ring share, own head group) into gathered.q rows
// [0, qoff), and all T text kv rows (own kv heads) into rows [kv_row, + T) of `k`, `v`.
void HybridBuilder::CopyTextIn(int r, int k, int v, int64_t kv_row) {
  const RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t T = shape_.text_tokens, hkv = kv_size_[l.u];
  if (l.qoff > 0) {
    b.Copy(OpKind::kCopy, Stream::kCompute, QHeads(r, l.tq, l.tq_begin, l.qoff),
           Region{l.gq, 0, l.qoff, 0, hkv * group_}, "text q in");
  }
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.tk, 0, T), Region{k, kv_row, T, 0, hkv},
         "text k in");
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.tv, 0, T), Region{v, kv_row, T, 0, hkv},
         "text v in");
}

void HybridBuilder::Step0(int r) {
  RankLayout& l = lay_[r];
  const int64_t L = l.chunk_tokens, T = shape_.text_tokens;
  if (U_ == 1) {
    // Own k, v first: the ring forwards them from ring.k/v (rows [0, L)) as soon as they are in.
    CopyOwnIn(r);
    if (joint_text()) CopyTextIn(r, l.gk, l.gv, L);
  } else {
    // Local text rows first: the copies run while the all-to-all is still arriving.
    if (joint_text()) CopyTextIn(r, l.gk, l.gv, L);
    Consume(fwd_[0], r, false);
    CopyOwnIn(r);
  }
  // Joint text: one call over [text; image] queries x [image; text] keys instead of four calls
  // and two merges: the text-query calls alone are too small to fill the GPU (T / R rows).
  AttendInto(r, QHeads(r, l.gq, 0, l.qoff + L), KvHeads(r, l.gk, 0, L + T),
             KvHeads(r, l.gv, 0, L + T), &l.acc, 0,
             T > 0 ? "step 0 attention (text + image)" : "step 0 attention");
}

}  // namespace ditscale::sp::internal
