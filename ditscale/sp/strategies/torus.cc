// Torus attention (SwiftFusion): the Ulysses all-to-all arrives in chunks; the stationary block
// (own shard, own head group: no transfer) is attended first, then each arriving chunk c:
//   its queries x every kv that has arrived (stationary + chunks 0..c), and
//   the queries that arrived before it x its kv,
// so every (query slot, kv slot) pair is attended exactly once and merged by log-sum-exp, and the
// attention of chunk c overlaps the transfer of chunk c + 1. The gathered buffers are laid out
// chunk-major (own | chunk 0 | chunk 1 ...), so "arrived so far" is always a prefix.
// The out all-to-all back is chunked the same way: in the last compute stage (the last torus
// chunk when R = 1, else the last ring step) queries are attended chunk by chunk and each
// chunk's out is sent back as soon as it is final, overlapping the remaining attention.
#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {

void HybridBuilder::Step0Pipelined(int r) {
  RankLayout& l = lay_[r];
  CopyOwnIn(r);
  const int64_t T = shape_.text_tokens;
  const Region tq = l.tq_tokens > 0 ? QHeads(r, l.tq, l.tq_begin, l.tq_tokens) : Region{};
  const Region tk = T > 0 ? KvHeads(r, l.tk, 0, T) : Region{};
  const Region tv = T > 0 ? KvHeads(r, l.tv, 0, T) : Region{};
  const int64_t n = l.shard_tokens;
  const Region q_own = QHeads(r, l.gq, 0, n);
  AttendInto(r, q_own, KvHeads(r, l.gk, 0, n), KvHeads(r, l.gv, 0, n), &l.acc, 0,
             "torus stationary");
  if (T > 0) {
    AttendInto(r, q_own, tk, tv, &l.acc, 0, "torus stationary q x text kv");
    if (l.tq_tokens > 0) {
      AttendInto(r, tq, KvHeads(r, l.gk, 0, n), KvHeads(r, l.gv, 0, n), &l.tacc, 0,
                 "torus text q x stationary kv");
      AttendInto(r, tq, tk, tv, &l.tacc, 0, "torus text q x text kv");
    }
  }
  if (U_ == 1) return;
  for (int c = 0; c < C_; ++c) {
    Consume(fwd_[c], r, false);
    const auto [a, e] = l.chunk_range[c];
    const bool last = R_ == 1 && c == C_ - 1;  // outputs become final in this stage
    const std::string tag = "torus chunk " + std::to_string(c);
    if (last) {
      // Earlier queries x the last kv chunk, chunk by chunk, each chunk's out sent back as soon
      // as it is final; then the last chunk's own queries.
      AttendInto(r, QHeads(r, l.gq, 0, l.shard_tokens), KvHeads(r, l.gk, a, e - a),
                 KvHeads(r, l.gv, a, e - a), &l.acc, 0, tag + " stationary q x kv");
      for (int cc = 0; cc < c; ++cc) {
        const auto [ca, ce] = l.chunk_range[cc];
        AttendInto(r, QHeads(r, l.gq, ca, ce - ca), KvHeads(r, l.gk, a, e - a),
                   KvHeads(r, l.gv, a, e - a), &l.acc, ca,
                   tag + " chunk " + std::to_string(cc) + " q x kv");
        Issue(back_[cc], r);
      }
      AttendInto(r, QHeads(r, l.gq, a, e - a), KvHeads(r, l.gk, 0, e), KvHeads(r, l.gv, 0, e),
                 &l.acc, a, tag + " q x arrived kv");
      if (T > 0) AttendInto(r, QHeads(r, l.gq, a, e - a), tk, tv, &l.acc, a, tag + " q x text kv");
      Issue(back_[c], r);
      if (l.tq_tokens > 0) {
        AttendInto(r, tq, KvHeads(r, l.gk, a, e - a), KvHeads(r, l.gv, a, e - a), &l.tacc, 0,
                   tag + " text q x kv");
      }
      continue;
    }
    if (a == e) continue;
    AttendInto(r, QHeads(r, l.gq, a, e - a), KvHeads(r, l.gk, 0, e), KvHeads(r, l.gv, 0, e),
               &l.acc, a, tag + " q x arrived kv");
    AttendInto(r, QHeads(r, l.gq, 0, a), KvHeads(r, l.gk, a, e - a), KvHeads(r, l.gv, a, e - a),
               &l.acc, 0, tag + " earlier q x kv");
    if (T > 0) AttendInto(r, QHeads(r, l.gq, a, e - a), tk, tv, &l.acc, a, tag + " q x text kv");
    if (l.tq_tokens > 0) {
      AttendInto(r, tq, KvHeads(r, l.gk, a, e - a), KvHeads(r, l.gv, a, e - a), &l.tacc, 0,
                 tag + " text q x kv");
    }
  }
}

void HybridBuilder::FinalStageByChunk(int r, const Region& k, const Region& v,
                                      const std::string& tag) {
  RankLayout& l = lay_[r];
  AttendInto(r, QHeads(r, l.gq, 0, l.shard_tokens), k, v, &l.acc, 0, tag + " stationary q");
  for (int c = 0; c < C_; ++c) {
    const auto [a, e] = l.chunk_range[c];
    AttendInto(r, QHeads(r, l.gq, a, e - a), k, v, &l.acc, a,
               tag + " chunk " + std::to_string(c) + " q");
    Issue(back_[c], r);
  }
}

}  // namespace ditscale::sp::internal
