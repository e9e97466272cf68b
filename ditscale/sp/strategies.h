// Builders of sequence-parallel attention schedules (see schedule.h for the data model).
//
// N = ulysses_degree (U) * ring_degree (R) ranks. Rank r has Ulysses index u and ring index i
// (placement, see Placement in schedule.h) and holds image-token shard number r of the sequence
// (shards as even as possible: the first S % N shards hold one token more; ditscale.sp.shard_range);
// the U shards of the ranks of ring index i form "ring chunk" i (contiguous in the sequence under
// kUlyssesInner; under kUlyssesOuter a set of shards: the attention is over all tokens, in any
// order).
//
// Strategies:
//  ulysses          U = N. All-to-all of q, k, v: each rank gathers the full sequence for its head
//                   group (uneven groups when H % U != 0, e.g. 30 heads on 4 -> 8, 8, 7, 7; in
//                   units of kv-head groups under GQA), attends, all-to-all of out back. With
//                   ulysses_chunks = C > 1 the head group is cut into C chunks of kv heads, each
//                   with its own all-to-all pipelined against the attention of the chunk before
//                   (strategies/ulysses_heads.cc): only the first chunk's way in and the last
//                   chunk's way back stay exposed; no merges (heads are independent).
//  ulysses-overlap  ulysses whose all-to-alls run under the attention (strategies/
//                   ulysses_overlap.cc): k, v arrive first; the attention is cut by query rows
//                   into local rows, every remote row, local rows again, at whole waves of the
//                   attention kernel (SpConfig::attention_slots), so that the remote queries
//                   arrive under the first call and their out leaves under the last. Only the
//                   k, v all-to-all stays exposed; no merges; same bytes and FLOPs as ulysses.
//  ring             R = N. R steps; at step s a rank attends its queries against the kv block that
//                   came from s hops back and LSE-merges it; kv blocks rotate to the next rank,
//                   double buffered (own buffer + one extra, reused with flow control).
//  usp              Ulysses within machines, Ring across (yunchang / xDiT placement).
//  swiftfusion-tas  Ulysses across machines, Ring within (SwiftFusion topology-aware scheduling).
//  torus            tas, fully pipelined (strategies/torus.cc): the Ulysses all-to-all is split
//                   into torus_chunks token chunks (k, v one chunk ahead of q), the ring within
//                   the machine forwards every kv piece (stationary slot, then each chunk) as soon
//                   as it has arrived, and every rank attends "arrived queries x newly arrived
//                   kv" and "newly arrived queries x kv so far" (each (q, kv) pair exactly once,
//                   merged by LSE), so attention overlaps both the inter-machine transfer of the
//                   next chunk and the ring traffic of this one. Query chunks finish one by one
//                   at the end and their out all-to-all back leaves as each becomes final; the
//                   stationary queries (out stays local) go last. All R kv blocks of the ring
//                   stay resident (S * H/U * d * e * 2 bytes per rank), so there is no ring flow
//                   control. Same bytes and FLOPs as swiftfusion-tas. U = 1: same as ring.
//  Every strategy exists in two-sided (Send/Recv) and one-sided (Put with signal / Wait) form.
//  One-sided schedules synchronise across machines only twice per layer (a "buffers ready"
//  signal round at the beginning and a "done" round at the end, each round's signals issued
//  together as one group); the receiver Waits only just before the data is consumed; ring flow
//  control ("buffer free") signals stay within the ring.
//
// Joint text tokens (T > 0): text q/k/v are replicated, so each rank takes its head group's text
// k/v locally and attends its image queries against them once. Text queries are split, not
// duplicated: rank (u, i) computes text query rows slice_i(T) (T split over the R ring ranks) for
// head group u against all image kv of its ring (it sees every kv block during the ring) and the
// text kv; an all-gather of these text-output pieces over all N ranks then gives every rank the
// full text output. Cost: T/R * (S + T) attention rows per rank plus T*H*d*e*(N-1)/N bytes
// received per rank. Layout: the rank's text query rows sit in front of its image query rows and
// the text k/v rows after the image k/v rows of its first kv block, in work buffers (gathered.*
// with a Ulysses group, ring.* without), so each kv block is ONE attention call and one merge:
// separate text-query calls (T/R rows) would fill only a few of the GPU's SMs.
//
// Closed-form per-rank volumes (received bytes, b batch, e dtype bytes, no text, S % N == 0,
// H % U == 0): Ulysses 4 * b * (S/N) * H * d * e * (U-1)/U (q, k, v in and out back);
// Ring 2 * b * (S/R) * (H/U) * d * e * (R-1) (k and v of the other R-1 blocks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::sp {

