// The one builder behind every strategy: a U x R hybrid of Ulysses (head-parallel all-to-all)
// and Ring (kv rotation), with optional Torus chunking of the Ulysses all-to-all and two-sided or
// one-sided transport. ulysses = (N, 1), ring = (1, N); usp / tas / torus differ in placement
// and in the pipelined step 0. See strategies.h for the algorithms and the text-token scheme.
// Transport is decided per link (OneSidedBetween): with one_sided_inter = false the
// intra-machine transfers are puts and the inter-machine ones Send / Recv in the same schedule.
//
// Build order (the ProgramBuilder derives deps from the order ops are added, so the order below
// is load-bearing): plan layouts and all transfers, [one-sided: "ready" round], issue the
// Ulysses q/k/v chunks, step-0 attention (consuming chunks), ring steps (consume block s-1,
// forward block s, attend block s, release buffers), Ulysses out back, text-out all-gather,
// [one-sided: "done" round].
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ditscale/sp/internal/program_builder.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::sp::internal {

struct Transfer {
  int src_rank = 0;
  int dst_rank = 0;
  Region src;        // final source, on src_rank
  Region dst;        // final destination, on dst_rank
  Region send_from;  // src, or the sender's staging buffer after a Pack
  Region land;       // dst, or the receiver's staging buffer before an Unpack
  int64_t tag = 0;
  int64_t free_wait = 0;  // ring, one-sided: wait for own "ring.free" >= this before the put
  std::string label;
};

struct Phase {
  std::string name;  // unique; the one-sided arrival counter of the phase
  std::vector<Transfer> transfers;
};

// A token slot of the gathered (Ulysses) buffers: `tokens` tokens from the shard of Ulysses
// peer `src_u` (same ring index), starting at `src_offset` in that shard, stored at `offset`.
struct Slot {
  int src_u = 0;
  int chunk = -1;  // -1 = own (stationary) slot
  int64_t offset = 0;
  int64_t tokens = 0;
  int64_t src_offset = 0;
};

struct Accumulator {
  int out = -1;
  int lse = -1;
  std::vector<char> fresh;  // per token: nothing accumulated yet (write directly, no merge)
};

// Heads of a rank's group that a Ulysses transfer moves and the gathered buffers holding them:
// the whole group, or one head chunk.
struct HeadSel {
  int64_t kv_begin = 0, kv_heads = 0;  // within the rank's kv-head group
  int64_t q_begin = 0, q_heads = 0;    // within the rank's query-head group
  int gq = -1, gk = -1, gv = -1;
};

// Head-chunked Ulysses (strategy ulysses, ulysses_chunks = C > 1): the rank's head group is split
// into C chunks of kv heads (and their query heads); chunk h has its own gathered buffers, so that
// its all-to-all lands contiguously and its attention is one call over all rows of its heads.
struct HeadChunk : HeadSel {
  Accumulator acc;
};

struct RankLayout {
  int rank = 0, u = 0, i = 0;
  int64_t shard_begin = 0, shard_tokens = 0;
  int q = -1, k = -1, v = -1, out = -1;
  int tq = -1, tk = -1, tv = -1, tout = -1;
  // Gathered buffers; U == 1: "ring.q/k/v" with joint text, else the caller's q, k, v.
  int gq = -1, gk = -1, gv = -1;
  int64_t chunk_tokens = 0;  // L: tokens of this rank's ring chunk
  Accumulator acc;
  int part = -1, part_lse = -1;
  int64_t tq_begin = 0, tq_tokens = 0;  // text query rows this rank computes
  // Joint text (T > 0): the rank's text query rows sit in front of the image rows of
  // gathered.q and acc (rows [0, qoff), image rows from qoff), and the text kv rows next to the
  // image kv (gathered.k/v rows [chunk_tokens, + T); torus: kall/vall rows [0, T)), so that one
  // attention covers [text; image] queries and keys. 0 otherwise. U == 1 uses the same layout in
  // its own "ring.*" work buffers (the gathered chunk is the own shard).
  int64_t qoff = 0;
  // Row of gathered.k/v where the image rows start: 0, or T for ulysses-overlap, which puts the
  // text kv in front so that [text; own slice] is one contiguous local kv block.
  int64_t kvoff = 0;
  std::vector<Slot> slots;
  std::vector<std::pair<int64_t, int64_t>> chunk_range;  // gathered [a, b) of torus chunk c
  std::vector<std::pair<int, int>> ring_loc;             // (k, v) buffer of ring block s
  // Torus (U > 1): every kv block of the ring stays resident in kall/vall, laid out in arrival
  // order: piece-major (piece 0 = stationary slot, piece c + 1 = torus chunk c), then by ring hop
  // (hop h = the block of ring index i - h; hop 0 = own block). seg_begin[p][h] / seg_tokens[p][h].
  int kall = -1, vall = -1;
  std::vector<std::vector<int64_t>> seg_begin, seg_tokens;
  std::vector<HeadChunk> heads;  // head-chunked Ulysses only
};

// "[a, e)": a token range in op labels.
std::string RowRange(int64_t a, int64_t e);

// One input phase of the torus pipeline: torus chunk `chunk`'s q and/or k, v slots.
struct TorusIn {
  Phase phase;
  int chunk = 0;
  bool q = false, kv = false;
};

class HybridBuilder {
 public:
  HybridBuilder(const SpMesh& mesh, const SpConfig& resolved, const AttentionShape& shape);
  Schedule Build();

 private:
  // hybrid.cc
  void PlanLayouts();
  // PlanLayouts' steps for rank r: its coordinates, shard and caller-bound buffers; its work
  // buffers (gathered rows, accumulator, partials); its gathered slots.
  void PlanIoBuffers(int r);
  void PlanWorkBuffers(int r, int64_t max_chunk);
  void PlanSlots(int r);
  // Build's steps: the schedule's header, the transfer phases, and the emission of the torus
  // pipeline or of the Ulysses + ring one.
  void StartSchedule();
  void PlanPhases();
  Schedule EmitTorus();
  Schedule EmitRing();
  void SyncRound(const std::vector<const Phase*>& phases, const std::string& name, bool at_end);
  void AttendInto(int r, const Region& q, const Region& k, const Region& v, Accumulator* acc,
                  int64_t acc_token_begin, const std::string& label);
  Region KvHeads(int r, int buffer, int64_t token_begin, int64_t tokens) const;
  Region QHeads(int r, int buffer, int64_t token_begin, int64_t tokens) const;
  // The rank's finished text query rows (rows [0, tq_tokens) of its accumulator, or of each head
  // chunk's), each with its first query head within the rank's group.
  std::vector<std::pair<Region, int64_t>> TextPieces(int r) const;
  Phase PlanText();
  void FinishText(int r);
  // transfers.cc
  Transfer MakeTransfer(const std::string& phase, const std::string& tensor, int src_rank,
                        const Region& src, int dst_rank, const Region& dst);
  // The sender's side of a phase: its packs, then its transfers; `packs` / `transfers` false
  // leaves that part out (ulysses-overlap packs before the one-sided "ready" round). Returns the
  // pack ops.
  std::vector<int> Issue(const Phase& phase, int r, bool packs = true, bool transfers = true);
  void Consume(const Phase& phase, int r, bool on_link_stream);
  // ulysses.cc
  // head_chunk < 0: the whole head group (torus chunk `chunk`); else head chunk head_chunk.
  HeadSel Heads(int r, int head_chunk) const;
  Phase PlanForward(int chunk, int head_chunk = -1);
  Phase PlanBack(int chunk, int head_chunk = -1);
  void CopyOwnIn(int r);
  void CopyOwnOut(int r);
  void CopyTextIn(int r, int k, int v, int64_t kv_row);
  void Step0(int r);
  void Consume(const Phase& phase, int r, Stream stream);
  // torus.cc (torus_pipeline(): torus with U > 1; torus with U = 1 is plain ring)
  bool torus_pipeline() const { return cfg_.strategy == Strategy::kTorus && U_ > 1; }
  // Text rows live in the gathered buffers (RankLayout::qoff). With U == 1 those are work
  // buffers made for it ("ring.q/k/v", one q and one kv shard per rank): the text-query calls
  // alone (T / R rows) would fill a fraction of the GPU, so the copies pay for themselves.
  bool joint_text() const { return shape_.text_tokens > 0; }
  void PlanTorusBuffers(int r);
  void PlanTorusPhases();
  void EmitTorusRing(int r, std::vector<char>* consumed);
  void EmitTorusCompute(int r, std::vector<char>* consumed);
  // EmitTorusCompute's steps (torus.cc): queries and kv segments as they arrive.
  struct TorusState;
  void TorusEnsure(TorusState& st, int phase);
  void TorusAttendPending(TorusState& st);
  void TorusOnQuery(TorusState& st, int chunk, int phase, bool flush);
  void TorusOnKv(TorusState& st, int piece, int hop, int phase, bool final);
  // ulysses_heads.cc: head-chunked Ulysses (R == 1, C > 1), each chunk's all-to-all in
  // pipelined with the attention of the chunk before and its out back with the one after.
  bool head_pipeline() const {
    return cfg_.strategy == Strategy::kUlysses && cfg_.ulysses_chunks > 1;
  }
  void PlanHeadBuffers(int r, int64_t q_rows, int64_t kv_rows);
  void EmitHeadPipeline(int r);
  Schedule BuildHeadPipeline();
  // ulysses_overlap.cc: Ulysses (R == 1, U > 1) whose all-to-alls run under three attention
  // calls cut on whole waves: local rows x local kv, the rest x all kv, local rows x remote kv.
  bool overlap_pipeline() const { return cfg_.strategy == Strategy::kUlyssesOverlap && U_ > 1; }
  // Rows per whole wave of the attention kernel for a call over q_heads (1: no alignment).
  int64_t WaveRows(int64_t q_heads) const;
  // Query rows [0, a) of rank r attended against the local kv first: whole waves.
  int64_t OverlapLocalRows(int r) const;
  void EmitOverlap(int r);
  Schedule BuildOverlap();
  // ring.cc
  void PlanRingLocations(int r);
  Phase PlanRingStep(int s);
  void RingCompute(int s, int r);
  void RingRelease(int s, int r);

  int RankOf(int u, int i) const;
  int64_t RingChunkTokens(int ring_index) const;
  LinkKind LinkOf(int a, int b) const;
  // Transfers between ranks a and b are puts (else Send / Recv): see SpConfig::one_sided_inter.
  bool OneSidedBetween(int a, int b) const { return OneSidedOn(cfg_, LinkOf(a, b)); }
  static Stream StreamOf(LinkKind link);

  SpMesh mesh_;
  SpConfig cfg_;
  AttentionShape shape_;
  int U_ = 1, R_ = 1, C_ = 1;
  int64_t H_ = 1, Hk_ = 1, group_ = 1;             // group_ = H / Hk
  std::vector<int64_t> kv_begin_, kv_size_;        // kv heads of Ulysses index u
  std::vector<int64_t> shard_begin_, shard_size_;  // by shard index i * U + u
  Schedule s_;
  std::vector<Phase> fwd_, ring_;          // Ulysses q/k/v chunks; ring steps
  std::vector<Phase> back_;                // Ulysses out back, per torus chunk (slots of chunk c)
  std::vector<Phase> hfwd_, hback_;        // head-chunked Ulysses: q/k/v in and out back per chunk
  std::vector<TorusIn> tin_;               // torus: q/k/v all-to-all phases, in issue order
  std::vector<std::vector<Phase>> tring_;  // torus: [piece][ring step] kv forwarding
  Phase text_;                             // text-out all-gather
  std::vector<ProgramBuilder> b_;
  OpBudget budget_;  // every rank's builder counts here (kMaxScheduleOps, strategies.h)
  std::vector<RankLayout> lay_;
  int64_t next_tag_ = 1;
};

}  // namespace ditscale::sp::internal
