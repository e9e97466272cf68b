// Cluster topology and GPU throughput model for the sequence-parallel simulator.
//
// A cluster is `machines` x `gpus_per_machine` GPUs. Global rank r lives on machine
// r / gpus_per_machine, local index r % gpus_per_machine.
//
// Links (all bandwidths are per direction, in bytes/s; 1 GB = 1e9 B, 1 GiB = 2^30 B):
//   * intra-machine (NVSwitch / NVLink): every GPU has one egress port and one ingress port of
//     `intra_bandwidth_Bps` each; a transfer a -> b on the same machine occupies a's egress and b's
//     ingress. Latency `intra_latency_s` is added once per transfer.
//   * inter-machine (EFA / RDMA / socket): every machine has `nics_per_machine` NICs (default
//     ONE, shared by all its GPUs; 0 = one per GPU, a rail-optimised cluster) with
//     `nic_bandwidth_Bps` egress and the same ingress each; GPU l of a machine uses NIC
//     l * nics / gpus_per_machine. A transfer from GPU a to GPU b on another machine occupies
//     a's NIC egress and b's NIC ingress, shared with every other concurrent inter-machine flow
//     through those NICs (see simulator.h for the sharing rule); with `nic_duplex_Bps` > 0 a
//     NIC's egress and ingress flows together are also limited to that (half-duplex-like links
//     such as loopback sockets). Latency `inter_latency_s` is
//     added once per transfer. Emulated machines on one host (NCCL_HOSTID) are one NIC per GPU:
//     each GPU pair talks over its own loopback sockets (2 x 2 H200 run: the single shared NIC
//     predicted 2-2.5x the measured times of every socket-bound strategy).
//
// Compute:
//   * attention of a q block of `q_tokens` against a kv block of `kv_tokens` with F flops takes
//       launch_overhead_s + F / (attention_flops * Eff(q_tokens) * Eff(kv_tokens)),
//       Eff(t) = t / (t + attention_half_tokens)
//     i.e. `attention_flops` is the asymptotic (long-sequence) ACHIEVED throughput and
//     `attention_half_tokens` the block length at which one side's efficiency is 1/2. With the
//     default 128 tokens, Eff(512)^2 = 0.64 and Eff(4096)^2 = 0.94, which follows the shape of
//     flash-attention-2's published A100 forward curve (hd 128: ~60-65% of the long-sequence
//     throughput at seqlen 512, >90% from 4k on).
//     With `attention_slots` > 0 the kernel is modelled as running in waves: it launches one CTA
//     per `attention_tile_tokens` query rows per (batch, head), `attention_slots` CTAs run at
//     once, and a partial last wave takes as long as a full one, so the time above is
//     multiplied by ceil(W) / W, W = batch * heads * ceil(q_tokens / tile) / slots. Measured on
//     one H200 (lab/results/sp-attn-split_h200_2026-12/): cuDNN's forward steps by one wave (~0.8
//     ms at kv 66,048, 12 heads) every 1408 query rows = 11 tiles of 128 x 12 heads = 132 CTAs, the
//     SM count; splitting a call into equal query halves cost +3.1%, into whole waves +0.4-0.8%.
//   * memory-bound ops (log-sum-exp merge, pack/unpack, local copies) of B bytes moved take
//       launch_overhead_s + B / hbm_bandwidth_Bps.
//   * linear layers (QKV/out projections, MLP) run at `linear_flops`.
//
// Per-op fixed overheads:
//   * two-sided (NCCL send/recv) transfer: `two_sided_sync_s` added to the transfer (the
//     rendezvous/handshake and kernel launch); while it runs, the NCCL kernel occupies
//     `two_sided_sm_fraction` of the GPU's SMs on both endpoints, so concurrent compute on those
//     ranks runs at (1 - two_sided_sm_fraction) of its speed.
//   * one-sided (NVSHMEM put, copy engine / NIC RDMA) transfer: `one_sided_overhead_s` added; no
//     SMs are taken.
//   * an inter-machine transfer runs at (1 - inter_compute_interference) of its share of the link
//     while the compute stream of either end is busy (0 in the presets but h200-local: see
//     there).
//   * attention_holds_sms (h200-local and h100-8x: cuDNN's Hopper attention; not p4de): a
//     two-sided transfer waits while either end runs an attention op (and takes no SMs from it);
//     so does a kernel on a comm stream (a pack, an unpack) while its rank runs one.
//     One-sided transfers are modelled as the GPU executor's copy-engine engine runs them: within
//     a machine cudaMemcpyAsync + stream memory operations (no SM, measured beside a kernel
//     holding every SM, lab/results/sp-overlap_h200_2026-12/primitives.json), which this rule does
//     not stall; between machines NVSHMEM's put-with-signal, a kernel, which it stalls like NCCL's.
//
// Presets (every constant and its source; "achieved" = what a well-tuned kernel or collective
// reaches, not the datasheet):
//   p4de (AWS p4de.24xlarge, the SwiftFusion paper's cluster), default 8 GPUs per machine:
//     intra 240 GB/s per direction: NVSwitch gen 2, 12 NVLink3 links x 25 GB/s = 300 GB/s per
//       direction (600 GB/s "per GPU" is both directions); NCCL all-to-all busbw on DGX A100
//       reaches ~230-240 GB/s. intra latency 5 us (NCCL P2P small-message latency).
//     NIC 42.5 GB/s per direction: 4 x 100 Gb/s EFA = 50 GB/s line rate, ~85% achieved by
//       aws-ofi-nccl at large messages. inter latency 20 us (EFA SRD + NCCL proxy).
//     attention 200 TFLOP/s: flash-attention 2 forward on A100 bf16 hd 128 reaches 190-230
//       TFLOP/s (60-70% of the 312 TFLOP/s dense bf16 peak). linear 250 TFLOP/s (80% of 312).
//       No wave model (attention_slots 0): not measured on an A100 here.
//       HBM 1.6 TB/s achieved (A100 80GB: 2.04 TB/s datasheet).
//   h100-8x (p5 / DGX H100), default 8 GPUs per machine:
//     intra 360 GB/s per direction: NVSwitch gen 3, 18 NVLink4 links = 450 GB/s per direction
//       (900 GB/s both directions), ~80% achieved. intra latency 4 us.
//     NIC 320 GB/s per direction: 8 x 400 Gb/s = 400 GB/s line rate, 80% achieved. inter
//       latency 15 us.
//     attention 600 TFLOP/s (flash-attention 3 / cuDNN bf16 hd 128 forward, 600-700 TFLOP/s),
//       waves of 132 CTAs x 128 rows (the same SM count and cuDNN kernel as the H200's),
//       linear 700 TFLOP/s (71% of 989), HBM 2.8 TB/s achieved (3.35 TB/s datasheet).
//   h200-local (the lent host; emulated machines share the host), default 4 GPUs per machine:
//     intra 282.4 GB/s per direction: measured NCCL all-to-all busbw ~263 GiB/s at 256 MiB.
//       intra latency 5 us.
//     NIC 1.93 GB/s per direction: measured NCCL socket transport between emulated machines
//       (NCCL_HOSTID per machine), ~1.8 GiB/s per GPU pair, one "NIC" per GPU (each pair has its
//       own loopback sockets). inter latency 50 us (TCP loopback + proxy). Compute
//       interference 0.3 (beside the attention_holds_sms rule): bench/sp/fit_runs.py on the
//       measured strategy runs fitted 0.45 (2 machines x 1 GPU) and 0.15 (2 x 2), 0.1-0.6 with a
//       sequence length held out.
//     attention 650 TFLOP/s: measured cuDNN attention (ATen) at hd 128 on one H200. Waves of
//       132 CTAs (the SM count) of 128 query rows: measured (sp-attn-split_h200_2026-12).
//     132 SMs, partitions in steps of 8 (the driver's green-context granularity on compute
//       capability 9.0, as h100-8x), 11 GB/s of copying per SM outside a partition (measured:
//       a strided pack on 4 and on 12 free SMs, sp-smpart_h200_2026-12).
//       linear 750 TFLOP/s (76% of 989), HBM 4.0 TB/s achieved (4.8 TB/s datasheet).
//   p4de: 108 SMs, partitions in steps of 2 (compute capability 8.0), no copy rate measured
//     (comm_sm_Bps 0: partitions are not offered).
//   Common overheads (all presets unless noted): kernel launch 5 us; NCCL two-sided sync 15 us
//   per send/recv pair (rendezvous + proxy hand-off); NCCL SM fraction 0.10 (NCCL's default
//   ~8-16 channels of 108-132 SMs); one-sided put 2 us (NVSHMEM host-initiated put on a stream).
//   The measured h200 figures are files of bench/results/ (the folders named above; index:
//   docs/results.md).
//
// Custom clusters: a JSON object with the keys below (bandwidths in GB/s = 1e9 B/s, times in
// microseconds), read through ditscale/core/json_text.h (duplicate keys, 1e400 and syntax errors
// name the file and line). "base" names a preset whose values fill the keys not given; without
// "base", every key is required except "nics_per_machine" (default 1; 0 = one NIC per GPU),
// "nic_duplex_GBps" (default 0: full duplex), "inter_compute_interference" (default 0) and
// "attention_holds_sms" (true / false, default false), "gpu_sms", "sm_partition_step" (integers,
// default 0: no SM partitions) and "comm_sm_GBps" (default 0). Unknown keys are errors.
// Ranges (JSON units; Validate() checks the same on the struct; NaN / inf never pass):
//   gpus_per_machine            integer [1, kMaxGpusPerMachine]
//   nics_per_machine            integer [0, gpus_per_machine]
//   intra_bandwidth_GBps, nic_bandwidth_GBps, attention_tflops, linear_tflops
//                               [0.001, 100000]     (no zero or negative rate)
//   hbm_bandwidth_GBps          [0.001, 1000000]
//   nic_duplex_GBps, comm_sm_GBps  0 (off) or [0.001, 100000]
//   intra_latency_us, inter_latency_us, launch_overhead_us, two_sided_sync_us,
//   one_sided_overhead_us       [0, 1000000]        (at most one second)
//   attention_half_tokens       [0, 1e9]
//   two_sided_sm_fraction, inter_compute_interference  [0, 0.99]
//   attention_slots             integer [0, 1048576]; attention_tile_tokens [1, 1048576]
//   gpu_sms, sm_partition_step  integer [0, 65536]
// A value outside its range fails as "FILE: column 'nic_bandwidth_GBps': -1 is out of range
// [0.001, 100000]".
//
// Size limits of the cluster (checked by MakePresetTopology, ParseTopologyJson, LoadTopology and
// Validate before anything is sized by them): machines in [1, kMaxMachines], gpus_per_machine in
// [1, kMaxGpusPerMachine] and world_size() <= kMaxRanks. A schedule holds O(ranks^2) transfers
// (an all-to-all) or O(ranks * ring steps) ops, so the rank count bounds the memory and time
// of building and simulating one: see kMaxScheduleOps in strategies.h.
//   { "base": "p4de", "name": "my-cluster", "gpus_per_machine": 8,
//     "intra_bandwidth_GBps": 240, "intra_latency_us": 5,
//     "nic_bandwidth_GBps": 42.5, "nics_per_machine": 1, "inter_latency_us": 20,
//     "attention_tflops": 200, "attention_half_tokens": 128, "linear_tflops": 250,
//     "attention_slots": 0, "attention_tile_tokens": 128,
//     "hbm_bandwidth_GBps": 1600, "launch_overhead_us": 5, "two_sided_sync_us": 15,
//     "two_sided_sm_fraction": 0.1, "one_sided_overhead_us": 2 }
#pragma once

