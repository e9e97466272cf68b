// Step-time and memory models; the analytical H200 defaults and the JSON round trip.
//
// Analytical step time (one H200, bf16, one training step = forward + backward = 3x forward).
// Per transformer layer and sample of S tokens (S includes joint text tokens), d = hidden,
// f = ffn_hidden, T = text_tokens:
//   linear:   2 * S * (4 d^2 + 2 d f)          qkv + out projections, 2-matrix MLP
//   cross:    2 * S * 2 d^2 + 4 * S * T * d    Wan only (!joint_text): q/out projections and the
//             + 2 * T * 2 d^2                  scores/values against T text keys; the text K/V
//                                              projections are per sample, not per token: they
//                                              are spread over S_ref = 4096 tokens and added to
//                                              c1 (<= 2% of c1 for the Wan presets)
//   attention: 4 * S^2 * d                     QK^T and PV
// FLOPs are turned into seconds by achieved rates on an H200 (989 TFLOP/s dense bf16 peak):
//   linear and cross-attention at 45% of peak (445 TFLOP/s), self-attention at 40% (396 TFLOP/s,
//   the fwd+bwd average of cuDNN/flash attention at head dim 128).
//   c1 = 3 * L * (linear + cross per token) / R_linear,  c2 = 3 * L * 4 d / R_attention,
//   a  = 0.05 s: optimizer step, gradient all-reduce tail and launch overhead per step.
//
// Analytical memory (MemoryAssumptions defaults):
//   m0 = params * 16 B / shard_ranks + workspace_bytes
//        16 B/param = bf16 weights (2) + bf16 grads (2) + fp32 master weights (4) + Adam m, v (8);
//        sharded FSDP/ZeRO-3 style over shard_ranks = 8 (one H200 node); workspace 4 GiB (CUDA
//        context, NCCL buffers, allocator slack). shard_ranks = 1 gives the unsharded bound.
//   m1 = bytes per token: with activation checkpointing (default) the input of every block is
//        kept (2 B * d per layer) and one block is recomputed at a time with all its activations
//        (34 B * d, Korthikanti et al. 2022 with flash attention, no S^2 term):
//          m1 = (2 * L + 34) * d;   without checkpointing m1 = 34 * L * d.
#include "ditscale/balance/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "ditscale/core/json_text.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {

namespace {
constexpr double kH200PeakBf16 = 989e12;  // FLOP/s, dense
constexpr double kLinearEfficiency = 0.45;
constexpr double kAttentionEfficiency = 0.40;
constexpr double kStepOverheadS = 0.05;
constexpr double kTextSpreadTokens = 4096;  // S_ref for per-sample text K/V projections
constexpr double kActivationBytesPerHidden = 34;
}  // namespace

double CostModel::Work(int64_t seq_len) const {
  const double s = static_cast<double>(seq_len);
  if (kind == Kind::kPower) return b * std::pow(s, p);
  return c1 * s + c2 * s * s;
}

double CostModel::MicroBatchTime(int64_t batch, int64_t seq_len) const {
  return a_mb + static_cast<double>(batch) * Work(seq_len);
}

double CostModel::SpMicroBatchTime(int64_t batch, int64_t seq_len, int degree,
                                   double comm_per_sample_s) const {
  int slot = 0;
  while ((1 << slot) < degree && slot < 3) ++slot;
  const double b = static_cast<double>(batch);
  return a_mb + b * Work(seq_len) / (static_cast<double>(degree) * sp_efficiency[slot]) +
         b * comm_per_sample_s;
}

double CostModel::StepTime(int64_t batch, int64_t seq_len) const {
  return a + MicroBatchTime(batch, seq_len);
}

double CostModel::AccumStepTime(int64_t micro_batches, int64_t batch, int64_t seq_len) const {
  return a + static_cast<double>(micro_batches) * MicroBatchTime(batch, seq_len);
}

CostModel OverheadPerMicroBatch(const CostModel& cost) {
  CostModel c = cost;
  c.a_mb = cost.a + cost.a_mb;
  c.a = 0;
  return c;
}

double CostModel::Exponent(int64_t seq_len) const {
  if (kind == Kind::kPower) return p;
  const double s = static_cast<double>(seq_len);
  const double lin = c1 * s, quad = c2 * s * s;
  if (lin + quad <= 0) return 1;
  return (lin + 2 * quad) / (lin + quad);
}

