// Torus attention (SwiftFusion), fully pipelined: the cross-machine Ulysses all-to-all arrives in
// torus chunks, the ring within the machine forwards every chunk as soon as it has arrived, and
// the out all-to-all back leaves query chunk by query chunk as each becomes final.
//
// Data layout of rank (u, i):
//   gathered.q  the rank's text query rows (joint text, RankLayout::qoff), own (stationary) slot,
//               then torus chunk 0, 1, ... (slots of the Ulysses peers). acc alike.
//   kall/vall   the T text kv rows, then the k, v of EVERY block of the ring (head group u),
//               resident for the whole layer, in arrival order: piece-major (piece 0 = the
//               stationary slot of each block, piece c + 1 = torus chunk c of each block), then by
//               ring hop (hop 0 = own block, hop h = the block of ring index i - h). So "all kv
//               that has arrived" is always a prefix.
// Pipeline:
//   inter stream  the all-to-all phases in order, k, v one chunk ahead of q: kv0, kv1, q0, kv2,
//                 q1, ..., q(C-1) (a query chunk is only useful once there is kv to attend, and
//                 the last query chunks can then be finished and sent back one by one).
//   intra stream  ring forwarding piece by piece: piece p (stationary at once, chunk c as soon as
//                 it arrived) makes R - 1 hops, each hop forwarding what the previous one brought.
//   compute       with [0, qa) the queries and [0, kd) the kv attended so far (every pair of the
//                 two prefixes done exactly once, merged by log-sum-exp):
//                 kv [kd, kq) arrived -> queries [0, qa) x kv [kd, kq)   (grouped so that each op
//                                        has >= kMinKvTokens kv, or the stationary block size)
//                 q chunk [qa, e) arrived -> queries [qa, e) x kv [0, kd)
//                 The last kv event (the whole last piece) is split by query chunk and each
//                 chunk's out all-to-all back is issued as soon as the chunk is final; query
//                 chunks arriving after it are final at once (grouped to >= kMinQTokens, the last
//                 one alone). The stationary queries x the last piece go last: their out stays
//                 local, so that compute covers the last chunk's way back.
// No ring buffer is reused, so the one-sided form needs no ring flow control: the only
// synchronisation across machines is the "ready" round at the start and the "done" round at the
// end. Cost: kall/vall hold R ring blocks instead of two (S * H/U * d * e * 2 bytes per rank).
#include <algorithm>

#include "ditscale/core/error.h"
#include "ditscale/sp/internal/hybrid.h"

