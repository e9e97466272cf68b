// Step-time and memory models of one data-parallel rank's training step on a batch of B samples
// of S tokens each.
//
//   Work(S):    power:     b * S^p                 (AdaptiveLoad's model)
//               quadratic: c1 * S + c2 * S^2       (linear layers + attention)
//   one step of k micro-batches (B_i, S_i) (gradient accumulation):
//               step_time_s = a + sum_i (a_mb + B_i * Work(S_i))
//     a:    paid once per step and rank (optimizer step, gradient all-reduce tail);
//     a_mb: paid by every forward/backward pass (launches, FSDP all-gather / reduce-scatter of the
//           pass, small-kernel inefficiency). 0 unless fitted from benchmark rows with k >= 2.
//   a step of one micro-batch: StepTime(B, S) = a + a_mb + B * Work(S).
//   memory:     peak_bytes(B, S)  = m0 + m1 * B * S
//   on d sequence-parallel ranks (sp_cost.h), per rank:
//               a_mb + B * Work(S) / (d * eff(d)) + B * comm(d, S);  m0 + m1 * B * S / d
//
// M_mem (tokens per batch) follows from the memory model and a GPU capacity:
//   M_mem = floor((gpu_mem_bytes * (1 - safety) - m0) / m1).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "ditscale/balance/shapes.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

struct CostModel {
  enum class Kind { kPower, kQuadratic };
  Kind kind = Kind::kPower;
  double a = 0;        // fixed overhead per step (and rank), s
  double a_mb = 0;     // fixed overhead per micro-batch pass, s (0: not modelled)
  double b = 0;        // power: s per (sample * token^p)
  double p = 2;        // power: exponent
  double c1 = 0;       // quadratic: s per token
  double c2 = 0;       // quadratic: s per token^2
  std::string source;  // "analytical:<preset>@h200", "fit:<file>", "json:<file>"
  // eff(d) of sequence parallelism on d = 1, 2, 4, 8 ranks, [log2 d] (sp_cost.h); eff(1) = 1.
  // 1 unless the cost JSON gives it (fitted from benchmarks at d > 1).
  std::array<double, 4> sp_efficiency = {1, 1, 1, 1};

  // Predicted step time (s) of a step made of one micro-batch of B samples of S tokens:
  // a + a_mb + B * Work(S).
  double StepTime(int64_t batch, int64_t seq_len) const;
  // Predicted time (s) of a step of `micro_batches` (k >= 1) equal micro-batches of B samples of
  // S tokens each: a + k * (a_mb + B * Work(S)). The sweep rows with a micro_batches column.
  double AccumStepTime(int64_t micro_batches, int64_t batch, int64_t seq_len) const;
  // Cost of one micro-batch pass inside a step, without the per-step overhead:
  // a_mb + B * Work(S).
  double MicroBatchTime(int64_t batch, int64_t seq_len) const;
  // Per-rank cost of a micro-batch of B samples on `degree` ranks (sp_cost.h):
  // a_mb + B * Work(S) / (degree * eff(degree)) + B * comm_per_sample_s. degree in {1, 2, 4, 8}.
  double SpMicroBatchTime(int64_t batch, int64_t seq_len, int degree,
                          double comm_per_sample_s) const;
  // Per-sample work term without any fixed overhead: B * Work(S) is what a micro-batch adds on
  // top of a_mb.
  double Work(int64_t seq_len) const;
  // The exponent used by the dual constraint B * S^p <= M_comp: p for kPower; for kQuadratic
  // the local slope d log Work / d log S at S (between 1 and 2).
  double Exponent(int64_t seq_len) const;
};

// The conservative accounting of `ditscale plan --overhead-per-micro-batch`: the whole fixed
// overhead is charged per micro-batch, a_mb := a + a_mb, a := 0 (for a model fitted without
// accumulation rows, a_mb = 0, this is a_mb := a). Idempotent.
CostModel OverheadPerMicroBatch(const CostModel& cost);

struct MemoryModel {
  double m0 = 0;  // bytes independent of the batch (weights, optimizer state, workspace)
  double m1 = 0;  // bytes per token in the batch (activations)
  // Largest tokens per batch that fit: floor((gpu_mem_bytes * (1 - safety) - m0) / m1); 0 when
  // nothing fits or an input is NaN; INT64_MAX when m1 <= 0 (MakePlan refuses M_mem above
  // kMaxMMemTokens, planner.h).
  int64_t MaxTokens(double gpu_mem_bytes, double safety) const;
};

// Analytical defaults for an H200 from the model's FLOPs (see cost_model.cc for the derivation).
CostModel AnalyticalCost(const ModelPreset& model);
MemoryModel AnalyticalMemory(const ModelPreset& model);

// The assumptions behind AnalyticalMemory (defaults used by the one-argument form):
//   m0 = params_b * 1e9 * 16 B / shard_ranks + workspace_bytes
//        (bf16 weights + bf16 grads + fp32 master + Adam m, v = 16 B/param, FSDP-sharded)
//   m1 = (2 * layers + 34) * hidden B/token with activation checkpointing (block inputs kept,
//        one block recomputed at a time), 34 * layers * hidden B/token without.
struct MemoryAssumptions {
  int shard_ranks = 8;  // FSDP / ZeRO-3 degree; 1: unsharded (conservative)
  bool activation_checkpointing = true;
  double workspace_bytes = 4.0 * (1ull << 30);  // CUDA context, NCCL buffers, allocator slack
};
MemoryModel AnalyticalMemory(const ModelPreset& model, const MemoryAssumptions& assume);

// JSON round trip: {"kind": "power", "a": ..., "a_mb": ..., "b": ..., "p": ..., "c1":...,
//  "c2":..., "sp_efficiency": {"2": ..., "4": ..., "8": ...}, "memory": {"m0": ..., "m1": ...}}.
//  "a_mb" is optional on read (default 0: files written before it existed read as before) and
//  always written. "sp_efficiency" is optional (each key optional, default 1) and written only
//  when some eff(d) != 1. Failures name the file and
//  the field ("a: -1 is out of range [0, 1e+06]"). Ranges on read:
//    a, a_mb          [0, kMaxOverheadS] s
//    b, c1, c2        [0, kMaxCoefficient], and the work term b (power) or c1 + c2 must be > 0
//    p                [kMinExponent, kMaxExponent]
//    sp_efficiency.2/4/8  [kMinSpEfficiency, 1]
//    memory.m0        [0, kMaxMemoryBytes];  memory.m1 (0, kMaxMemoryBytes]
//  The file is read through ReadJsonFile (ditscale/core/json_text.h): duplicate keys, numbers
//  beyond double and syntax errors are refused with the file (and line).
inline constexpr double kMaxOverheadS = 1e6;
inline constexpr double kMaxCoefficient = 1e6;
inline constexpr double kMinExponent = 0.5;
inline constexpr double kMaxExponent = 4;
inline constexpr double kMaxMemoryBytes = 1e18;
inline constexpr double kMinSpEfficiency = 0.01;
Result<CostModel> LoadCostModel(const std::string& path, MemoryModel* memory_out = nullptr);
// The same from text already in memory; `file` names it in Failures.
Result<CostModel> ParseCostModel(std::string_view text, const std::string& file,
                                 MemoryModel* memory_out = nullptr);
std::string CostModelToJson(const CostModel& cost, const MemoryModel* memory = nullptr);

}  // namespace ditscale::balance