int64_t MemoryModel::MaxTokens(double gpu_mem_bytes, double safety) const {
  const double room = gpu_mem_bytes * (1 - safety) - m0;
  if (!(room > 0)) return 0;  // also NaN inputs: no room, never a wrapped count
  if (m1 <= 0) return std::numeric_limits<int64_t>::max();
  const double t = std::floor(room / m1);
  if (t >= static_cast<double>(std::numeric_limits<int64_t>::max())) {
    return std::numeric_limits<int64_t>::max();
  }
  return static_cast<int64_t>(t);
}

CostModel AnalyticalCost(const ModelPreset& model) {
  const double d = static_cast<double>(model.hidden);
  const double f = static_cast<double>(model.ffn_hidden);
  const double L = static_cast<double>(model.layers);
  const double T = static_cast<double>(model.text_tokens);
  double linear_per_token = 2 * (4 * d * d + 2 * d * f);
  if (!model.joint_text && model.text_tokens > 0) {
    linear_per_token += 2 * 2 * d * d + 4 * T * d + 2 * T * 2 * d * d / kTextSpreadTokens;
  }
  const double attention_per_token2 = 4 * d;
  CostModel c;
  c.kind = CostModel::Kind::kQuadratic;
  c.a = kStepOverheadS;
  c.c1 = 3 * L * linear_per_token / (kLinearEfficiency * kH200PeakBf16);
  c.c2 = 3 * L * attention_per_token2 / (kAttentionEfficiency * kH200PeakBf16);
  c.p = 2;
  c.source = "analytical:" + model.name + "@h200";
  return c;
}

MemoryModel AnalyticalMemory(const ModelPreset& model, const MemoryAssumptions& assume) {
  MemoryModel m;
  const double params = model.params_b * 1e9;
  m.m0 = params * 16.0 / std::max(1, assume.shard_ranks) + assume.workspace_bytes;
  const double d = static_cast<double>(model.hidden);
  const double L = static_cast<double>(model.layers);
  m.m1 = assume.activation_checkpointing ? (2 * L + kActivationBytesPerHidden) * d
                                         : kActivationBytesPerHidden * L * d;
  return m;
}

MemoryModel AnalyticalMemory(const ModelPreset& model) {
  return AnalyticalMemory(model, MemoryAssumptions{});
}

