// Head-chunked Ulysses (strategy "ulysses" with torus_chunks = C > 1, R = 1): the rank's head
// group is cut into C chunks of kv heads (with their query heads). Chunk h has its own gathered
// q/k/v and accumulator, so its all-to-all lands contiguously (no unpack) and its attention is
// ONE call over all [text; image] rows of its heads, written straight into its accumulator (no
// merge: heads are independent). Pipeline per rank:
//   link streams  q/k/v all-to-all of chunk 0, 1, ..., C-1 (one group each, in order), then the
//                 out of chunk h back as soon as its attention is done;
//   compute       text + own-slice copies of chunk h, wait for chunk h, attention of chunk h,
//                 own out slice of chunk h.
// So only chunk 0's all-to-all in and chunk C-1's out back are exposed, against all of them in
// plain Ulysses; the price is C smaller attention calls (heads / C each) and C transfers per peer
// and phase. Same bytes and FLOPs as plain Ulysses.
#include <string>

#include "ditscale/core/error.h"
#include "ditscale/sp/internal/hybrid.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp::internal {

void HybridBuilder::PlanHeadBuffers(int r, int64_t q_rows, int64_t kv_rows) {
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t d = shape_.head_dim;
  const int e = shape_.dtype_bytes;
  const std::vector<int64_t> split = EvenSplit(kv_size_[l.u], cfg_.torus_chunks);
  int64_t kb = 0;
  l.heads.clear();
  for (int h = 0; h < cfg_.torus_chunks; ++h) {
    HeadChunk c;
    c.kv_begin = kb;
    c.kv_heads = split[h];
    c.q_begin = kb * group_;
    c.q_heads = split[h] * group_;
    kb += split[h];
    const std::string tag = ".h" + std::to_string(h);
    c.gq = b.AddBuffer("gathered.q" + tag, BufferRole::kWork, BufferInit::kUndefined, q_rows,
                       c.q_heads, d, e);
    c.gk = b.AddBuffer("gathered.k" + tag, BufferRole::kWork, BufferInit::kUndefined, kv_rows,
                       c.kv_heads, d, e);
    c.gv = b.AddBuffer("gathered.v" + tag, BufferRole::kWork, BufferInit::kUndefined, kv_rows,
                       c.kv_heads, d, e);
    c.acc.out = b.AddBuffer("acc.out" + tag, BufferRole::kWork, BufferInit::kZero, q_rows,
                            c.q_heads, d, e);
    c.acc.lse = b.AddBuffer("acc.lse" + tag, BufferRole::kWork, BufferInit::kNegInf, q_rows,
                            c.q_heads, 1, 4);
    c.acc.fresh.assign(q_rows, 1);
    l.heads.push_back(std::move(c));
  }
}

// Chunk h of the q/k/v all-to-all: from each Ulysses peer, the receiver's heads of chunk h of the
// peer's shard, into rows [qoff + slot offset) of gathered.q.h / [slot offset) of gathered.k/v.h.
Phase HybridBuilder::PlanForwardHeads(int h) {
  Phase p;
  p.name = "a2a.in.h" + std::to_string(h);
  for (int r = 0; r < U_ * R_; ++r) {
    const RankLayout& l = lay_[r];
    const HeadChunk& c = l.heads[h];
    for (const Slot& sl : l.slots) {
      if (sl.chunk < 0) continue;  // own slot: copied locally
      const int src = RankOf(sl.src_u, l.i);
      const RankLayout& o = lay_[src];
      const int64_t qh = kv_begin_[l.u] * group_ + c.q_begin, kh = kv_begin_[l.u] + c.kv_begin;
      p.transfers.push_back(
          MakeTransfer(p.name, "q", src, Region{o.q, sl.src_offset, sl.tokens, qh, c.q_heads}, r,
                       Region{c.gq, l.qoff + sl.offset, sl.tokens, 0, c.q_heads}));
      p.transfers.push_back(
          MakeTransfer(p.name, "k", src, Region{o.k, sl.src_offset, sl.tokens, kh, c.kv_heads}, r,
                       Region{c.gk, sl.offset, sl.tokens, 0, c.kv_heads}));
      p.transfers.push_back(
          MakeTransfer(p.name, "v", src, Region{o.v, sl.src_offset, sl.tokens, kh, c.kv_heads}, r,
                       Region{c.gv, sl.offset, sl.tokens, 0, c.kv_heads}));
    }
  }
  return p;
}

// Chunk h's out back: each peer slot's rows of acc.out.h to the owner's out, heads of chunk h.
Phase HybridBuilder::PlanBackHeads(int h) {
  Phase p;
  p.name = "a2a.out.h" + std::to_string(h);
  for (int r = 0; r < U_ * R_; ++r) {
    const RankLayout& l = lay_[r];
    const HeadChunk& c = l.heads[h];
    for (const Slot& sl : l.slots) {
      if (sl.chunk < 0) continue;
      const int owner = RankOf(sl.src_u, l.i);
      p.transfers.push_back(MakeTransfer(
          p.name, "out", r, Region{c.acc.out, l.qoff + sl.offset, sl.tokens, 0, c.q_heads},
          owner,
          Region{lay_[owner].out, sl.src_offset, sl.tokens, kv_begin_[l.u] * group_ + c.q_begin,
                 c.q_heads}));
    }
  }
  return p;
}

