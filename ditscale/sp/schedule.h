// Sequence-parallel attention as data: the schedule of one attention layer on every rank.
//
// A Schedule says, for each rank, which buffers it owns and the ordered list of operations it runs
// (transfers, attention of a query block against a key/value block, log-sum-exp merges, local
// copies). The same schedule is run by the CPU reference executor (ref_executor.h: real data,
// tests), by the simulator (predicted time) and by the GPU executor. Builders for the strategies
// (Ulysses, Ring, USP, SwiftFusion TAS, Torus) are in strategies.h.
//
// Execution model (every consumer of a schedule follows it):
// - A rank runs three in-order streams (like CUDA streams): kCompute, kCommIntra (transfers over
//   intra-machine links) and kCommInter (transfers over inter-machine links). An op starts when
//   (a) the op before it on the same stream has completed, (b) every op in `deps` (indices of
//   earlier ops of the same rank, any stream) has completed and (c) for Recv/Wait, its remote
//   partner has delivered. Consecutive ops on one stream with the same `group` >= 0 form a group
//   (ncclGroupStart/End): they start together, run concurrently and the op after the group
//   starts once all of them completed.
// - Two-sided: Send(peer, tag) and Recv(peer, tag) match on (sender, receiver, tag); they complete
//   together once both have started (rendezvous; validation assumes it, so a valid schedule does
//   not rely on eager buffering).
// - One-sided: Put writes `src` (local) into `dst` on rank `peer` (a region of the PEER's buffer);
//   if `counter` is set it is a put-with-signal: after the data is visible at the peer, the peer's
//   counter `counter` is increased by `count`. A Signal increases the peer's counter without data.
//   Wait blocks its stream until the rank's own counter `counter` is >= `count`. Counters start at
//   0 at the beginning of the layer.
// - Buffers are per rank, declared in RankProgram::buffers, shaped [batch, tokens, heads, width]
//   row-major (width = head_dim for q/k/v/out, 1 for log-sum-exp which is always float32).
//   A Region selects a token range and a head range of one buffer, all batches, all width.
//
// Tokens: every rank starts with q, k, v of its image/video token shard (all heads) and with the
// full joint text tokens (all heads, replicated: MMDiT). The layer's result is dense attention over
// the concatenation [text; image] of all tokens: each rank ends with `out` for its image shard
// (all heads) and `text_out` for all text tokens (all heads, identical on every rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/strategy.h"

namespace ditscale::sp {

// The cluster as the schedule sees it. rank = machine * gpus_per_machine + local_gpu.
struct SpMesh {
  int machines = 1;
  int gpus_per_machine = 1;

