// The sequence-parallel simulator's engine (simulator.h: the model; simulator.cc: the event
// loop; sim_rates.cc: the rates of concurrent activities). Internal to ditscale_sp.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/internal/fair_share.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/simulator.h"
#include "ditscale/sp/topology.h"

namespace ditscale::sp::internal {

inline bool IsComputeKind(OpKind k) {
  return k == OpKind::kAttention || k == OpKind::kMerge || k == OpKind::kPack ||
         k == OpKind::kUnpack || k == OpKind::kCopy;
}
inline bool IsCommKind(OpKind k) { return !IsComputeKind(k); }

struct OpState {
  int rank = 0;
  int index = 0;
  const Op* op = nullptr;
  int deps_left = 0;
  int unit = -1;  // index into Sim::units_
  bool issued = false, posted = false, started = false, done = false;
  double post_t = 0, start_t = 0, end_t = 0;
  double release_t = 0;
  int released_by = -1;  // gid of the op whose completion let this one start
  int partner = -1;      // Send <-> Recv
  std::vector<int> dependents;
};

enum class Phase { kWork, kDelay, kData };

struct Activity {
  Phase phase = Phase::kWork;
  double remaining = 0;  // seconds (work, delay) or bytes (data)
  double rate = 1;
  int gid = -1;  // op completed at the end (Send for a rendezvous pair)
  int src = -1, dst = -1;
  int64_t bytes = 0;  // data still to move after a delay phase
  bool two_sided = false;
  // Launched as a kernel: waits for an attention call that holds every SM (two-sided transfers;
  // one-sided ones between machines, NVSHMEM's put-with-signal). One-sided ones within a machine
  // are the executor's copy engines and stream memory operations: no SM.
  bool needs_sm = false;
  // A kernel (pack, unpack, copy, merge) on a comm stream: under attention_holds_sms it waits for
  // an attention call of its rank that started before it became ready, like any kernel
  // (lab/results/sp-overlap_h200_2026-12/pack-copy.md).
  bool comm_kernel = false;
  bool compute_stream = false;  // a compute-kind op on the compute stream (SM slow-down)
  double t0 = 0;                // when it started (a transfer: when its first phase started)
};

class Sim {
 public:
  Sim(const Schedule& s, const Topology& t) : s_(s), t_(t) {}
  Result<SimResult> Run();

 private:
  void Build();
  void Issue(int gid, int releaser, double release_t);
  void Post(int gid);
  void Complete(int gid, int releaser);
  void StartTransfer(int gid, int src, int dst, int64_t bytes, double delay, bool two_sided);
  void RaiseCounter(int rank, const std::string& name, int64_t value, int releaser);
  void Drain();
  std::optional<Failure> Check();
  void Advance();
  void Finish(Activity& a);
  Failure DeadlockError() const;
  void Summarize();
  // The rates of the running activities (sim_rates.cc): bandwidth shared max-min fairly over
  // GPU, NIC and (with a partition) free-SM resources; stalls under attention_holds_sms.
  void Recompute();
  std::vector<double> Capacities(int nics, bool duplex) const;
  std::vector<double> AttentionSince() const;
  void MarkStalls(const std::vector<double>& attention_since, std::vector<char>* stalled,
                  std::vector<int>* sm_taking) const;
  FlowResources FlowOf(const Activity& a, int nics, bool duplex, int free_sms_base, bool late_src,
                       bool late_dst) const;

  const Schedule& s_;
  const Topology& t_;
  int n_ = 0;
  std::vector<OpState> ops_;
  std::vector<int> offset_;
  std::vector<std::vector<int>> units_;  // ops of each stream unit
  std::vector<int> unit_left_;           // ops of the unit not yet done
  std::vector<std::array<std::vector<int>, kNumStreams>> stream_units_;  // per rank
  std::vector<std::array<int, kNumStreams>> head_;
  std::map<std::pair<int, std::string>, int64_t> counters_;
  std::map<std::pair<int, std::string>, std::vector<int>> waiters_;
  std::vector<Activity> acts_;
  std::deque<std::pair<int, int>> complete_queue_;  // (gid, releaser)
  std::deque<int> post_queue_;
  std::vector<int> compute_running_, comm_pending_;
  int inter_flows_ = 0;
  int compute_sms_ = 0;     // SpConfig::comm_sms > 0: the compute partition's SMs, else 0
  double free_sm_Bps_ = 0;  // the copy rate of the SMs outside it
  double now_ = 0;
  int done_count_ = 0;
  SimResult res_;
};

}  // namespace ditscale::sp::internal
