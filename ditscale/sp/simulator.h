// Discrete-event simulation of one sequence-parallel attention layer on a Topology.
//
// Input: a Schedule (schedule.h) — the same data the reference executor and the GPU executor
// run — and a Topology (topology.h). The simulator follows the schedule's execution model
// exactly: per rank three in-order streams (compute, intra-machine comm, inter-machine comm),
// `deps` within a rank, groups of consecutive same-`group` ops that start together, Send/Recv
// rendezvous, Put(+signal)/Signal/Wait counters.
//
// Cost model (a fluid model: every running activity has remaining work and a rate; the rates
// are recomputed whenever the set of running activities changes):
//   Attention   Topology::AttentionSeconds(op.flops, q tokens = op.src.tokens,
//               kv tokens = op.key.tokens, batch x query heads = batch * op.src.heads: the wave
//               model) of work at rate 1.
//   Merge       memory-bound: reads the partial out and the accumulator, writes the
//               accumulator: MemorySeconds(3 * op.bytes) (the float32 lse, d x smaller, ignored).
//   Pack/Unpack/Copy  MemorySeconds(2 * op.bytes) (read + write).
//   A compute-kind op on the COMPUTE stream runs at rate (1 - two_sided_sm_fraction) while any
//   two-sided transfer of its rank is in flight (NCCL kernels occupy SMs), else at rate 1.
//   Compute-kind ops on comm streams (e.g. a pack before a send) run at rate 1 beside compute.
//   An inter-machine data flow runs at (1 - inter_compute_interference) of its max-min fair
//   rate while either end's compute stream runs an op; the share it loses is not handed on.
//   With attention_holds_sms, a two-sided transfer (sync delay and data) makes no progress while
//   either end's compute stream runs an attention op, and that attention op is not slowed by
//   two_sided_sm_fraction (the NCCL kernel is not running beside it).
//   SM partitions (SpConfig::comm_sms > 0, topology.h): attention ops on ComputeSms SMs; nothing
//   stalls under attention_holds_sms; comm kernels and SM-driven transfers share the free SMs'
//   copy rate while their rank runs an attention op; no two_sided_sm_fraction slow-down.
//   Send/Recv   both sides posted (rendezvous) -> a fixed delay of two_sided_sync_s + link
//               latency, then `op.bytes` of data; both ops complete when the data has arrived.
//   Put         posted -> delay one_sided_overhead_s + latency, then the data; completes (and
//               signals its counter, if any) when the data has arrived. No rendezvous, no SMs.
//   Signal      delay one_sided_overhead_s + latency, no data; then the peer's counter rises.
//   Wait        completes the moment its counter reaches the threshold (zero duration).
//   A transfer to oneself is a local copy: MemorySeconds(2 * bytes), no link.
// Link sharing: every data phase is a flow over two capacity resources — intra-machine: the
// sender GPU's egress port and the receiver GPU's ingress port (intra_bandwidth_Bps each);
// inter-machine: the sender GPU's NIC egress and the receiver GPU's NIC ingress (Topology::NicOf:
// one per machine by default, one per GPU with nics_per_machine 0; nic_bandwidth_Bps each).
// Concurrent flows get max-min fair rates (progressive filling), so two flows through one NIC each
// get half of it and a flow limited elsewhere leaves its unused share to the others.
//
// Breakdown per rank, over [0, layer_s] (the three parts sum to layer_s):
//   compute_s       the compute stream is running an op.
//   exposed_comm_s  the compute stream is idle while an op of this rank's comm streams is
//                   issued and not finished (waiting for a partner, a transfer or a signal).
//   idle_s          neither (the rank has nothing to do: done early, or waiting on nothing of
//                   its own — e.g. a compute op blocked on a dependency that is itself idle).
// comm_active_s is the total time some comm op of the rank was issued and unfinished; the part
// of it that overlapped compute is comm_active_s - exposed_comm_s ("hidden").
//
// Critical path: from the op that finished last, walk back through the event that released each
// op (its stream predecessor, a dependency, its rendezvous partner or the signal that satisfied
// its wait) and add up each op's duration by category.
//
// Whole model: step_s = layers * (layer_s + linear FLOPs of a layer / ranks / linear_flops);
// linear layers are split evenly by sequence parallelism and need no communication; the
// Ulysses/Ring communication is all inside the attention layer. (Norms, the VAE and the text
// encoder are not modelled.)
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/topology.h"
#include "ditscale/sp/workload.h"

namespace ditscale::sp {

struct RankBreakdown {
  double end_s = 0;      // when the rank's last op finished
  double compute_s = 0;  // see above
  double exposed_comm_s = 0;
  double idle_s = 0;
  double comm_active_s = 0;
  double attention_s = 0;  // sum of attention op durations on this rank (any stream)
  int64_t sent_intra_bytes = 0;
  int64_t sent_inter_bytes = 0;
};

struct CriticalPath {
  double attention_s = 0;       // attention ops on the path
  double memory_s = 0;          // merge / pack / unpack / copy
  double intra_transfer_s = 0;  // intra-machine transfers (incl. their sync + latency)
  double inter_transfer_s = 0;  // inter-machine transfers (incl. their sync + latency)
  double signal_s = 0;          // pure signals
  int ops = 0;                  // ops on the path
  double total_s() const {
    return attention_s + memory_s + intra_transfer_s + inter_transfer_s + signal_s;
  }
  // e.g. "attention 71% (12.1 ms), inter-machine 25% (4.3 ms), intra 3%, memory 1%; 40 ops".
  std::string Describe() const;
};

struct SimResult {
  double layer_s = 0;  // time of one attention layer (max over ranks of end_s)
  std::vector<RankBreakdown> ranks;
  CriticalPath critical_path;
  // Totals over all ranks and the time some inter-machine data was moving (the union of
  // intervals with at least one inter-machine flow in its data phase).
  int64_t inter_bytes = 0;
  int64_t intra_bytes = 0;
  double inter_busy_s = 0;
  int64_t events = 0;  // simulation events processed (for profiling)

  // Averages over ranks.
  double mean_compute_s() const;
  double mean_exposed_comm_s() const;
  double mean_idle_s() const;
  double mean_comm_active_s() const;
};

// Simulates one layer. Failure when the schedule's mesh does not match the topology
// (machines, gpus_per_machine) or the schedule deadlocks (the message lists blocked ops).
Result<SimResult> Simulate(const Schedule& schedule, const Topology& topology);

// Whole-model prediction for one forward pass (one denoising step) of `workload`.
struct StepPrediction {
  double layer_s = 0;         // attention layer (simulated)
  double linear_layer_s = 0;  // linear work of one layer per rank
  double step_s = 0;          // layers * (layer_s + linear_layer_s)
};
StepPrediction PredictStep(const SimResult& layer, const Workload& workload,
                           const Topology& topology);

}  // namespace ditscale::sp