  int ranks() const { return machines * gpus_per_machine; }
  int machine_of(int rank) const { return rank / gpus_per_machine; }
  int local_of(int rank) const { return rank % gpus_per_machine; }
  bool same_machine(int a, int b) const { return machine_of(a) == machine_of(b); }
};

// Where the Ulysses group lies in the mesh for hybrid (Ulysses x Ring) strategies.
enum class Placement {
  kStrategyDefault,  // usp -> kUlyssesInner; swiftfusion-tas, torus -> kUlyssesOuter
  // Ulysses group = ulysses_degree consecutive ranks (within a machine when it divides
  // gpus_per_machine), ring across groups: rank = ring_index * U + ulysses_index (USP, xDiT).
  kUlyssesInner,
  // Ring group = ring_degree consecutive ranks (within a machine), Ulysses across them:
  // rank = ulysses_index * R + ring_index (SwiftFusion's topology-aware scheduling).
  kUlyssesOuter,
};

// Which strategy and degrees. ulysses_degree * ring_degree must equal the mesh's rank count.
struct SpConfig {
  // ulysses (U = N, R = 1), ulysses-overlap (the same, all-to-alls under the attention),
  // ring (U = 1, R = N), usp, swiftfusion-tas, torus (strategy.h; names: StrategyName).
  // For ulysses / ring a degree left at 0 is filled in; for the hybrids both must be given
  // (or 0 for the default: U = gpus_per_machine for usp, U = machines for tas/torus).
  Strategy strategy = Strategy::kUlysses;
  int ulysses_degree = 0;
  int ring_degree = 0;
  // Torus only, in [1, kMaxTorusChunks] (strategies.h): the Ulysses all-to-all (q, k, v in) is
  // split into this many token chunks, each pipelined with the attention of the chunk before.
  // 1 = tas with the stationary block first. Other strategies: 1.
  int torus_chunks = 1;
  // Ulysses only, in [1, kMaxUlyssesChunks] (strategies.h) and at most the kv heads of the
  // smallest Ulysses head group: the head group is cut into this many head chunks, each chunk's
  // all-to-all pipelined with the attention of the chunk before (strategies/ulysses_heads.cc).
  // 1 = plain Ulysses. Other strategies: 1.
  int ulysses_chunks = 1;
  bool one_sided = false;  // Put + Signal / Wait (NVSHMEM) instead of Send / Recv (NCCL)
  // Scope of one_sided (ignored, and resolved to true, when one_sided is false). true: puts on
  // every link. false: puts on intra-machine links only, Send / Recv (NCCL) on inter-machine links
  // ("nvshmem-intra": for NVSHMEM builds without a remote transport, and for emulated machines,
  // where NVSHMEM would bypass the emulated network over NVLink).
  bool one_sided_inter = true;
  Placement placement = Placement::kStrategyDefault;
  // The attention kernel's waves (Topology::attention_slots / attention_tile_tokens): CTAs in
  // flight and query rows per CTA. ulysses-overlap cuts its query chunks on whole waves; 0 = no
  // alignment. The planner (EvaluateConfig) fills a 0 from the topology; the GPU runtime sets
  // them from the device (its SM count).
  int attention_slots = 0;
  int attention_tile_tokens = 128;
  // SMs kept out of the compute stream's reach for the comm streams' kernels (NCCL's, packs):
  // the compute stream runs in a CUDA green context of the largest partition that leaves at
  // least this many SMs (Topology::ComputeSms). 0 = the whole GPU. Schedules do not depend on it;
  // the simulator and the GPU executor do. attention_slots is the whole GPU's either way.
  int comm_sms = 0;
};

// One attention layer (non-causal, softmax scale 1/sqrt(head_dim)).
struct AttentionShape {
  int64_t batch = 1;
  int64_t seq_tokens = 0;   // image/video tokens S, in total; sharded over the N ranks
  int64_t text_tokens = 0;  // joint MMDiT text tokens T, replicated on every rank (0 = none)
  int64_t heads = 1;        // query heads H
  int64_t kv_heads = 0;     // key/value heads (GQA); 0 = heads. Must divide heads.
  int64_t head_dim = 64;    // d
  int dtype_bytes = 2;      // e: bytes per element of q, k, v and out (2 = bf16/fp16, 4 = fp32)

