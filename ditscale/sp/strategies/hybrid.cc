// HybridBuilder: layouts, the build driver, one-sided sync rounds, accumulation and text tokens.
#include "ditscale/sp/internal/hybrid.h"

#include <algorithm>
#include <map>
#include <set>

#include "ditscale/core/error.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp::internal {

std::string RowRange(int64_t a, int64_t e) {
  return "[" + std::to_string(a) + ", " + std::to_string(e) + ")";
}

HybridBuilder::HybridBuilder(const SpMesh& mesh, const SpConfig& resolved,
                             const AttentionShape& shape)
    : mesh_(mesh), cfg_(resolved), shape_(shape) {
  U_ = cfg_.ulysses_degree;
  R_ = cfg_.ring_degree;
  C_ = cfg_.strategy == Strategy::kTorus ? cfg_.torus_chunks : 1;
  H_ = shape_.heads;
  Hk_ = shape_.kv_heads_or_heads();
  group_ = H_ / Hk_;
  kv_size_ = EvenSplit(Hk_, U_);
  kv_begin_.assign(U_, 0);
  for (int u = 1; u < U_; ++u) kv_begin_[u] = kv_begin_[u - 1] + kv_size_[u - 1];
  // Shard i * U + u is the image-token range that ditscale.sp.shard_range gives rank
  // RankOf(u, i) (the even split by rank, larger shards first), so that every rank holds the
  // tokens the caller splits for it under every placement (attention runs over all tokens in any
  // order: a ring chunk need not be contiguous in the sequence).
  const std::vector<int64_t> by_rank = EvenSplit(shape_.seq_tokens, U_ * R_);
  std::vector<int64_t> begin_by_rank(U_ * R_, 0);
  for (int r = 1; r < U_ * R_; ++r) begin_by_rank[r] = begin_by_rank[r - 1] + by_rank[r - 1];
  shard_size_.assign(U_ * R_, 0);
  shard_begin_.assign(U_ * R_, 0);
  for (int i = 0; i < R_; ++i) {
    for (int u = 0; u < U_; ++u) {
      const int r = RankOfCoords(cfg_, u, i);
      shard_size_[i * U_ + u] = by_rank[r];
      shard_begin_[i * U_ + u] = begin_by_rank[r];
    }
  }
}

int HybridBuilder::RankOf(int u, int i) const { return RankOfCoords(cfg_, u, i); }

int64_t HybridBuilder::RingChunkTokens(int ring_index) const {
  int64_t total = 0;
  for (int u = 0; u < U_; ++u) total += shard_size_[ring_index * U_ + u];
  return total;
}

LinkKind HybridBuilder::LinkOf(int a, int b) const {
  return mesh_.same_machine(a, b) ? LinkKind::kIntraMachine : LinkKind::kInterMachine;
}

Stream HybridBuilder::StreamOf(LinkKind link) {
  return link == LinkKind::kInterMachine ? Stream::kCommInter : Stream::kCommIntra;
}

Region HybridBuilder::QHeads(int r, int buffer, int64_t token_begin, int64_t tokens) const {
  const RankLayout& l = lay_[r];
  const BufferDecl& d = b_[r].decl(buffer);
  const int64_t hb = d.heads == H_ ? kv_begin_[l.u] * group_ : 0;
  return Region{buffer, token_begin, tokens, hb, kv_size_[l.u] * group_};
}

Region HybridBuilder::KvHeads(int r, int buffer, int64_t token_begin, int64_t tokens) const {
  const RankLayout& l = lay_[r];
  const BufferDecl& d = b_[r].decl(buffer);
  const int64_t hb = d.heads == Hk_ && U_ > 1 ? kv_begin_[l.u] : 0;
  return Region{buffer, token_begin, tokens, hb, kv_size_[l.u]};
}

