#include "ditscale/sp/topology.h"

#include <sys/stat.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "ditscale/core/json_text.h"
#include "ditscale/core/range.h"

namespace ditscale::sp {
namespace {

constexpr double kGB = 1e9;
constexpr double kGiB = 1073741824.0;
constexpr double kTera = 1e12;
constexpr double kUs = 1e-6;

Topology CommonOverheads(Topology t) {
  t.attention_half_tokens = 128;
  t.launch_overhead_s = 5 * kUs;
  t.two_sided_sync_s = 15 * kUs;
  t.two_sided_sm_fraction = 0.10;
  t.one_sided_overhead_s = 2 * kUs;
  return t;
}

bool PresetByName(const std::string& name, Topology* out) {
  Topology t;
  t.name = name;
  if (name == "p4de") {
    t.gpus_per_machine = 8;
    t.intra_bandwidth_Bps = 240 * kGB;
    t.intra_latency_s = 5 * kUs;
    t.nic_bandwidth_Bps = 42.5 * kGB;
    t.inter_latency_s = 20 * kUs;
    t.attention_flops = 200 * kTera;
    t.linear_flops = 250 * kTera;
    t.hbm_bandwidth_Bps = 1600 * kGB;
    t.gpu_sms = 108;
    t.sm_partition_step = 2;  // no comm_sm_Bps measured: no partitions offered
  } else if (name == "h100-8x") {
    t.gpus_per_machine = 8;
    t.intra_bandwidth_Bps = 360 * kGB;
    t.intra_latency_s = 4 * kUs;
    t.nic_bandwidth_Bps = 320 * kGB;
    t.inter_latency_s = 15 * kUs;
    t.attention_flops = 600 * kTera;
    t.attention_slots = 132;
    t.attention_holds_sms = true;
    t.gpu_sms = 132;
    t.sm_partition_step = 8;
    t.comm_sm_Bps = 11 * kGB;  // the H200's measurement (same SMs)
    t.linear_flops = 700 * kTera;
    t.hbm_bandwidth_Bps = 2800 * kGB;
  } else if (name == "h200-local") {
    t.gpus_per_machine = 4;
    t.intra_bandwidth_Bps = 263 * kGiB;
    t.intra_latency_s = 5 * kUs;
    t.nic_bandwidth_Bps = 1.8 * kGiB;
    t.nics_per_machine = 0;  // emulated machines: each GPU pair has its own loopback sockets
    t.inter_latency_s = 50 * kUs;
    t.inter_compute_interference = 0.3;  // fit_runs.py: 0.45 (2 x 1), 0.15 (2 x 2 GPUs)
    t.attention_flops = 650 * kTera;
    t.attention_slots = 132;
    t.attention_holds_sms = true;
    t.gpu_sms = 132;
    t.sm_partition_step = 8;
    t.comm_sm_Bps = 11 * kGB;  // lab/results/sp-smpart_h200_2026-12/: a strided pack on 4 / 12 free SMs
    t.linear_flops = 750 * kTera;
    t.hbm_bandwidth_Bps = 4000 * kGB;
  } else {
    return false;
  }
  *out = CommonOverheads(t);
  return true;
}

// A bad field of a topology: `source` is its file, or the name of the preset it came from.
Failure Fail(const std::string& source, const std::string& field, const std::string& msg) {
  return Failure::InFile(source, 0, field, msg);
}

}  // namespace

double Topology::BlockEfficiency(double tokens) const {
  if (tokens <= 0) return 0;
  return tokens / (tokens + attention_half_tokens);
}

namespace {

// ceil(W) / W, W = batch_heads * ceil(q_tokens / tile) / slots; 1 without waves (slots <= 0).
double WaveFactorOf(int slots, int tile, double q_tokens, double batch_heads) {
  if (slots <= 0 || batch_heads <= 0 || q_tokens <= 0) return 1.0;
  const double waves = batch_heads * std::ceil(q_tokens / tile) / slots;
  return std::ceil(waves - 1e-9) / waves;
}

}  // namespace

double Topology::WaveFactor(double q_tokens, double batch_heads) const {
  return WaveFactorOf(attention_slots, attention_tile_tokens, q_tokens, batch_heads);
}

double Topology::AttentionSeconds(double flops, double q_tokens, double kv_tokens,
                                  double batch_heads, int sms) const {
  if (flops <= 0) return launch_overhead_s;
  double eff = BlockEfficiency(q_tokens) * BlockEfficiency(kv_tokens);
  DS_CHECK(eff > 0, "attention block with no tokens: q=", q_tokens, " kv=", kv_tokens);
  // On a partition the kernel's waves shrink with the SMs (one CTA per SM), its rate with them.
  double share = 1;
  int slots = attention_slots;
  if (sms > 0 && gpu_sms > 0 && sms < gpu_sms) {
    share = double(sms) / gpu_sms;
    if (slots > 0) slots = std::max(1, static_cast<int>(std::lround(slots * share)));
  }
  return launch_overhead_s + flops *
                                 WaveFactorOf(slots, attention_tile_tokens, q_tokens, batch_heads) /
                                 (attention_flops * share * eff);
}

Result<int> Topology::ComputeSms(int comm_sms) const {
  if (comm_sms == 0) return gpu_sms;
  auto fail = [&](const std::string& why) -> Result<int> { return Fail(name, "comm_sms", why); };
  if (comm_sms < 0) return fail("must be >= 0 (SMs kept free for communication)");
  if (!SmPartitions()) {
    return fail("topology '" + name +
                "' describes no SM partitions (gpu_sms, sm_partition_step, comm_sm_GBps)");
  }
  const int sms = PartitionSms(gpu_sms, sm_partition_step, comm_sms);
  if (sms == 0) {
    return fail(std::to_string(comm_sms) + " of " + std::to_string(gpu_sms) +
                " SMs leave no partition of a multiple of " + std::to_string(sm_partition_step) +
                " SMs for compute");
  }
  return sms;
}

int PartitionSms(int gpu_sms, int step, int comm_sms) {
  if (comm_sms == 0) return gpu_sms;
  if (comm_sms < 0 || comm_sms >= gpu_sms || step <= 0) return 0;
  const int sms = (gpu_sms - comm_sms) / step * step;
  return sms >= step ? sms : 0;
}

int Topology::SmallestCommSms() const {
  if (!SmPartitions() || gpu_sms <= sm_partition_step) return 0;
  return gpu_sms - (gpu_sms - 1) / sm_partition_step * sm_partition_step;
}

double Topology::MemorySeconds(double bytes) const {
  return launch_overhead_s + std::max(0.0, bytes) / hbm_bandwidth_Bps;
}

double Topology::LinearSeconds(double flops) const { return std::max(0.0, flops) / linear_flops; }

double Topology::TransferSeconds(double bytes, int a, int b) const {
  if (a == b) return MemorySeconds(2 * bytes);  // a local copy reads and writes
  if (SameMachine(a, b)) return intra_latency_s + bytes / intra_bandwidth_Bps;
  return inter_latency_s + bytes / nic_bandwidth_Bps;
}

namespace {

// A real field: its JSON name, the member, the JSON unit in SI units and the range in JSON units.
// zero_off: 0 is also allowed (the feature is off).
struct RealField {
  const char* key;
  double Topology::*member;
  double scale;
  double lo, hi;
  bool required;  // without "base"
  bool zero_off;
};

constexpr double kMaxRate = 1e5;  // GB/s, TFLOP/s
constexpr double kMinRate = 1e-3;
constexpr double kMaxUs = 1e6;  // one second

const std::vector<RealField>& RealFields() {
  static const std::vector<RealField> fields = {
      {"intra_bandwidth_GBps", &Topology::intra_bandwidth_Bps, kGB, kMinRate, kMaxRate, true,
       false},
      {"intra_latency_us", &Topology::intra_latency_s, kUs, 0, kMaxUs, true, false},
      {"nic_bandwidth_GBps", &Topology::nic_bandwidth_Bps, kGB, kMinRate, kMaxRate, true, false},
      {"nic_duplex_GBps", &Topology::nic_duplex_Bps, kGB, kMinRate, kMaxRate, false, true},
      {"inter_latency_us", &Topology::inter_latency_s, kUs, 0, kMaxUs, true, false},
      {"attention_tflops", &Topology::attention_flops, kTera, kMinRate, kMaxRate, true, false},
      {"attention_half_tokens", &Topology::attention_half_tokens, 1, 0, 1e9, true, false},
      {"linear_tflops", &Topology::linear_flops, kTera, kMinRate, kMaxRate, true, false},
      {"hbm_bandwidth_GBps", &Topology::hbm_bandwidth_Bps, kGB, kMinRate, 1e6, true, false},
      {"launch_overhead_us", &Topology::launch_overhead_s, kUs, 0, kMaxUs, true, false},
      {"two_sided_sync_us", &Topology::two_sided_sync_s, kUs, 0, kMaxUs, true, false},
      {"two_sided_sm_fraction", &Topology::two_sided_sm_fraction, 1, 0, 0.99, true, false},
      {"one_sided_overhead_us", &Topology::one_sided_overhead_s, kUs, 0, kMaxUs, true, false},
      {"inter_compute_interference", &Topology::inter_compute_interference, 1, 0, 0.99, false,
       false},
      {"comm_sm_GBps", &Topology::comm_sm_Bps, kGB, kMinRate, kMaxRate, false, true},
  };
  return fields;
}

// An integer field; hi < 0: the bound is gpus_per_machine (nics_per_machine).
struct IntField {
  const char* key;
  int Topology::*member;
  long long lo, hi;
  bool required;
};

const std::vector<IntField>& IntFields() {
  static const std::vector<IntField> fields = {
      {"gpus_per_machine", &Topology::gpus_per_machine, 1, kMaxGpusPerMachine, true},
      {"nics_per_machine", &Topology::nics_per_machine, 0, -1, false},
      {"attention_slots", &Topology::attention_slots, 0, 1 << 20, false},
      {"attention_tile_tokens", &Topology::attention_tile_tokens, 1, 1 << 20, false},
      {"gpu_sms", &Topology::gpu_sms, 0, 65536, false},
      {"sm_partition_step", &Topology::sm_partition_step, 0, 65536, false},
  };
  return fields;
}

// "v is out of range [lo, hi]" (RangeError without the name: the failure's column names it).
template <typename T>
std::optional<std::string> OutOfRange(T v, T lo, T hi) {
  auto e = RangeError("", v, lo, hi);
  if (e) e = e->substr(2);
  return e;
}

std::optional<std::string> RealFieldError(const RealField& f, double v) {
  if (f.zero_off && v == 0) return std::nullopt;
  auto e = OutOfRange(v, f.lo, f.hi);
  if (e && f.zero_off) *e += " (or 0: off)";
  return e;
}

// The rank-count limit: "machines 1000 x gpus_per_machine 8 = 8000 ranks exceeds ...".
std::optional<std::string> RanksError(int machines, int gpus_per_machine) {
  const long long n = static_cast<long long>(machines) * gpus_per_machine;
  if (n <= kMaxRanks) return std::nullopt;
  return std::to_string(machines) + " machines x " + std::to_string(gpus_per_machine) +
         " GPUs = " + std::to_string(n) + " ranks exceeds the limit of " +
         std::to_string(kMaxRanks) + " ranks";
}

// machines in [1, kMaxMachines]; gpus_per_machine 0 (keep) or in [1, kMaxGpusPerMachine].
std::optional<Failure> SizeArgsError(int machines, int gpus_per_machine) {
  if (auto e = OutOfRange<long long>(machines, 1, kMaxMachines)) {
    return Failure::InvalidArgument(*e, "machines");
  }
  if (gpus_per_machine != 0) {
    if (auto e = OutOfRange<long long>(gpus_per_machine, 1, kMaxGpusPerMachine)) {
      return Failure::InvalidArgument(*e + " (or 0: the cluster's default)", "gpus_per_machine");
    }
  }
  return std::nullopt;
}

}  // namespace

Result<bool> Topology::Validate() const {
  auto bad = [&](const std::string& field, const std::string& msg) -> Result<bool> {
    return Fail(name, field, msg);
  };
  if (auto e = OutOfRange<long long>(machines, 1, kMaxMachines)) return bad("machines", *e);
  for (const IntField& f : IntFields()) {
    const long long hi = f.hi >= 0 ? f.hi : gpus_per_machine;
    if (auto e = OutOfRange<long long>(this->*f.member, f.lo, hi)) {
      return bad(f.key, *e + (f.hi < 0 ? " (0 = one per GPU; at most gpus_per_machine)" : ""));
    }
  }
  if (auto e = RanksError(machines, gpus_per_machine)) return bad("machines", *e);
  for (const RealField& f : RealFields()) {
    if (auto e = RealFieldError(f, this->*f.member / f.scale)) return bad(f.key, *e);
  }
  return true;
}

std::vector<std::string> PresetNames() { return {"p4de", "h100-8x", "h200-local"}; }

Result<Topology> MakePresetTopology(const std::string& name, int machines, int gpus_per_machine) {
  Topology t;
  if (!PresetByName(name, &t)) {
    std::string known;
    for (const auto& n : PresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Failure::InvalidArgument("unknown cluster preset '" + name + "' (known: " + known + ")",
                                    "cluster");
  }
  if (auto f = SizeArgsError(machines, gpus_per_machine)) return *f;
  t.machines = machines;
  if (gpus_per_machine > 0) t.gpus_per_machine = gpus_per_machine;
  if (auto e = RanksError(t.machines, t.gpus_per_machine)) {
    return Failure::InvalidArgument(*e, "machines");
  }
  return t;
}

namespace {

// The JSON document (an object) onto `t` (a preset's values with "base", else defaults).
Result<Topology> TopologyFromJson(const nlohmann::json& j, const std::string& source, int machines,
                                  int gpus_per_machine) {
  if (auto f = SizeArgsError(machines, gpus_per_machine)) return *f;
  if (!j.is_object()) return Fail(source, "", "top level must be a JSON object");
  Topology t;
  bool have_base = false;
  if (auto it = j.find("base"); it != j.end()) {
    if (!it->is_string()) return Fail(source, "base", "must be a preset name string");
    std::string base = it->get<std::string>();
    if (!PresetByName(base, &t)) return Fail(source, "base", "unknown preset '" + base + "'");
    have_base = true;
  }
  t.name = source;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "base") continue;
    if (key == "name") {
      if (!it->is_string()) return Fail(source, key, "must be a string");
      t.name = it->get<std::string>();
      continue;
    }
    if (key == "attention_holds_sms") {
      if (!it->is_boolean()) return Fail(source, key, "must be true or false");
      t.attention_holds_sms = it->get<bool>();
      continue;
    }
    bool known = false;
    for (const RealField& f : RealFields()) {
      if (key != f.key) continue;
      known = true;
      if (!it->is_number()) return Fail(source, key, "must be a number");
      const double v = it->get<double>();
      if (auto e = RealFieldError(f, v)) return Fail(source, key, *e);
      t.*f.member = v * f.scale;
    }
    for (const IntField& f : IntFields()) {
      if (key != f.key) continue;
      known = true;
      if (!it->is_number()) return Fail(source, key, "must be an integer");
      const double v = it->get<double>();  // integers beyond 2^53 are out of range anyway
      const long long hi = f.hi >= 0 ? f.hi : kMaxGpusPerMachine;  // nics: see Validate
      if (v != std::floor(v)) {
        return Fail(source, key, "must be an integer, got " + FormatNumber(v));
      }
      if (!(v >= double(f.lo) && v <= double(hi))) {  // before the cast; printed as integers
        return Fail(source, key,
                    FormatNumber(v) + " is out of range [" + FormatNumber(f.lo) + ", " +
                        FormatNumber(hi) + "]");
      }
      t.*f.member = static_cast<int>(v);
    }
    if (!known) return Fail(source, key, "unknown field");
  }
  if (!have_base) {
    for (const RealField& f : RealFields()) {
      if (f.required && !j.contains(f.key)) {
        return Fail(source, f.key, "missing (give it, or a \"base\" preset to inherit from)");
      }
    }
    for (const IntField& f : IntFields()) {
      if (f.required && !j.contains(f.key)) {
        return Fail(source, f.key, "missing (give it, or a \"base\" preset to inherit from)");
      }
    }
  }
  if (gpus_per_machine > 0) t.gpus_per_machine = gpus_per_machine;
  t.machines = machines;
  Result<bool> v = t.Validate();
  if (!v.ok()) {
    const Failure& f = v.failure();
    return Failure::InFile(source, f.line, f.column, f.message);
  }
  return t;
}

}  // namespace

Result<Topology> ParseTopologyJson(const std::string& json_text, const std::string& source,
                                   int machines, int gpus_per_machine) {
  Result<nlohmann::json> j = ParseJson(json_text, source);
  if (!j.ok()) return j.failure();
  return TopologyFromJson(*j, source, machines, gpus_per_machine);
}

Result<Topology> LoadTopology(const std::string& preset_or_file, int machines,
                              int gpus_per_machine) {
  Topology t;
  if (PresetByName(preset_or_file, &t)) {
    return MakePresetTopology(preset_or_file, machines, gpus_per_machine);
  }
  struct stat st {};
  if (::stat(preset_or_file.c_str(), &st) != 0) {
    std::string known;
    for (const auto& n : PresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Failure::InFile(preset_or_file, 0, "cluster",
                           "neither a preset (" + known + ") nor a readable JSON file");
  }
  if (auto f = SizeArgsError(machines, gpus_per_machine)) return *f;
  Result<nlohmann::json> j = ReadJsonFile(preset_or_file);
  if (!j.ok()) return j.failure();
  return TopologyFromJson(*j, preset_or_file, machines, gpus_per_machine);
}

}  // namespace ditscale::sp
