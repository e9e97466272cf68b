// Head-chunked Ulysses (strategy ulysses with ulysses_chunks = C > 1, R = 1): the rank's head
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
  const std::vector<int64_t> split = EvenSplit(kv_size_[l.u], cfg_.ulysses_chunks);
  int64_t kb = 0;
  l.heads.clear();
  for (int h = 0; h < cfg_.ulysses_chunks; ++h) {
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
    c.acc.out =
        b.AddBuffer("acc.out" + tag, BufferRole::kWork, BufferInit::kZero, q_rows, c.q_heads, d, e);
    c.acc.lse = b.AddBuffer("acc.lse" + tag, BufferRole::kWork, BufferInit::kNegInf, q_rows,
                            c.q_heads, 1, 4);
    c.acc.fresh.assign(q_rows, 1);
    l.heads.push_back(std::move(c));
  }
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
    AttendInto(r, Region{c.gq, 0, l.qoff + L, 0, c.q_heads}, Region{c.gk, 0, L + T, 0, c.kv_heads},
               Region{c.gv, 0, L + T, 0, c.kv_heads}, &c.acc, 0,
               (T > 0 ? "attention (text + image)" : "attention") + tag);
    Issue(hback_[h], r);
    b.Copy(OpKind::kCopy, Stream::kCompute, Region{c.acc.out, l.qoff, n, 0, c.q_heads},
           Region{l.out, 0, n, qh0 + c.q_begin, c.q_heads}, "a2a own out" + tag);
  }
}

Schedule HybridBuilder::BuildHeadPipeline() {
  DS_CHECK(R_ == 1 && U_ > 1, "head-chunked Ulysses needs R = 1 and U > 1");
  const int n = U_;
  hfwd_.clear();
  hback_.clear();
  for (int h = 0; h < cfg_.ulysses_chunks; ++h) {
    hfwd_.push_back(PlanForward(0, h));
    hback_.push_back(PlanBack(0, h));
  }
  text_ = shape_.text_tokens > 0 ? PlanText() : Phase{};
  std::vector<const Phase*> all;
  for (const Phase& p : hfwd_) all.push_back(&p);
  for (const Phase& p : hback_) all.push_back(&p);
  all.push_back(&text_);
  s_.notes.push_back("ulysses in " + std::to_string(cfg_.ulysses_chunks) +
                     " head chunks: each chunk's all-to-all overlaps the attention of the chunk "
                     "before, its out back the attention of the chunk after");
  if (cfg_.one_sided) SyncRound(all, "ready", false);
  for (const Phase& p : hfwd_) {
    for (int r = 0; r < n; ++r) Issue(p, r);
  }
  for (int r = 0; r < n; ++r) EmitHeadPipeline(r);
  for (int r = 0; r < n; ++r) Issue(text_, r);
  for (int r = 0; r < n; ++r) {
    FinishText(r);
    for (const Phase& p : hback_) Consume(p, r, false);
    Consume(text_, r, false);
  }
  if (cfg_.one_sided) SyncRound(all, "done", true);
  return std::move(s_);
}

}  // namespace ditscale::sp::internal