void HybridBuilder::PlanLayouts() {
  const int n = U_ * R_;
  s_.ranks.resize(n);
  lay_.resize(n);
  b_.clear();
  budget_ = OpBudget{0, 2 * kMaxScheduleOps};
  for (int r = 0; r < n; ++r) {
    s_.ranks[r].rank = r;
    b_.emplace_back(&s_.ranks[r], shape_, &budget_);
  }
  int64_t max_chunk = 0;
  for (int i = 0; i < R_; ++i) max_chunk = std::max(max_chunk, RingChunkTokens(i));
  for (int r = 0; r < n; ++r) {
    PlanIoBuffers(r);
    PlanWorkBuffers(r, max_chunk);
    PlanSlots(r);
  }
  // Ring buffers need every rank's slot layout (torus lays out all blocks by piece).
  for (int r = 0; r < n; ++r) {
    if (torus_pipeline()) {
      PlanTorusBuffers(r);
    } else if (!head_pipeline()) {
      PlanRingLocations(r);
    }
  }
}

void HybridBuilder::PlanIoBuffers(int r) {
  const int64_t d = shape_.head_dim;
  const int e = shape_.dtype_bytes;
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  RankProgram& prog = s_.ranks[r];
  const RankCoords rc = CoordsOfRank(cfg_, r);
  l.rank = r;
  l.u = rc.ulysses_index;
  l.i = rc.ring_index;
  const int shard = l.i * U_ + l.u;
  l.shard_begin = shard_begin_[shard];
  l.shard_tokens = shard_size_[shard];
  l.q = b.AddBuffer("q", BufferRole::kInput, BufferInit::kUndefined, l.shard_tokens, H_, d, e);
  l.k = b.AddBuffer("k", BufferRole::kInput, BufferInit::kUndefined, l.shard_tokens, Hk_, d, e);
  l.v = b.AddBuffer("v", BufferRole::kInput, BufferInit::kUndefined, l.shard_tokens, Hk_, d, e);
  // The pure ring without joint text accumulates straight into the caller's out.
  const bool out_is_acc = U_ == 1 && !joint_text();
  l.out = b.AddBuffer("out", BufferRole::kOutput,
                      out_is_acc ? BufferInit::kZero : BufferInit::kUndefined, l.shard_tokens, H_,
                      d, e);
  prog.image_token_begin = l.shard_begin;
  prog.image_token_count = l.shard_tokens;
  prog.q = l.q;
  prog.k = l.k;
  prog.v = l.v;
  prog.out = l.out;
  const int64_t T = shape_.text_tokens;
  if (T > 0) {
    l.tq = b.AddBuffer("text_q", BufferRole::kInput, BufferInit::kUndefined, T, H_, d, e);
    l.tk = b.AddBuffer("text_k", BufferRole::kInput, BufferInit::kUndefined, T, Hk_, d, e);
    l.tv = b.AddBuffer("text_v", BufferRole::kInput, BufferInit::kUndefined, T, Hk_, d, e);
    l.tout = b.AddBuffer("text_out", BufferRole::kOutput, BufferInit::kUndefined, T, H_, d, e);
    prog.text_q = l.tq;
    prog.text_k = l.tk;
    prog.text_v = l.tv;
    prog.text_out = l.tout;
    const std::vector<int64_t> text_split = EvenSplit(shape_.text_tokens, R_);
    l.tq_tokens = text_split[l.i];
    for (int j = 0; j < l.i; ++j) l.tq_begin += text_split[j];
  }
  l.chunk_tokens = RingChunkTokens(l.i);
}