namespace ditscale::sp::internal {
namespace {

// Smallest kv range worth one attention + merge (smaller ranges are grouped with the next).
constexpr int64_t kMinKvTokens = 4096;
// Smallest group of query chunks attended at once after all kv is in (the last chunk excepted).
constexpr int64_t kMinQTokens = 2048;

struct Item {
  bool q = false;  // a query chunk arrives (else a kv segment)
  int chunk = 0;   // q: torus chunk
  int piece = 0;   // kv: piece (0 = stationary, c + 1 = chunk c)
  int hop = 0;     // kv: ring hop
  int phase = -1;  // index into tin_ of the phase that brings it (-1: local or ring)
};

}  // namespace

void HybridBuilder::PlanTorusBuffers(int r) {
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int pieces = C_ + 1;
  l.seg_begin.assign(pieces, std::vector<int64_t>(R_, 0));
  l.seg_tokens.assign(pieces, std::vector<int64_t>(R_, 0));
  // Joint text: the T text kv rows come first, local from the start (an always-arrived prefix).
  int64_t cursor = joint_text() ? shape_.text_tokens : 0;
  for (int p = 0; p < pieces; ++p) {
    for (int h = 0; h < R_; ++h) {
      const RankLayout& src = lay_[RankOf(l.u, ((l.i - h) % R_ + R_) % R_)];
      const int64_t tokens =
          p == 0 ? src.shard_tokens : src.chunk_range[p - 1].second - src.chunk_range[p - 1].first;
      l.seg_begin[p][h] = cursor;
      l.seg_tokens[p][h] = tokens;
      cursor += tokens;
    }
  }
  const int64_t hkv = kv_size_[l.u];
  l.kall = b.AddBuffer("kall", BufferRole::kWork, BufferInit::kUndefined, cursor, hkv,
                       shape_.head_dim, shape_.dtype_bytes);
  l.vall = b.AddBuffer("vall", BufferRole::kWork, BufferInit::kUndefined, cursor, hkv,
                       shape_.head_dim, shape_.dtype_bytes);
}

void HybridBuilder::PlanTorusPhases() {
  tin_.clear();
  tring_.clear();
  const int n = U_ * R_;
  auto plan_in = [&](int c, bool with_q, bool with_kv) {
    TorusIn t;
    t.chunk = c;
    t.q = with_q;
    t.kv = with_kv;
    t.phase.name = std::string("a2a.in.") +
                   (with_q && with_kv ? ""
                    : with_q          ? "q."
                                      : "kv.") +
                   "c" + std::to_string(c);
    for (int r = 0; r < n; ++r) {
      const RankLayout& l = lay_[r];
      const int64_t hq = kv_size_[l.u] * group_, hkv = kv_size_[l.u];
      const int64_t kv_base = l.seg_begin[c + 1][0] - l.chunk_range[c].first;
      for (const Slot& sl : l.slots) {
        if (sl.chunk != c) continue;
        const int src = RankOf(sl.src_u, l.i);
        const RankLayout& o = lay_[src];
        if (with_q) {
          const Region q{o.q, sl.src_offset, sl.tokens, kv_begin_[l.u] * group_, hq};
          t.phase.transfers.push_back(MakeTransfer(
              t.phase.name, "q", src, q, r, Region{l.gq, l.qoff + sl.offset, sl.tokens, 0, hq}));
        }
        if (with_kv) {
          const Region dk{l.kall, kv_base + sl.offset, sl.tokens, 0, hkv};
          const Region dv{l.vall, kv_base + sl.offset, sl.tokens, 0, hkv};
          t.phase.transfers.push_back(
              MakeTransfer(t.phase.name, "k", src,
                           Region{o.k, sl.src_offset, sl.tokens, kv_begin_[l.u], hkv}, r, dk));
          t.phase.transfers.push_back(
              MakeTransfer(t.phase.name, "v", src,
                           Region{o.v, sl.src_offset, sl.tokens, kv_begin_[l.u], hkv}, r, dv));
        }
      }
    }
    tin_.push_back(std::move(t));
  };
  // k, v lead q by one chunk: kv0, kv1, q0, kv2, q1, ..., q(C-1). Measured in the simulator
  // against "all kv first" (too little work while the kv is in flight when U >= 4) and "q, k, v
  // together" (queries only final at the very end): ahead or equal on every p4de setting.
  plan_in(0, false, true);
  for (int c = 0; c < C_; ++c) {
    if (c + 1 < C_) plan_in(c + 1, false, true);
    plan_in(c, true, false);
  }
  // Ring forwarding: at step s of piece p, rank i sends the piece of block i - s (its hop s
  // segment) to rank i + 1 (where it is hop s + 1).
  tring_.resize(C_ + 1);
  for (int p = 0; p <= C_; ++p) {
    for (int s = 0; s + 1 < R_; ++s) {
      Phase ph;
      ph.name = "ring.p" + std::to_string(p) + ".s" + std::to_string(s);
      for (int r = 0; r < n; ++r) {
        const RankLayout& l = lay_[r];
        const int nx = RankOf(l.u, (l.i + 1) % R_);
        const RankLayout& ln = lay_[nx];
        const int64_t tokens = l.seg_tokens[p][s];
        DS_CHECK(ln.seg_tokens[p][s + 1] == tokens, "torus ring piece sizes disagree");
        if (tokens == 0) continue;
        const int64_t hkv = kv_size_[l.u];
        const int64_t from = l.seg_begin[p][s], to = ln.seg_begin[p][s + 1];
        ph.transfers.push_back(MakeTransfer(ph.name, "k", r, Region{l.kall, from, tokens, 0, hkv},
                                            nx, Region{ln.kall, to, tokens, 0, hkv}));
        ph.transfers.push_back(MakeTransfer(ph.name, "v", r, Region{l.vall, from, tokens, 0, hkv},
                                            nx, Region{ln.vall, to, tokens, 0, hkv}));
      }
      tring_[p].push_back(std::move(ph));
    }
  }
}

// The stationary copies, then the ring forwarding of every piece on the link streams: each hop
// waits (one-sided: for the arrival signal) only for the data it forwards.
void HybridBuilder::EmitTorusRing(int r, std::vector<char>* consumed) {
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t n = l.shard_tokens, hq = kv_size_[l.u] * group_, hkv = kv_size_[l.u];
  b.Copy(OpKind::kCopy, Stream::kCompute, QHeads(r, l.q, 0, n), Region{l.gq, l.qoff, n, 0, hq},
         "a2a own q");
  if (joint_text()) CopyTextIn(r, l.kall, l.vall, 0);
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.k, 0, n),
         Region{l.kall, l.seg_begin[0][0], n, 0, hkv}, "a2a own k");
  b.Copy(OpKind::kCopy, Stream::kCompute, KvHeads(r, l.v, 0, n),
         Region{l.vall, l.seg_begin[0][0], n, 0, hkv}, "a2a own v");
  if (R_ == 1) return;
  const Stream send_st = StreamOf(LinkOf(r, RankOf(l.u, (l.i + 1) % R_)));
  const Stream recv_st = StreamOf(LinkOf(RankOf(l.u, (l.i - 1 + R_) % R_), r));
  for (int p = 0; p <= C_; ++p) {
    if (p >= 1) {
      for (size_t x = 0; x < tin_.size(); ++x) {
        if (tin_[x].kv && tin_[x].chunk == p - 1 && !(*consumed)[x]) {
          Consume(tin_[x].phase, r, send_st);
          (*consumed)[x] = 1;
        }
      }
    }
    for (int s = 0; s + 1 < R_; ++s) {
      if (s >= 1) Consume(tring_[p][s - 1], r, send_st);
      Issue(tring_[p][s], r);
    }
    Consume(tring_[p][R_ - 2], r, recv_st);
  }
}