#include <string>
#include <vector>

#include "ditscale/core/result.h"

namespace ditscale::sp {

inline constexpr int kMaxMachines = 256;
inline constexpr int kMaxGpusPerMachine = 72;  // one NVLink domain (GB200 NVL72)
inline constexpr int kMaxRanks = 1024;

struct Topology {
  std::string name;
  int machines = 1;
  int gpus_per_machine = 8;

  double intra_bandwidth_Bps = 0;  // per GPU, per direction (egress = ingress)
  double intra_latency_s = 0;
  double nic_bandwidth_Bps = 0;  // per NIC, per direction
  int nics_per_machine = 1;      // NICs per machine; 0 = one per GPU
  // Egress + ingress of one NIC together; 0 = no joint limit (full duplex). Loopback sockets
  // share their CPU copies between directions: one way 2.7 GB/s, both ways 1.75 GB/s each.
  double nic_duplex_Bps = 0;
  double inter_latency_s = 0;

  double attention_flops = 0;          // asymptotic achieved attention FLOP/s per GPU
  double attention_half_tokens = 128;  // Eff(t) = t / (t + attention_half_tokens)
  int attention_slots = 0;             // CTAs of the attention kernel in flight; 0 = no waves
  int attention_tile_tokens = 128;     // query rows per CTA (the wave model's tile)
  double linear_flops = 0;             // achieved GEMM FLOP/s per GPU
  double hbm_bandwidth_Bps = 0;        // achieved bytes/s for memory-bound ops