  int64_t kv_heads_or_heads() const { return kv_heads > 0 ? kv_heads : heads; }
};

enum class OpKind {
  kSend,       // src -> matching Recv on `peer`, tag `tag`
  kRecv,       // from `peer`, tag `tag` -> dst
  kPut,        // src -> dst on `peer` (+ optional signal `counter` += `count` on the peer)
  kSignal,     // peer's `counter` += `count` (a pure synchronisation, no data)
  kWait,       // until own `counter` >= `count`; `dst` (optional) = the region it makes valid
  kAttention,  // softmax(src_q . key^T / sqrt(d)) . value -> dst (out), dst_lse (log-sum-exp)
  kMerge,      // LSE-merge (src, src_lse) into the accumulator (dst, dst_lse)
  kPack,       // copy a strided region into a contiguous staging buffer before a transfer
  kUnpack,     // copy a contiguous staging buffer into a strided region after a transfer
  kCopy,       // any other local copy src -> dst
};

enum class Stream { kCompute = 0, kCommIntra = 1, kCommInter = 2 };
inline constexpr int kNumStreams = 3;

enum class LinkKind { kNone, kIntraMachine, kInterMachine };

// What a buffer holds (for printing, memory accounting and the executor's inputs/outputs).
enum class BufferRole {
  kInput,    // q, k, v, text_q, text_k, text_v: filled before the layer
  kOutput,   // out, text_out: the layer's result
  kWork,     // gathered q/k/v, accumulators, ring kv buffers
  kScratch,  // partial (out, lse) of one attention before its merge
  kStaging,  // contiguous send/receive staging for Pack/Unpack
};

// Initial content of a buffer at the start of the layer.
enum class BufferInit { kUndefined, kZero, kNegInf };

struct BufferDecl {
  std::string name;  // unique within the rank, e.g. "q", "kv0.k", "stage.q.to3"
  BufferRole role = BufferRole::kWork;
  BufferInit init = BufferInit::kUndefined;
  int64_t tokens = 0;
  int64_t heads = 0;
  int64_t width = 0;      // head_dim, or 1 for a log-sum-exp buffer
  int element_bytes = 0;  // dtype_bytes, or 4 for log-sum-exp
  int64_t elements(int64_t batch) const { return batch * tokens * heads * width; }
};

// [token_begin, token_begin + tokens) x [head_begin, head_begin + heads) of buffer `buffer`
// (an index into the owning rank's buffers; for Put's dst, into the PEER's buffers), all batches.
struct Region {
  int buffer = -1;  // -1 = no region
  int64_t token_begin = 0;
  int64_t tokens = 0;
  int64_t head_begin = 0;
  int64_t heads = 0;

  bool valid() const { return buffer >= 0; }
  bool empty() const { return tokens == 0 || heads == 0; }
};

struct Op {
  OpKind kind = OpKind::kCopy;
  Stream stream = Stream::kCompute;
  int group = -1;         // see the execution model; -1 = not grouped
  std::vector<int> deps;  // earlier ops of this rank that must complete first
  int peer = -1;          // Send/Recv/Put/Signal: the other rank
  LinkKind link = LinkKind::kNone;
  int64_t tag = -1;     // Send/Recv match key (with the two ranks)
  std::string counter;  // Signal/Wait/put-with-signal: counter name on the target rank
  int64_t count = 0;    // Signal/put-with-signal: increment of `counter`; Wait: threshold

  // Regions, by kind:
  //   Send: src.  Recv: dst.  Put: src (local), dst (peer's buffer).  Wait: dst (optional).
  //   Pack/Unpack/Copy: src -> dst (same tokens and heads).
  //   Attention: src = queries [q tokens, q heads], key/value = [kv tokens, q heads / group]
  //     where group = heads / kv_heads, dst = out (shape of src), dst_lse = lse [q tokens, q
  //     heads].
  //   Merge: src/src_lse = partial; dst/dst_lse = accumulator (same shape).
  Region src, dst, key, value, src_lse, dst_lse;

  int64_t bytes = 0;  // transfers/copies: payload bytes; Merge: bytes of the partial out
  double flops = 0;   // Attention: 4 * b * q_heads * q_tokens * kv_tokens * d; Merge: 0
  std::string label;  // human readable, e.g. "ring step 2 attention"
};

// One rank's buffers, program and where its inputs and outputs live.
struct RankProgram {
  int rank = 0;
  std::vector<BufferDecl> buffers;
  std::vector<Op> ops;
  // Global image tokens of this rank's shard: [image_token_begin, image_token_begin + count).
  int64_t image_token_begin = 0;
  int64_t image_token_count = 0;
  // Buffer indices (-1 when absent, e.g. text_* when text_tokens == 0). q/k/v/out are
  // [image_token_count, H or kv_heads, d]; text_* are [T, H or kv_heads, d].
  int q = -1, k = -1, v = -1, out = -1;
  int text_q = -1, text_k = -1, text_v = -1, text_out = -1;