// One rank's torus compute in progress (EmitTorusCompute). Text is always joint here (U > 1):
// the text kv is the prefix [0, T) of kall, local from the start, and the rank's text query rows
// [0, o) of gq / acc travel with the stationary queries (those starting at image row 0). Queries
// are named by gathered (image) rows.
struct HybridBuilder::TorusState {
  HybridBuilder* b = nullptr;
  int r = 0;
  RankLayout* l = nullptr;
  std::vector<char>* consumed = nullptr;
  int64_t n = 0, o = 0;  // the rank's image tokens; its text query rows (qoff)
  // Queries [qa, qp) arrived and not yet attended; kv [0, kd) attended, [kd, kq) arrived.
  int64_t qa = 0, qp = 0, kd = 0, kq = 0;
  std::vector<int> arrived, pending;  // query chunks attended / waiting
  bool kv_done = false;
  int64_t min_kv = 0, min_q = 0;
  // The stationary queries x the last kv event, left for the very end when query chunks are
  // still to come: its out stays local, so it covers the last chunk's way back.
  Region deferred_k, deferred_v;
  std::string deferred_label;

  int64_t Row(int64_t a) const { return a == 0 ? 0 : a + o; }
  Region Q(int64_t a, int64_t e) const { return b->QHeads(r, l->gq, Row(a), e + o - Row(a)); }
  Region K(int64_t a, int64_t e) const { return b->KvHeads(r, l->kall, a, e - a); }
  Region V(int64_t a, int64_t e) const { return b->KvHeads(r, l->vall, a, e - a); }
};

namespace {

// Arrival order of queries and kv segments (the same for every rank).
std::vector<Item> TorusArrivals(const std::vector<TorusIn>& tin, int rings) {
  std::vector<Item> items;
  for (int h = 0; h < rings; ++h) items.push_back(Item{false, 0, 0, h, -1});
  for (size_t x = 0; x < tin.size(); ++x) {
    const TorusIn& t = tin[x];
    if (t.kv) items.push_back(Item{false, 0, t.chunk + 1, 0, static_cast<int>(x)});
    if (t.q) items.push_back(Item{true, t.chunk, 0, 0, static_cast<int>(x)});
    if (t.kv) {
      for (int h = 1; h < rings; ++h) items.push_back(Item{false, 0, t.chunk + 1, h, -1});
    }
  }
  return items;
}

}  // namespace

void HybridBuilder::TorusEnsure(TorusState& st, int phase) {
  if (phase < 0 || (*st.consumed)[phase]) return;
  Consume(tin_[phase].phase, st.r, Stream::kCompute);
  (*st.consumed)[phase] = 1;
}

// Queries [qa, qp) x kv [0, kd); once all kv is in, each chunk is final: send its out back.
void HybridBuilder::TorusAttendPending(TorusState& st) {
  if (st.pending.empty()) return;
  const std::string tag = "torus q " + RowRange(st.qa, st.qp);
  AttendInto(st.r, st.Q(st.qa, st.qp), st.K(0, st.kd), st.V(0, st.kd), &st.l->acc, st.Row(st.qa),
             tag + " x kv " + RowRange(0, st.kd));
  st.qa = st.qp;
  for (int c : st.pending) {
    st.arrived.push_back(c);
    if (st.kv_done) Issue(back_[c], st.r);
  }
  st.pending.clear();
}

