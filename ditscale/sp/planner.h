// Auto-planner: which sequence-parallel configuration is fastest for a topology and workload.
//
// Enumerates, for N = machines * gpus_per_machine ranks:
//   ulysses (U = N; in every head-chunk count of PlanOptions::ulysses_chunks, by default only
//     1: plain), ulysses-overlap (U = N), ring (R = N),
//   usp (Ulysses within machines, Ring across) and swiftfusion-tas (Ulysses across, Ring within)
//     for every factorisation U * R = N with U, R > 1,
//   torus (tas with the cross-machine all-to-all split into chunks) for every factorisation with
//     U > 1 (R = 1 included: chunked Ulysses) and every chunk count in PlanOptions::torus_chunks,
// each in two-sided (NCCL send/recv) and one-sided (NVSHMEM put + signal) transport, and, on
// more than one machine, one-sided within machines and two-sided between them. The
// placement follows the strategy (usp: Ulysses group inside a machine; tas/torus: ring group
// inside a machine). Configurations the builders refuse (e.g. U > kv heads, a rank without
// tokens) are listed as skipped with the builder's reason. Uneven head counts (30 heads on
// U = 4) are not refused: the builders use uneven head groups.
// Every candidate's schedule is built (strategies.h) and simulated (simulator.h); candidates
// are ranked by predicted layer time (ties: fewer inter-machine bytes, then enumeration order).
//
// The search is bounded (every candidate left out is listed in PlanResult::skipped with why):
//   - torus chunk counts above the tokens per rank (S / N) are left out: with fewer tokens than
//     chunks some chunks are empty, the schedule is that of chunks = S / N;
//   - a candidate whose ScheduleOpsEstimate exceeds PlanOptions::max_schedule_ops is left out
//     (ResolveConfig refuses more than kMaxScheduleOps anyway);
//   - the candidates' estimated ops together may not exceed PlanOptions::max_total_ops: the
//     cheapest schedules (fewest estimated ops; ties in enumeration order) are simulated first
//     and the rest left out once the budget is spent.
// Time: the README's 4 x 8 p4de flux plan (75 candidates, 0.7-1 M estimated ops) takes ~2 s on
// the 2-core CI machine; 32 x 8 p4de wan2.1-14b (every schedule >= 55 k ops) stops at the budget
// after a few candidates, in a few seconds (sp_planner_test: LargeClustersStayWithinTheBudget).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/simulator.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/sp/topology.h"
#include "ditscale/sp/workload.h"

namespace ditscale::sp {

// Bounds of the search (see above) and of its options.
inline constexpr int64_t kMaxPlanOps = 1 << 20;  // default PlanOptions::max_total_ops
inline constexpr int kMaxPlanListSize = 16;      // strategies, torus_chunks, ulysses_chunks entries
inline constexpr size_t kMaxPlanCandidates = 8192;

struct PlanOptions {
  std::vector<Strategy> strategies;  // empty = all of kAllStrategies; <= kMaxPlanListSize
  // Torus token chunk counts to try: each in [1, kMaxTorusChunks]; 1 to kMaxPlanListSize entries.
  std::vector<int> torus_chunks = {1, 2, 4, 8};
  // Ulysses (U >= 2) head chunk counts to try: each in [1, kMaxUlyssesChunks]; 1 to
  // kMaxPlanListSize entries. Counts above a group's kv heads are skipped with the reason.
  std::vector<int> ulysses_chunks = {1};
  bool two_sided = true;  // include NCCL-style transport
  bool one_sided = true;  // include NVSHMEM-style transport (puts on every link)
  // Include, on more than one machine, puts within machines and NCCL between them
  // (SpConfig::one_sided_inter = false; "nvshmem-intra").
  bool one_sided_intra_only = true;
  // Skip configurations whose work memory (WorkBytesPerRank) exceeds this on some rank; 0 = no
  // limit. Skipped ones are listed in PlanResult::skipped with their memory.
  int64_t max_work_bytes_per_rank = 0;
  // Also every configuration with an SM partition (SpConfig::comm_sms =
  // Topology::SmallestCommSms()), where the topology describes partitions and its attention
  // holds every SM (attention_holds_sms): the partition costs compute a few % and lets the comm
  // streams' kernels run beside attention.
  bool sm_partitions = true;
  // Search bounds (above): estimated ops of one candidate, in [1, kMaxScheduleOps], and of all
  // simulated candidates together, >= 1.
  int64_t max_schedule_ops = kMaxScheduleOps;
  int64_t max_total_ops = kMaxPlanOps;
};

struct PlanCandidate {
  SpConfig config;  // resolved (degrees, placement, chunks, transport)
  SimResult sim;
  StepPrediction step;
  int64_t max_inter_bytes_per_rank = 0;  // sent over the NIC by the busiest rank
  int64_t max_intra_bytes_per_rank = 0;
  int64_t max_work_bytes_per_rank = 0;  // WorkBytesPerRank: memory beyond q/k/v/out, busiest rank
  // e.g. "torus U=2 R=8 chunks=4 one-sided" (or "... one-sided intra / two-sided inter"),
  // "ulysses U=8 R=1 ulysses_chunks=2 two-sided" (head chunks only when > 1).
  std::string Name() const;
  // Of the time some comm op was pending, the fraction overlapped with compute (mean over ranks).
  double hidden_comm_fraction() const;
};

struct PlanResult {
  std::vector<PlanCandidate> ranked;  // fastest first
  std::vector<std::string> skipped;   // "usp U=16 R=1: ulysses_degree: ..." and the like
  // Why the winner wins, in a few sentences, from the breakdowns (see ExplainWinner).
  std::string explanation;
};

// Simulates one configuration. Failure when the builder refuses it or the topology and the
// mesh disagree.
Result<PlanCandidate> EvaluateConfig(const Topology& topology, const Workload& workload,
                                     const SpConfig& config);

// Enumerates, simulates and ranks. Failure when nothing is feasible.
Result<PlanResult> Plan(const Topology& topology, const Workload& workload,
                        const PlanOptions& options = {});

// Compares the winner (ranked[0]) with the best candidate of each other strategy: speed-up,
// inter-machine bytes per rank, exposed communication, the share of communication hidden behind
// compute and the critical path. E.g. "torus U=2 R=8 chunks=4 one-sided: 14.2 ms per layer,
// 1.41x faster than the best usp (U=8 R=2 two-sided, 20.0 ms): it sends 3.5x fewer bytes per
// rank over the inter-machine network (...); it hides 92% of its communication behind
// attention (usp: 35%)".
std::string ExplainWinner(const std::vector<PlanCandidate>& ranked);

// One candidate as JSON (the `ditscale sp plan/simulate --json` record and what
// ditscale._core.sp_plan / sp_predict return): name, strategy, ulysses_degree, ring_degree,
// torus_chunks, ulysses_chunks, one_sided, one_sided_inter, transport ("nccl", "nvshmem",
// "nvshmem-intra"), predicted_layer_s, predicted_step_s, byte counts and the breakdown.
nlohmann::json PlanCandidateJson(const PlanCandidate& c);

}  // namespace ditscale::sp