// The names of kAllStrategies (strategy.h), in that order: "ulysses", "ulysses-overlap", "ring",
// "usp", "swiftfusion-tas", "torus".
const std::vector<std::string>& StrategyNames();

// Limits of one schedule, checked by ResolveConfig before anything is built:
//   torus_chunks in [1, kMaxTorusChunks], ulysses_chunks in [1, kMaxUlyssesChunks];
//   ScheduleOpsEstimate() <= kMaxScheduleOps, and ranks * (seq_tokens + text_tokens) <=
//   kMaxRankTokens (the builder keeps per-token state for every rank's gathered rows).
// The builder itself stops at 2 * kMaxScheduleOps built ops (a guard: the estimate is within a
// factor 2 of the built count, sp_strategies_test). Building and simulating a schedule of
// kMaxScheduleOps ops takes a few seconds and < 200 MB: a ring over 128 ranks (97,664 ops) took
// 1.8 s to build and 1.5 s to simulate on one core of the 2-core CI machine.
inline constexpr int kMaxTorusChunks = 64;
inline constexpr int kMaxUlyssesChunks = 64;
inline constexpr int64_t kMaxScheduleOps = 131072;
inline constexpr int64_t kMaxRankTokens = int64_t{1} << 28;

// The op count of the schedule of a resolved config, estimated from its shape (not built):
// N * (12 (U-1) Cu + 6 Cr + 8) + 2 N (N-1) with joint text (its all-gather), where
// Cu = torus_chunks for torus, ulysses_chunks for ulysses (else 1) and Cr = torus_chunks + 1
// for torus with U > 1 and C > 1 (its ring forwards every chunk; else 1). Saturates at INT64_MAX.
int64_t ScheduleOpsEstimate(const SpConfig& resolved, const AttentionShape& shape);

// Fills the defaults of `config` (degrees, placement) for `mesh` and checks it: a strategy of
// kAllStrategies, U * R == mesh.ranks(), 1 <= torus_chunks <= kMaxTorusChunks,
// 1 <= ulysses_chunks <= kMaxUlyssesChunks, the schedule limits above, torus_chunks == 1 unless
// strategy is torus, ulysses_chunks == 1 unless strategy is ulysses (then U >= 2 and
// ulysses_chunks <= kv heads / U), shape sizes positive, kv_heads divides heads, U <= kv_heads,
// every rank has at least one image token.
// Failures name the field (Failure::column), e.g. "ulysses_degree".
Result<SpConfig> ResolveConfig(const SpMesh& mesh, const SpConfig& config,
                               const AttentionShape& shape);

// The schedule of one attention layer. Calls ResolveConfig first.
Result<Schedule> BuildSchedule(const SpMesh& mesh, const SpConfig& config,
                               const AttentionShape& shape);

// Rank layout of a resolved config.
struct RankCoords {
  int ulysses_index = 0;  // u in [0, U)
  int ring_index = 0;     // i in [0, R)
};
RankCoords CoordsOfRank(const SpConfig& resolved, int rank);
int RankOfCoords(const SpConfig& resolved, int ulysses_index, int ring_index);

// Split n into `parts` as evenly as possible, larger parts first: (30, 4) -> {8, 8, 7, 7}.
std::vector<int64_t> EvenSplit(int64_t n, int parts);

}  // namespace ditscale::sp