  double launch_overhead_s = 0;      // per compute op
  double two_sided_sync_s = 0;       // per two-sided transfer
  double two_sided_sm_fraction = 0;  // compute slow-down while a two-sided transfer runs
  double one_sided_overhead_s = 0;   // per one-sided transfer
  // Fraction of an inter-machine transfer's rate lost while the compute stream of either end
  // runs (in [0, 1)). 0 for RDMA NICs; NCCL's socket transport (emulated machines) copies
  // through host bounce buffers with GPU kernels and CPU proxy threads, and the strategy runs
  // put the loss, beyond attention_holds_sms, at 0.15-0.45 (bench/sp/fit_runs.py).
  double inter_compute_interference = 0;
  // The attention kernel holds every SM for a whole call (cuDNN's on Hopper: a persistent grid;
  // lab/results/sp-overlap_h200_2026-12/), so a two-sided (NCCL, kernel-driven) transfer makes no
  // progress while either end runs an attention op. One-sided puts are taken to need no SM.
  bool attention_holds_sms = false;
  // SM partitions (see above): the GPU's SMs, the granularity of a green context's SM count, and
  // the bytes/s (read + written) one SM outside the compute partition moves for a comm kernel.
  // Partitions are offered when all three are > 0.
  int gpu_sms = 0;
  int sm_partition_step = 0;
  double comm_sm_Bps = 0;