namespace {

Failure JsonFailure(const std::string& file, const std::string& field, std::string msg) {
  return Failure::InFile(file, 0, field, std::move(msg));
}

// Reads a number in [lo, hi]; `required` fields must be present.
bool GetNumber(const nlohmann::json& j, const std::string& key, const std::string& path,
               const std::string& field, bool required, double lo, double hi, double* out,
               std::optional<Failure>* f) {
  auto it = j.find(key);
  if (it == j.end()) {
    if (required) *f = JsonFailure(path, field, "missing required field");
    return !required;
  }
  if (!it->is_number()) {
    *f = JsonFailure(path, field, "expected a number, got " + it->dump());
    return false;
  }
  const double v = it->get<double>();
  if (!(v >= lo && v <= hi)) {
    *f = JsonFailure(path, field,
                     field + ": " + it->dump() + " is out of range [" + FormatNumber(lo) + ", " +
                         FormatNumber(hi) + "]");
    return false;
  }
  *out = v;
  return true;
}

// "sp_efficiency": {"2": .., "4": .., "8": ..} (each optional, in [kMinSpEfficiency, 1]).
std::optional<Failure> ReadSpEfficiency(const nlohmann::json& j, const std::string& path,
                                        CostModel* c) {
  auto it = j.find("sp_efficiency");
  if (it == j.end()) return std::nullopt;
  if (!it->is_object()) {
    return JsonFailure(path, "sp_efficiency", "expected {\"2\": .., \"4\": .., \"8\": ..}");
  }
  static const char* kDegrees[] = {"2", "4", "8"};
  for (auto k = it->begin(); k != it->end(); ++k) {
    if (std::find(std::begin(kDegrees), std::end(kDegrees), k.key()) == std::end(kDegrees)) {
      return JsonFailure(path, "sp_efficiency." + k.key(), "unknown degree (known: 2, 4, 8)");
    }
  }
  std::optional<Failure> f;
  for (int slot = 1; slot <= 3; ++slot) {
    const std::string key = kDegrees[slot - 1];
    if (!GetNumber(*it, key, path, "sp_efficiency." + key, false, kMinSpEfficiency, 1,
                   &c->sp_efficiency[slot], &f)) {
      return f;
    }
  }
  return std::nullopt;
}

Result<CostModel> CostFromJson(const nlohmann::json& j, const std::string& path,
                               MemoryModel* memory_out) {
  if (!j.is_object()) return Failure::InFile(path, 1, "", "expected a JSON object");
  static const char* kKnown[] = {"kind", "a",  "a_mb",          "b",      "p",
                                 "c1",   "c2", "sp_efficiency", "source", "memory"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown)) {
      return JsonFailure(path, it.key(),
                         "unknown field (known: kind, a, a_mb, b, p, c1, c2, sp_efficiency, "
                         "source, memory)");
    }
  }
  if (auto it = j.find("source"); it != j.end() && !it->is_string()) {
    return JsonFailure(path, "source", "expected a string, got " + it->dump());
  }
  CostModel c;
  auto kind = j.find("kind");
  if (kind == j.end()) return JsonFailure(path, "kind", "missing required field");
  if (!kind->is_string() || (*kind != "power" && *kind != "quadratic")) {
    return JsonFailure(path, "kind", "expected \"power\" or \"quadratic\", got " + kind->dump());
  }
  c.kind = *kind == "power" ? CostModel::Kind::kPower : CostModel::Kind::kQuadratic;
  const bool power = c.kind == CostModel::Kind::kPower;
  std::optional<Failure> f;  // set by the GetNumber that fails
  if (!GetNumber(j, "a", path, "a", true, 0, kMaxOverheadS, &c.a, &f) ||
      !GetNumber(j, "a_mb", path, "a_mb", false, 0, kMaxOverheadS, &c.a_mb, &f) ||
      !GetNumber(j, "b", path, "b", power, 0, kMaxCoefficient, &c.b, &f) ||
      !GetNumber(j, "p", path, "p", power, kMinExponent, kMaxExponent, &c.p, &f) ||
      !GetNumber(j, "c1", path, "c1", !power, 0, kMaxCoefficient, &c.c1, &f) ||
      !GetNumber(j, "c2", path, "c2", !power, 0, kMaxCoefficient, &c.c2, &f)) {
    return *f;
  }
  if (power ? c.b <= 0 : c.c1 + c.c2 <= 0) {
    return JsonFailure(path, power ? "b" : "c1", "the per-sample work term must be > 0");
  }
  c.source = "json:" + path;
  if (auto f_eff = ReadSpEfficiency(j, path, &c)) return *f_eff;
  if (auto it = j.find("memory"); it != j.end()) {
    if (!it->is_object()) return JsonFailure(path, "memory", "expected {\"m0\": .., \"m1\": ..}");
    for (auto k = it->begin(); k != it->end(); ++k) {
      if (k.key() != "m0" && k.key() != "m1") {
        return JsonFailure(path, "memory." + k.key(), "unknown field (known: m0, m1)");
      }
    }
    MemoryModel m;
    if (!GetNumber(*it, "m0", path, "memory.m0", true, 0, kMaxMemoryBytes, &m.m0, &f) ||
        !GetNumber(*it, "m1", path, "memory.m1", true, 0, kMaxMemoryBytes, &m.m1, &f)) {
      return *f;
    }
    if (m.m1 <= 0) return JsonFailure(path, "memory.m1", "bytes per token must be > 0");
    if (memory_out != nullptr) *memory_out = m;
  }
  return c;
}

}  // namespace

Result<CostModel> ParseCostModel(std::string_view text, const std::string& file,
                                 MemoryModel* memory_out) {
  auto j = ParseJson(text, file);
  if (!j.ok()) return j.failure();
  return CostFromJson(*j, file, memory_out);
}

Result<CostModel> LoadCostModel(const std::string& path, MemoryModel* memory_out) {
  auto j = ReadJsonFile(path);
  if (!j.ok()) return j.failure();
  return CostFromJson(*j, path, memory_out);
}

std::string CostModelToJson(const CostModel& cost, const MemoryModel* memory) {
  nlohmann::ordered_json j;
  j["kind"] = cost.kind == CostModel::Kind::kPower ? "power" : "quadratic";
  j["a"] = cost.a;
  j["a_mb"] = cost.a_mb;
  j["b"] = cost.b;
  j["p"] = cost.p;
  j["c1"] = cost.c1;
  j["c2"] = cost.c2;
  if (cost.sp_efficiency != std::array<double, 4>{1, 1, 1, 1}) {
    j["sp_efficiency"] = {
        {"2", cost.sp_efficiency[1]}, {"4", cost.sp_efficiency[2]}, {"8", cost.sp_efficiency[3]}};
  }
  if (!cost.source.empty()) j["source"] = cost.source;
  if (memory != nullptr) j["memory"] = {{"m0", memory->m0}, {"m1", memory->m1}};
  return j.dump(2);
}

}  // namespace ditscale::balance
