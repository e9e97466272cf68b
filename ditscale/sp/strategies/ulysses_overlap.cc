// Ulysses with its all-to-alls under the attention (strategy "ulysses-overlap", R = 1, U >= 2).
//
// Plain Ulysses waits for all of q, k, v before its one attention call and sends out back after
// it: on 2 H200s at S = 65,536 that leaves ~1.4 ms in front of a 43 ms call and ~0.4 ms behind it
// (bench/results/sp-attention_h200x2_2026-12.md). Cutting the call into pieces hides transfers but
// costs waves: cuDNN's forward runs 128-row tiles in waves of one CTA per SM, a partial last wave
// takes a full wave's time, and two equal halves of a 46.9-wave call take 48 waves, +3.1% measured;
// halves on whole waves +0.4-0.8% (lab/results/sp-attn-split_h200_2026-12/). Torus with one chunk
// has this schedule's shape but cuts where the data lies (own shard | remote shards): one wave
// more.
//
// Rank layout: gathered.q = [text query rows | own slice | remote slots], gathered.k/v =
// [text kv | own slice | remote slots] (kvoff = T), so that the local kv is one block [0, T + n).
//   link stream   q, k, v of every peer (one group); then out back; then the text-out all-gather.
//   compute       text and own-slice copies;
//                 call 1: rows [0, a) x local kv [0, T + n)      (nothing remote needed)
//                 wait for q, k, v;
//                 call 2: rows [a, end) x all kv                 (every remote row: final, their
//                         out leaves for its owners now)
//                 call 3: rows [0, a) x remote kv [T + n, end), LSE-merged into call 1's rows
//                 own out, text out.
// a = the local rows (text + own slice) rounded down to whole waves, so calls 1 and 3 run whole
// waves (of shorter CTAs) and call 2 holds the one partial wave a single call would have too:
// a = k * tile * slots / gcd(slots, batch * heads) (SpConfig::attention_slots / _tile_tokens; all
// local rows when slots is 0 or no whole wave fits). Nothing is exposed but the copies and one
// merge of a rows (in place of plain Ulysses' whole way in and out). Same bytes and FLOPs as
// Ulysses.
#include <numeric>
#include <string>

#include "ditscale/core/error.h"
#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {

int64_t HybridBuilder::WaveRows(int64_t q_heads) const {
  if (cfg_.attention_slots <= 0) return 1;
  const int64_t slots = cfg_.attention_slots;
  const int64_t bh = shape_.batch * q_heads;
  return static_cast<int64_t>(cfg_.attention_tile_tokens) * (slots / std::gcd(slots, bh));
}

int64_t HybridBuilder::OverlapLocalRows(int r) const {
  const RankLayout& l = lay_[r];
  const int64_t local = l.qoff + l.shard_tokens;
  const int64_t wave = WaveRows(kv_size_[l.u] * group_);
  const int64_t a = local / wave * wave;
  return a > 0 ? a : local;
}

void HybridBuilder::EmitOverlap(int r) {
  RankLayout& l = lay_[r];
  const int64_t L = l.chunk_tokens, T = shape_.text_tokens, n = l.shard_tokens;
  const int64_t rows = l.qoff + L, local_kv = T + n, a = OverlapLocalRows(r);
  const auto Q = [&](int64_t b, int64_t e) { return QHeads(r, l.gq, b, e - b); };
  const auto attend = [&](int64_t b, int64_t e, int64_t kb, int64_t ke, const char* what) {
    AttendInto(
        r, Q(b, e), KvHeads(r, l.gk, kb, ke - kb), KvHeads(r, l.gv, kb, ke - kb), &l.acc, b,
        std::string("overlap ") + what + " q " + RowRange(b, e) + " x kv " + RowRange(kb, ke));
  };
  if (joint_text()) CopyTextIn(r, l.gk, l.gv, 0);
  CopyOwnIn(r);
  attend(0, a, 0, local_kv, "local");
  Consume(fwd_[0], r, Stream::kCompute);
  attend(a, rows, 0, T + L, "rest");
  Issue(back_[0], r);
  attend(0, a, local_kv, T + L, "local");
  CopyOwnOut(r);
  FinishText(r);
  Issue(text_, r);
}

Schedule HybridBuilder::BuildOverlap() {
  DS_CHECK(R_ == 1 && U_ > 1, "ulysses-overlap needs R = 1 and U > 1");
  const int n = U_;
  fwd_ = {PlanForward(0)};
  back_ = {PlanBack(0)};
  text_ = shape_.text_tokens > 0 ? PlanText() : Phase{};
  std::vector<const Phase*> all = {&fwd_[0], &back_[0], &text_};
  s_.notes.push_back(
      "ulysses-overlap: local rows x local kv while q, k, v arrive; the remote rows' out leaves "
      "under the local rows x remote kv; query chunks on whole waves of the attention kernel");
  // One-sided: the packs of q, k, v are the only SM work of the all-to-all (the puts and signals
  // are copy engines and stream memory operations), and cuDNN's attention call holds every SM
  // until it ends: packs issued after it would wait for it, and the all-to-all with them. So the
  // packs come first on the link stream, before the "ready" round (they write only the sender's
  // staging buffers), and the first attention call waits for them. Two-sided: NCCL's kernels need
  // SMs for the whole transfer; making the call wait for them would serialize it.
  std::vector<std::vector<int>> packs(n);
  if (cfg_.one_sided) {
    for (int r = 0; r < n; ++r) packs[r] = Issue(fwd_[0], r, true, false);
    SyncRound(all, "ready", false);
  }
  for (int r = 0; r < n; ++r) Issue(fwd_[0], r, !cfg_.one_sided, true);
  for (int r = 0; r < n; ++r) {
    const int first = static_cast<int>(s_.ranks[r].ops.size());
    EmitOverlap(r);
    for (int i = first; i < static_cast<int>(s_.ranks[r].ops.size()); ++i) {
      if (s_.ranks[r].ops[i].kind == OpKind::kAttention) {
        b_[r].AddDeps(i, packs[r]);
        break;
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    Consume(back_[0], r, false);
    Consume(text_, r, false);
  }
  if (cfg_.one_sided) SyncRound(all, "done", true);
  return std::move(s_);
}

}  // namespace ditscale::sp::internal