  int world_size() const { return machines * gpus_per_machine; }
  int MachineOf(int rank) const { return rank / gpus_per_machine; }
  bool SameMachine(int a, int b) const { return MachineOf(a) == MachineOf(b); }
  // NICs per machine with 0 resolved to gpus_per_machine.
  int Nics() const { return nics_per_machine > 0 ? nics_per_machine : gpus_per_machine; }
  // Global index (machine * Nics() + k) of the NIC that rank uses for inter-machine traffic.
  int NicOf(int rank) const {
    return MachineOf(rank) * Nics() + (rank % gpus_per_machine) * Nics() / gpus_per_machine;
  }

  // Eff(t) = t / (t + attention_half_tokens), in (0, 1); 0 for t <= 0.
  double BlockEfficiency(double tokens) const;
  // ceil(W) / W for a call over batch_heads (batch x query heads) and q_tokens rows (see the wave
  // model above); 1 without it (attention_slots == 0 or batch_heads <= 0).
  double WaveFactor(double q_tokens, double batch_heads) const;
  // Seconds for an attention op: launch_overhead_s + flops * WaveFactor / (attention_flops *
  // Eff(q) * Eff(kv)). batch_heads = 0: no wave model for this call. sms > 0: the call runs on
  // that many of the gpu_sms SMs (a partition; see above).
  double AttentionSeconds(double flops, double q_tokens, double kv_tokens, double batch_heads = 0,
                          int sms = 0) const;
  // True when the topology describes SM partitions (gpu_sms, sm_partition_step, comm_sm_Bps).
  bool SmPartitions() const { return gpu_sms > 0 && sm_partition_step > 0 && comm_sm_Bps > 0; }
  // The compute partition that leaves at least `comm_sms` SMs outside it: the largest multiple
  // of sm_partition_step <= gpu_sms - comm_sms; gpu_sms for comm_sms == 0; a failure naming
  // "comm_sms" when no partition fits or the topology has none.
  Result<int> ComputeSms(int comm_sms) const;
  // The smallest comm_sms > 0 whose partition exists (gpu_sms minus the largest partition below
  // it: 4 on a 132-SM H200); 0 without SM partitions.
  int SmallestCommSms() const;
  // Seconds for a memory-bound op moving `bytes`: launch_overhead_s + bytes / hbm_bandwidth_Bps.
  double MemorySeconds(double bytes) const;
  // Seconds for `flops` of GEMM work: flops / linear_flops (no launch overhead).
  double LinearSeconds(double flops) const;
  // Unloaded transfer time of `bytes` from rank a to rank b (latency + bytes / link bandwidth,
  // no sync overhead); the simulator adds contention and sync.
  double TransferSeconds(double bytes, int a, int b) const;

  // Checks every field against its range (above; machines, gpus_per_machine and the rank count
  // against the size limits). Returns a failure naming the field (its JSON name), the value and
  // the range.
  Result<bool> Validate() const;
};

// The SM partition rule (Topology::ComputeSms, and the GPU executor with the device's numbers):
// the largest multiple of `step` that is <= gpu_sms - comm_sms; gpu_sms for comm_sms == 0; 0 when
// none fits (comm_sms < 0 or >= gpu_sms, step <= 0, or the multiple would be < step).
int PartitionSms(int gpu_sms, int step, int comm_sms);

// Names of the built-in presets: {"p4de", "h100-8x", "h200-local"}.
std::vector<std::string> PresetNames();

// A preset with `machines` machines (in [1, kMaxMachines]). gpus_per_machine 0 keeps the preset's
// default, else it must lie in [1, kMaxGpusPerMachine]; world_size() <= kMaxRanks. Failure for
// an unknown name or a size out of range (naming "machines" / "gpus_per_machine", the value and
// the range).
Result<Topology> MakePresetTopology(const std::string& name, int machines,
                                    int gpus_per_machine = 0);

// Parses a JSON cluster description (format above). `source` names the file in errors:
// "FILE: column 'nic_bandwidth_GBps': 0 is out of range [0.001, 100000]". machines and
// gpus_per_machine as for MakePresetTopology (0 = the file's / base's gpus_per_machine).
Result<Topology> ParseTopologyJson(const std::string& json_text, const std::string& source,
                                   int machines, int gpus_per_machine = 0);

// A preset name, or else a path to a JSON file (read with ReadJsonFile: regular files of at
// most kMaxJsonBytes).
Result<Topology> LoadTopology(const std::string& preset_or_file, int machines,
                              int gpus_per_machine = 0);

}  // namespace ditscale::sp