void HybridBuilder::PlanWorkBuffers(int r, int64_t max_chunk) {
  const int64_t d = shape_.head_dim;
  const int e = shape_.dtype_bytes;
  RankLayout& l = lay_[r];
  ProgramBuilder& b = b_[r];
  const int64_t hq = kv_size_[l.u] * group_, hkv = kv_size_[l.u];
  const int64_t T = shape_.text_tokens;
  int64_t acc_tokens = l.shard_tokens;
  if (U_ == 1 && !joint_text()) {  // out is the accumulator (PlanIoBuffers)
    l.gq = l.q;
    l.gk = l.k;
    l.gv = l.v;
    l.acc.out = l.out;
  } else {
    // U == 1 with joint text: the same layout with the rank's own shard as the "gathered"
    // chunk ("ring.q" = [text q rows; own q], "ring.k/v" = [own k/v; text k/v], the ring's own
    // buffer), so that every kv block is one attention over all query rows + one merge.
    const std::string name = U_ > 1 ? "gathered" : "ring";
    l.qoff = joint_text() ? l.tq_tokens : 0;
    l.kvoff = overlap_pipeline() ? T : 0;
    const int64_t q_rows = l.qoff + max_chunk;
    // Text kv after the image rows (torus: in front of kall, PlanTorusBuffers), so ring blocks
    // landing in gathered.k/v still start at row 0.
    const int64_t kv_rows = max_chunk + (joint_text() ? T : 0);
    if (head_pipeline()) {  // per-chunk gathered buffers and accumulators, nothing shared
      PlanHeadBuffers(r, q_rows, kv_rows);
    } else {
      l.gq = b.AddBuffer(name + ".q", BufferRole::kWork, BufferInit::kUndefined, q_rows, hq, d, e);
      if (!torus_pipeline()) {  // torus gathers k, v into kall / vall (PlanTorusBuffers)
        l.gk =
            b.AddBuffer(name + ".k", BufferRole::kWork, BufferInit::kUndefined, kv_rows, hkv, d, e);
        l.gv =
            b.AddBuffer(name + ".v", BufferRole::kWork, BufferInit::kUndefined, kv_rows, hkv, d, e);
      }
      l.acc.out = b.AddBuffer("acc.out", BufferRole::kWork, BufferInit::kZero, q_rows, hq, d, e);
      acc_tokens = q_rows;
    }
  }
  if (head_pipeline()) return;
  l.acc.lse = b.AddBuffer("acc.lse", BufferRole::kWork, BufferInit::kNegInf, acc_tokens, hq, 1, 4);
  l.acc.fresh.assign(acc_tokens, 1);
  const int64_t part_tokens = l.qoff + l.chunk_tokens;
  l.part = b.AddBuffer("partial.out", BufferRole::kScratch, BufferInit::kUndefined, part_tokens, hq,
                       d, e);
  l.part_lse = b.AddBuffer("partial.lse", BufferRole::kScratch, BufferInit::kUndefined, part_tokens,
                           hq, 1, 4);
}

// Gathered slots: own shard first, then torus chunk by chunk, peers in rotated order.
void HybridBuilder::PlanSlots(int r) {
  RankLayout& l = lay_[r];
  l.slots.push_back(Slot{l.u, -1, 0, l.shard_tokens, 0});
  int64_t cursor = l.shard_tokens;
  for (int c = 0; c < C_; ++c) {
    const int64_t a = cursor;
    for (int dlt = 1; dlt < U_; ++dlt) {
      const int pu = (l.u + dlt) % U_;
      const std::vector<int64_t> sub = EvenSplit(shard_size_[l.i * U_ + pu], C_);
      int64_t off = 0;
      for (int cc = 0; cc < c; ++cc) off += sub[cc];
      if (sub[c] == 0) continue;
      l.slots.push_back(Slot{pu, c, cursor, sub[c], off});
      cursor += sub[c];
    }
    l.chunk_range.emplace_back(a, cursor);
  }
  DS_CHECK(U_ == 1 || cursor == l.chunk_tokens, "slot layout covers ", cursor, " of ",
           l.chunk_tokens, " tokens");
}

void HybridBuilder::AttendInto(int r, const Region& q, const Region& k, const Region& v,
                               Accumulator* acc, int64_t acc_token_begin,
                               const std::string& label) {
  if (q.empty() || k.tokens == 0) return;
  ProgramBuilder& b = b_[r];
  const RankLayout& l = lay_[r];
  const Region acc_out{acc->out, acc_token_begin, q.tokens, QHeads(r, acc->out, 0, 0).head_begin,
                       q.heads};
  const Region acc_lse{acc->lse, acc_token_begin, q.tokens, 0, q.heads};
  bool fresh = true;
  for (int64_t t = 0; t < q.tokens; ++t) fresh = fresh && acc->fresh[acc_token_begin + t];
  if (fresh) {
    b.Attention(q, k, v, acc_out, acc_lse, label);
    std::fill_n(acc->fresh.begin() + acc_token_begin, q.tokens, 0);
    return;
  }
  const Region part{l.part, 0, q.tokens, 0, q.heads};
  const Region part_lse{l.part_lse, 0, q.tokens, 0, q.heads};
  b.Attention(q, k, v, part, part_lse, label);
  b.Merge(part, part_lse, acc_out, acc_lse, "merge " + label);
}