  int FindBuffer(const std::string& name) const;  // -1 if absent
};

struct Schedule {
  // StrategyName(config.strategy) for a built schedule; free text for hand-made ones (tests).
  std::string strategy;
  SpMesh mesh;
  SpConfig config;  // with degrees and placement resolved
  AttentionShape shape;
  // Ulysses head groups: query heads [head_group_begin[u], +head_group_size[u]) for Ulysses
  // index u (uneven when H is not divisible by U, e.g. 30 heads on 4 -> 8, 8, 7, 7).
  std::vector<int64_t> head_group_begin, head_group_size;
  std::vector<RankProgram> ranks;
  std::vector<std::string> notes;  // design choices worth printing (e.g. text-token scheme)
};

// ---- Transport of a configuration ----

// True when transfers over `link` are one-sided (Put + Signal / Wait) under `config`.
bool OneSidedOn(const SpConfig& config, LinkKind link);
// "two-sided", "one-sided" or "one-sided intra / two-sided inter" (descriptions, plan names).
const char* TransportDescription(const SpConfig& config);
// The user-facing transport name: "nccl", "nvshmem" or "nvshmem-intra".
const char* TransportName(const SpConfig& config);
// Sets one_sided / one_sided_inter from a transport name; false for an unknown name.
bool SetTransport(const std::string& name, SpConfig* config);

// ---- Queries on a schedule ----

const char* ToString(OpKind kind);
const char* ToString(Stream stream);
const char* ToString(LinkKind link);
const char* ToString(BufferRole role);

// Elements / bytes of a region of `decl` (all batches and width).
int64_t RegionElements(const Region& r, const BufferDecl& decl, int64_t batch);
int64_t RegionBytes(const Region& r, const BufferDecl& decl, int64_t batch);
// True when the region is one contiguous range of the row-major buffer.
bool RegionContiguous(const Region& r, const BufferDecl& decl, int64_t batch);

// Structural and deadlock check. Collects every problem found (each names rank, op index, label
// and field): buffer indices and region bounds, shapes of paired regions, deps pointing to
// earlier ops, every Send with exactly one matching Recv (same bytes) and vice versa, every
// Put/Signal target existing, every Wait reachable by the signals sent to its counter, bytes and
// flops fields equal to what the regions imply, and a token-game run of the whole schedule under
// the execution model above that must complete (a cycle through deps, stream order, rendezvous
// or waits is reported with the ops left blocked).
struct ValidationReport {
  std::vector<std::string> errors;
  bool ok() const { return errors.empty(); }
  std::string ToString() const;  // one error per line
};
ValidationReport ValidateSchedule(const Schedule& schedule);

// Per-rank communication volume of a schedule (payload bytes; signals counted apart).
struct RankCommVolume {
  int64_t sent_intra_bytes = 0;  // Send + Put to ranks of the same machine
  int64_t sent_inter_bytes = 0;  // Send + Put to other machines
  int64_t recv_intra_bytes = 0;  // Recv + incoming Put from the same machine
  int64_t recv_inter_bytes = 0;  // Recv + incoming Put from other machines
  int64_t messages_intra = 0;    // Send + Put ops issued, by link
  int64_t messages_inter = 0;
  int64_t signals_intra = 0;  // pure Signal ops issued (puts-with-signal not counted)
  int64_t signals_inter = 0;
  int64_t local_copy_bytes = 0;  // Pack + Unpack + Copy
  double attention_flops = 0;
  int64_t sent_bytes() const { return sent_intra_bytes + sent_inter_bytes; }
  int64_t recv_bytes() const { return recv_intra_bytes + recv_inter_bytes; }
};
std::vector<RankCommVolume> CommVolumePerRank(const Schedule& schedule);

// Device memory a rank needs beyond the layer's own tensors: the bytes of its kWork, kScratch and
// kStaging buffers (gathered q/k/v, accumulators, ring kv buffers, partials, staging), all
// batches. The GPU executor allocates exactly these (plus alignment) once per shape.
std::vector<int64_t> WorkBytesPerRank(const Schedule& schedule);

// Human-readable listing: header, per rank the buffers and one line per op.
std::string PrintSchedule(const Schedule& schedule);
// JSON dump (nlohmann::json text, indented by `indent`, -1 = compact) of the whole schedule.
std::string ScheduleToJson(const Schedule& schedule, int indent = 1);

}  // namespace ditscale::sp