// Text output: every rank computed all T text query rows of its head group (R = 1), chunk by
// chunk in rows [0, qoff) of acc.out.h; each chunk's rows go to every other rank's text_out.
Phase HybridBuilder::PlanTextHeads() {
  Phase p;
  p.name = "text";
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    if (l.tq_tokens == 0) continue;
    for (const HeadChunk& c : l.heads) {
      for (int x = 0; x < n; ++x) {
        if (x == r) continue;
        p.transfers.push_back(MakeTransfer(
            p.name, "out.h" + std::to_string(c.q_begin), r,
            Region{c.acc.out, 0, l.tq_tokens, 0, c.q_heads}, x,
            Region{lay_[x].tout, l.tq_begin, l.tq_tokens, kv_begin_[l.u] * group_ + c.q_begin,
                   c.q_heads}));
      }
    }
  }
  return p;
}

void HybridBuilder::EmitHeadPipeline(int r) {
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t n = l.shard_tokens, L = l.chunk_tokens, T = shape_.text_tokens;
  const int64_t qh0 = kv_begin_[l.u] * group_, kh0 = kv_begin_[l.u];
  for (int h = 0; h < static_cast<int>(l.heads.size()); ++h) {
    HeadChunk& c = l.heads[h];
    const std::string tag = " h" + std::to_string(h);
    // Local rows first (text, own slice): they run while the chunk is still arriving.
    if (T > 0) {
      if (l.qoff > 0) {
        b.Copy(OpKind::kCopy, Stream::kCompute,
               Region{l.tq, l.tq_begin, l.qoff, qh0 + c.q_begin, c.q_heads},
               Region{c.gq, 0, l.qoff, 0, c.q_heads}, "text q in" + tag);
      }
      b.Copy(OpKind::kCopy, Stream::kCompute, Region{l.tk, 0, T, kh0 + c.kv_begin, c.kv_heads},
             Region{c.gk, L, T, 0, c.kv_heads}, "text k in" + tag);
      b.Copy(OpKind::kCopy, Stream::kCompute, Region{l.tv, 0, T, kh0 + c.kv_begin, c.kv_heads},
             Region{c.gv, L, T, 0, c.kv_heads}, "text v in" + tag);
    }
    b.Copy(OpKind::kCopy, Stream::kCompute, Region{l.k, 0, n, kh0 + c.kv_begin, c.kv_heads},
           Region{c.gk, 0, n, 0, c.kv_heads}, "a2a own k" + tag);
    b.Copy(OpKind::kCopy, Stream::kCompute, Region{l.v, 0, n, kh0 + c.kv_begin, c.kv_heads},
           Region{c.gv, 0, n, 0, c.kv_heads}, "a2a own v" + tag);
    b.Copy(OpKind::kCopy, Stream::kCompute, Region{l.q, 0, n, qh0 + c.q_begin, c.q_heads},
           Region{c.gq, l.qoff, n, 0, c.q_heads}, "a2a own q" + tag);
    Consume(hfwd_[h], r, Stream::kCompute);
    AttendInto(r, Region{c.gq, 0, l.qoff + L, 0, c.q_heads},
               Region{c.gk, 0, L + T, 0, c.kv_heads}, Region{c.gv, 0, L + T, 0, c.kv_heads},
               &c.acc, 0, (T > 0 ? "attention (text + image)" : "attention") + tag);
    Issue(hback_[h], r);
    b.Copy(OpKind::kCopy, Stream::kCompute, Region{c.acc.out, l.qoff, n, 0, c.q_heads},
           Region{l.out, 0, n, qh0 + c.q_begin, c.q_heads}, "a2a own out" + tag);
    if (l.tq_tokens > 0) {
      b.Copy(OpKind::kCopy, Stream::kCompute, Region{c.acc.out, 0, l.tq_tokens, 0, c.q_heads},
             Region{l.tout, l.tq_begin, l.tq_tokens, qh0 + c.q_begin, c.q_heads},
             "text out own piece" + tag);
    }
  }
}

Schedule HybridBuilder::BuildHeadPipeline() {
  DS_CHECK(R_ == 1 && U_ > 1, "head-chunked Ulysses needs R = 1 and U > 1");
  const int n = U_;
  hfwd_.clear();
  hback_.clear();
  for (int h = 0; h < cfg_.torus_chunks; ++h) {
    hfwd_.push_back(PlanForwardHeads(h));
    hback_.push_back(PlanBackHeads(h));
  }
  text_ = shape_.text_tokens > 0 ? PlanTextHeads() : Phase{};
  std::vector<const Phase*> all;
  for (const Phase& p : hfwd_) all.push_back(&p);
  for (const Phase& p : hback_) all.push_back(&p);
  all.push_back(&text_);
  s_.notes.push_back("ulysses in " + std::to_string(cfg_.torus_chunks) +
                     " head chunks: each chunk's all-to-all overlaps the attention of the chunk "
                     "before, its out back the attention of the chunk after");
  if (cfg_.one_sided) SyncRound(all, "ready", false);
  for (const Phase& p : hfwd_) {
    for (int r = 0; r < n; ++r) Issue(p, r);
  }
  for (int r = 0; r < n; ++r) EmitHeadPipeline(r);
  for (int r = 0; r < n; ++r) Issue(text_, r);
  for (int r = 0; r < n; ++r) {
    for (const Phase& p : hback_) Consume(p, r, false);
    Consume(text_, r, false);
  }
  if (cfg_.one_sided) SyncRound(all, "done", true);
  return std::move(s_);
}

}  // namespace ditscale::sp::internal