std::vector<std::pair<Region, int64_t>> HybridBuilder::TextPieces(int r) const {
  const RankLayout& l = lay_[r];
  if (l.heads.empty()) return {{Region{l.acc.out, 0, l.tq_tokens, 0, kv_size_[l.u] * group_}, 0}};
  std::vector<std::pair<Region, int64_t>> pieces;
  for (const HeadChunk& c : l.heads) {
    pieces.push_back({Region{c.acc.out, 0, l.tq_tokens, 0, c.q_heads}, c.q_begin});
  }
  return pieces;
}

Phase HybridBuilder::PlanText() {
  Phase p;
  p.name = "text";
  const int n = U_ * R_;
  for (int r = 0; r < n; ++r) {
    const RankLayout& l = lay_[r];
    if (l.tq_tokens == 0) continue;
    const std::vector<std::pair<Region, int64_t>> pieces = TextPieces(r);
    for (const auto& [src, head] : pieces) {
      const std::string tensor = pieces.size() == 1 ? "out" : "out.h" + std::to_string(head);
      for (int x = 0; x < n; ++x) {
        if (x == r) continue;
        const Region dst{lay_[x].tout, l.tq_begin, l.tq_tokens, kv_begin_[l.u] * group_ + head,
                         src.heads};
        p.transfers.push_back(MakeTransfer(p.name, tensor, r, src, x, dst));
      }
    }
  }
  return p;
}

void HybridBuilder::FinishText(int r) {
  const RankLayout& l = lay_[r];
  if (l.tq_tokens == 0) return;
  for (const auto& [src, head] : TextPieces(r)) {
    b_[r].Copy(OpKind::kCopy, Stream::kCompute, src,
               Region{l.tout, l.tq_begin, l.tq_tokens, kv_begin_[l.u] * group_ + head, src.heads},
               "text out own piece");
  }
}

// One-sided: every rank signals "<name>.<link>" to each rank that puts into it and waits for the
// signals of every rank it puts into. At the start this says "my buffers are free"; at the end
// ("done") it says "all your data has arrived and been consumed". Only pairs linked by puts take
// part: a Recv writes its buffer only once the receiver's stream reaches it, and a Send completes
// only with its Recv, so NCCL transfers need no flow control of their own.
void HybridBuilder::SyncRound(const std::vector<const Phase*>& phases, const std::string& name,
                              bool at_end) {
  const int n = U_ * R_;
  std::vector<std::set<int>> writers(n), targets(n);
  for (const Phase* p : phases) {
    for (const Transfer& t : p->transfers) {
      if (!OneSidedBetween(t.src_rank, t.dst_rank)) continue;
      writers[t.dst_rank].insert(t.src_rank);
      targets[t.src_rank].insert(t.dst_rank);
    }
  }
  for (int r = 0; r < n; ++r) {
    ProgramBuilder& b = b_[r];
    const int last_compute = b.LastOnStream(Stream::kCompute);
    for (LinkKind link : {LinkKind::kIntraMachine, LinkKind::kInterMachine}) {
      const Stream st = StreamOf(link);
      const std::string counter = name + "." + ToString(link);
      int64_t expect = 0;
      for (int x : targets[r]) expect += LinkOf(r, x) == link;
      // The signals of a round are issued back to back (one group), not one after the other.
      int group = -1;
      for (int w : writers[r]) {
        if (LinkOf(r, w) != link) continue;
        std::vector<int> deps;
        if (at_end && last_compute >= 0) deps.push_back(last_compute);
        if (group < 0) group = b.NewGroup();
        b.Signal(st, w, link, counter, 1, {}, deps, name + " signal to " + std::to_string(w),
                 group);
      }
      if (expect > 0) b.Wait(st, counter, expect, {}, name + " wait");
    }
  }
}