// A query chunk arrives; small chunks are grouped into one attention, the last chunk stands
// alone (its out is exposed): `flush` when it or the next query event is the last.
void HybridBuilder::TorusOnQuery(TorusState& st, int chunk, int phase, bool flush) {
  TorusEnsure(st, phase);
  const auto [a, e] = st.l->chunk_range[chunk];
  DS_CHECK(a == st.qp || a == e, "torus query chunks out of order");
  st.qp = std::max(st.qp, e);
  st.pending.push_back(chunk);
  if (st.qp - st.qa >= st.min_q || flush || !st.kv_done) TorusAttendPending(st);
}

// A kv segment arrives; attended once min_kv have gathered (within the last piece, once at its
// end), the final one finishing every query chunk.
void HybridBuilder::TorusOnKv(TorusState& st, int piece, int hop, int phase, bool final) {
  TorusEnsure(st, phase);
  const int r = st.r;
  RankLayout& l = *st.l;
  DS_CHECK(l.seg_begin[piece][hop] == st.kq, "torus kv segments out of order");
  st.kq += l.seg_tokens[piece][hop];
  if (!final && (st.kq - st.kd < st.min_kv || piece == C_)) return;
  const int64_t kd = st.kd, kq = st.kq;
  const std::string kv_tag = " x kv " + RowRange(kd, kq);
  if (!final) {
    AttendInto(r, st.Q(0, st.qa), st.K(kd, kq), st.V(kd, kq), &l.acc, 0,
               (kd == 0 ? "torus stationary q" : "torus q " + RowRange(0, st.qa)) + kv_tag);
  } else {
    TorusAttendPending(st);
    // Finish the queries one chunk at a time; each chunk's out leaves as soon as it is final.
    for (int c : st.arrived) {
      const auto [a, e] = l.chunk_range[c];
      AttendInto(r, st.Q(a, e), st.K(kd, kq), st.V(kd, kq), &l.acc, st.Row(a),
                 "torus chunk " + std::to_string(c) + " q" + kv_tag);
      Issue(back_[c], r);
    }
    // The stationary queries' out stays local: they go last, behind the chunks' way back.
    st.deferred_k = st.K(kd, kq);
    st.deferred_v = st.V(kd, kq);
    st.deferred_label = "torus stationary q" + kv_tag;
    if (st.o > 0) {
      // The text rows leave the deferred stationary call: their all-gather starts now.
      AttendInto(r, QHeads(r, l.gq, 0, st.o), st.K(kd, kq), st.V(kd, kq), &l.acc, 0,
                 "torus text q" + kv_tag);
    }
  }
  st.kd = kq;
  if (final) {
    const int64_t total = b_[r].decl(l.kall).tokens;
    DS_CHECK(st.kd == total, "torus kv covers ", st.kd, " of ", total, " tokens");
    st.kv_done = true;
    FinishText(r);
    Issue(text_, r);
  }
}

void HybridBuilder::EmitTorusCompute(int r, std::vector<char>* consumed) {
  RankLayout& l = lay_[r];
  const int64_t n = l.shard_tokens;
  TorusState st;
  st.b = this;
  st.r = r;
  st.l = &l;
  st.consumed = consumed;
  st.n = n;
  st.o = l.qoff;
  st.qa = st.qp = n;
  st.kq = shape_.text_tokens;
  st.min_kv = std::min(kMinKvTokens, std::max<int64_t>(n, 1));
  st.min_q = std::min(kMinQTokens, std::max<int64_t>(n, 1));
  const std::vector<Item> items = TorusArrivals(tin_, R_);
  int last_kv = -1, last_q = -1;
  for (int x = 0; x < static_cast<int>(items.size()); ++x) (items[x].q ? last_q : last_kv) = x;
  for (int x = 0; x < static_cast<int>(items.size()); ++x) {
    const Item& it = items[x];
    if (it.q) {
      TorusOnQuery(st, it.chunk, it.phase, x == last_q || x + 1 == last_q);
    } else {
      TorusOnKv(st, it.piece, it.hop, it.phase, x == last_kv);
    }
  }
  TorusAttendPending(st);
  if (st.deferred_k.valid()) {
    AttendInto(r, QHeads(r, l.gq, st.o, n), st.deferred_k, st.deferred_v, &l.acc, st.o,
               st.deferred_label);
    CopyOwnOut(r);
  }
}

}  // namespace ditscale::sp::internal