// The schedule's header: strategy, mesh, config, shape, head groups and notes.
void HybridBuilder::StartSchedule() {
  s_ = Schedule{};
  s_.strategy = StrategyName(cfg_.strategy);
  s_.mesh = mesh_;
  s_.config = cfg_;
  s_.shape = shape_;
  for (int u = 0; u < U_; ++u) {
    s_.head_group_begin.push_back(kv_begin_[u] * group_);
    s_.head_group_size.push_back(kv_size_[u] * group_);
  }
  if (shape_.text_tokens > 0) {
    s_.notes.push_back(
        "text tokens: image queries attend the local text k/v once; text query rows are split "
        "over the ring ranks (each attends every kv block it sees), then all-gathered" +
        std::string(joint_text() ? "; text rows share the gathered buffers: one attention "
                                   "covers [text; image] queries and keys"
                                 : ""));
  }
}

// The transfer phases: Ulysses forward / back per chunk, ring steps, the text gather.
void HybridBuilder::PlanPhases() {
  fwd_.clear();
  ring_.clear();
  back_.clear();
  text_ = Phase{};
  if (U_ > 1) {
    if (!torus_pipeline()) {
      for (int c = 0; c < C_; ++c) fwd_.push_back(PlanForward(c));
    }
    for (int c = 0; c < C_; ++c) back_.push_back(PlanBack(c));
  }
  if (!torus_pipeline()) {
    for (int s = 0; s + 1 < R_; ++s) ring_.push_back(PlanRingStep(s));
  }
  if (shape_.text_tokens > 0 && U_ * R_ > 1) text_ = PlanText();
}

// Torus: the pieces' phases, then each rank's ring, compute, back and text.
Schedule HybridBuilder::EmitTorus() {
  const int n = U_ * R_;
  PlanTorusPhases();
  std::vector<const Phase*> phases;
  for (const TorusIn& t : tin_) phases.push_back(&t.phase);
  for (const auto& steps : tring_) {
    for (const Phase& p : steps) phases.push_back(&p);
  }
  for (const Phase& p : back_) phases.push_back(&p);
  phases.push_back(&text_);
  if (cfg_.one_sided) SyncRound(phases, "ready", false);
  for (int r = 0; r < n; ++r) {
    std::vector<char> consumed(tin_.size(), 0);
    for (const TorusIn& t : tin_) Issue(t.phase, r);
    EmitTorusRing(r, &consumed);
    EmitTorusCompute(r, &consumed);
    for (const Phase& p : back_) Consume(p, r, false);
    Consume(text_, r, false);
  }
  if (cfg_.one_sided) SyncRound(phases, "done", true);
  return std::move(s_);
}

// Ulysses forward, the ring steps with their compute, then back and text, rank by rank.
Schedule HybridBuilder::EmitRing() {
  const int n = U_ * R_;
  std::vector<const Phase*> all;
  for (const Phase& p : fwd_) all.push_back(&p);
  for (const Phase& p : ring_) all.push_back(&p);
  for (const Phase& p : back_) all.push_back(&p);
  all.push_back(&text_);
  if (cfg_.one_sided) SyncRound(all, "ready", false);
  for (const Phase& p : fwd_) {
    for (int r = 0; r < n; ++r) Issue(p, r);
  }
  for (int r = 0; r < n; ++r) Step0(r);
  for (int s = 0; s < R_; ++s) {
    for (int r = 0; r < n; ++r) {
      if (s >= 1) Consume(ring_[s - 1], r, /*on_link_stream=*/true);
      if (s + 1 < R_) Issue(ring_[s], r);
      if (s >= 1) RingCompute(s, r);
      if (cfg_.one_sided) RingRelease(s, r);
    }
  }
  for (int r = 0; r < n; ++r) {
    for (const Phase& p : back_) Issue(p, r);
    Issue(text_, r);
  }
  for (int r = 0; r < n; ++r) {
    if (lay_[r].acc.out != lay_[r].out) CopyOwnOut(r);
    FinishText(r);
    for (const Phase& p : back_) Consume(p, r, false);
    Consume(text_, r, false);
  }
  if (cfg_.one_sided) SyncRound(all, "done", true);
  return std::move(s_);
}

Schedule HybridBuilder::Build() {
  StartSchedule();
  PlanLayouts();
  if (head_pipeline()) return BuildHeadPipeline();
  if (overlap_pipeline()) return BuildOverlap();
  PlanPhases();
  return torus_pipeline() ? EmitTorus() : EmitRing();
}

}  // namespace ditscale::sp::internal
