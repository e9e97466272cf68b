#include "ditscale/sp/topology.h"

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

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
    t.comm_sm_Bps = 11 * kGB;  // bench/results/sp-smpart-h200/: a strided pack on 4 / 12 free SMs
    t.linear_flops = 750 * kTera;
    t.hbm_bandwidth_Bps = 4000 * kGB;
  } else {
    return false;
  }
  *out = CommonOverheads(t);
  return true;
}

Failure Fail(const std::string& source, const std::string& field, const std::string& msg) {
  Failure f;
  f.file = source;
  f.column = field;
  f.message = msg;
  return f;
}

// 1-based line of byte offset `pos` in `text`.
long long LineOf(const std::string& text, size_t pos) {
  long long line = 1;
  for (size_t i = 0; i < pos && i < text.size(); ++i) line += text[i] == '\n';
  return line;
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
  auto fail = [&](const std::string& why) -> Result<int> {
    return Failure{why, name, 0, "comm_sms"};
  };
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

Result<bool> Topology::Validate() const {
  auto bad = [&](const char* field, const std::string& msg) -> Result<bool> {
    return Fail(name, field, msg);
  };
  if (machines <= 0) return bad("machines", "must be >= 1");
  if (gpus_per_machine <= 0) return bad("gpus_per_machine", "must be >= 1");
  struct Positive {
    const char* field;
    double v;
  };
  for (Positive p :
       {Positive{"intra_bandwidth_GBps", intra_bandwidth_Bps},
        Positive{"nic_bandwidth_GBps", nic_bandwidth_Bps},
        Positive{"attention_tflops", attention_flops}, Positive{"linear_tflops", linear_flops},
        Positive{"hbm_bandwidth_GBps", hbm_bandwidth_Bps}}) {
    if (!(p.v > 0) || !std::isfinite(p.v)) return bad(p.field, "must be a finite number > 0");
  }
  if (!(attention_half_tokens >= 0)) return bad("attention_half_tokens", "must be >= 0");
  if (attention_slots < 0) return bad("attention_slots", "must be >= 0 (0 = no wave model)");
  if (attention_tile_tokens < 1) return bad("attention_tile_tokens", "must be >= 1");
  if (gpu_sms < 0) return bad("gpu_sms", "must be >= 0 (0 = unknown: no SM partitions)");
  if (sm_partition_step < 0) return bad("sm_partition_step", "must be >= 0");
  if (!(comm_sm_Bps >= 0) || !std::isfinite(comm_sm_Bps)) {
    return bad("comm_sm_GBps", "must be a finite number >= 0");
  }
  for (Positive p : {Positive{"intra_latency_us", intra_latency_s},
                     Positive{"inter_latency_us", inter_latency_s},
                     Positive{"launch_overhead_us", launch_overhead_s},
                     Positive{"two_sided_sync_us", two_sided_sync_s},
                     Positive{"one_sided_overhead_us", one_sided_overhead_s}}) {
    if (!(p.v >= 0) || !std::isfinite(p.v)) return bad(p.field, "must be a finite number >= 0");
  }
  if (!(nic_duplex_Bps >= 0) || !std::isfinite(nic_duplex_Bps)) {
    return bad("nic_duplex_GBps", "must be a finite number >= 0 (0 = full duplex)");
  }
  if (nics_per_machine < 0 || nics_per_machine > gpus_per_machine) {
    return bad("nics_per_machine", "must be in [0, gpus_per_machine] (0 = one per GPU), got " +
                                       std::to_string(nics_per_machine));
  }
  if (!(two_sided_sm_fraction >= 0 && two_sided_sm_fraction < 1)) {
    return bad("two_sided_sm_fraction", "must be in [0, 1)");
  }
  if (!(inter_compute_interference >= 0 && inter_compute_interference < 1)) {
    return bad("inter_compute_interference", "must be in [0, 1)");
  }
  return true;
}

std::vector<std::string> PresetNames() { return {"p4de", "h100-8x", "h200-local"}; }

Result<Topology> MakePresetTopology(const std::string& name, int machines, int gpus_per_machine) {
  Topology t;
  if (!PresetByName(name, &t)) {
    std::string known;
    for (const auto& n : PresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Failure{"unknown cluster preset '" + name + "' (known: " + known + ")", "", 0,
                   "cluster"};
  }
  if (machines <= 0) return Failure{"must be >= 1", "", 0, "machines"};
  t.machines = machines;
  if (gpus_per_machine > 0) t.gpus_per_machine = gpus_per_machine;
  return t;
}

Result<Topology> ParseTopologyJson(const std::string& json_text, const std::string& source,
                                   int machines, int gpus_per_machine) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::parse_error& e) {
    Failure f = Fail(source, "", std::string("invalid JSON: ") + e.what());
    f.line = LineOf(json_text, e.byte > 0 ? e.byte - 1 : 0);
    return f;
  }
  if (!j.is_object()) return Fail(source, "", "top level must be a JSON object");

  Topology t;
  bool have_base = false;
  if (j.contains("base")) {
    if (!j["base"].is_string()) return Fail(source, "base", "must be a preset name string");
    std::string base = j["base"].get<std::string>();
    if (!PresetByName(base, &t)) return Fail(source, "base", "unknown preset '" + base + "'");
    have_base = true;
  }
  t.name = source;
  struct Field {
    const char* key;
    double* dst;
    double scale;
  };
  double gpm = t.gpus_per_machine;
  std::vector<Field> fields = {
      {"gpus_per_machine", &gpm, 1},
      {"intra_bandwidth_GBps", &t.intra_bandwidth_Bps, kGB},
      {"intra_latency_us", &t.intra_latency_s, kUs},
      {"nic_bandwidth_GBps", &t.nic_bandwidth_Bps, kGB},
      {"inter_latency_us", &t.inter_latency_s, kUs},
      {"attention_tflops", &t.attention_flops, kTera},
      {"attention_half_tokens", &t.attention_half_tokens, 1},
      {"linear_tflops", &t.linear_flops, kTera},
      {"hbm_bandwidth_GBps", &t.hbm_bandwidth_Bps, kGB},
      {"launch_overhead_us", &t.launch_overhead_s, kUs},
      {"two_sided_sync_us", &t.two_sided_sync_s, kUs},
      {"two_sided_sm_fraction", &t.two_sided_sm_fraction, 1},
      {"one_sided_overhead_us", &t.one_sided_overhead_s, kUs},
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    if (key == "base") continue;
    if (key == "nic_duplex_GBps" || key == "inter_compute_interference" ||
        key == "comm_sm_GBps") {  // optional keys
      if (!it->is_number()) return Fail(source, key, "must be a number");
      if (key == "nic_duplex_GBps") {
        t.nic_duplex_Bps = it->get<double>() * kGB;
      } else if (key == "comm_sm_GBps") {
        t.comm_sm_Bps = it->get<double>() * kGB;
      } else {
        t.inter_compute_interference = it->get<double>();
      }
      continue;
    }
    if (key == "gpu_sms" || key == "sm_partition_step") {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 65536) {
        return Fail(source, key, "must be an integer >= 0 (0 = no SM partitions)");
      }
      (key == "gpu_sms" ? t.gpu_sms : t.sm_partition_step) = static_cast<int>(it->get<int64_t>());
      continue;
    }
    if (key == "attention_holds_sms") {
      if (!it->is_boolean()) return Fail(source, key, "must be true or false");
      t.attention_holds_sms = it->get<bool>();
      continue;
    }
    if (key == "attention_slots" || key == "attention_tile_tokens") {
      const bool slots = key == "attention_slots";
      if (!it->is_number_integer() || it->get<int64_t>() < (slots ? 0 : 1) ||
          it->get<int64_t>() > (1 << 20)) {
        return Fail(source, key,
                    slots ? "must be an integer >= 0 (0 = no wave model)"
                          : "must be an integer >= 1 (query rows per CTA)");
      }
      (slots ? t.attention_slots : t.attention_tile_tokens) = static_cast<int>(it->get<int64_t>());
      continue;
    }
    if (key == "nics_per_machine") {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 1024) {
        return Fail(source, key, "must be an integer >= 0 (0 = one NIC per GPU)");
      }
      t.nics_per_machine = static_cast<int>(it->get<int64_t>());
      continue;
    }
    if (key == "name") {
      if (!it->is_string()) return Fail(source, key, "must be a string");
      t.name = it->get<std::string>();
      continue;
    }
    bool known = false;
    for (const Field& f : fields) {
      if (key != f.key) continue;
      known = true;
      if (!it->is_number()) return Fail(source, key, "must be a number");
      *f.dst = it->get<double>() * f.scale;
    }
    if (!known) return Fail(source, key, "unknown field");
  }
  if (!have_base) {
    for (const Field& f : fields) {
      if (!j.contains(f.key)) {
        return Fail(source, f.key, "missing (give it, or a \"base\" preset to inherit from)");
      }
    }
  }
  if (gpm != std::floor(gpm) || gpm < 1 || gpm > 1024) {
    return Fail(source, "gpus_per_machine", "must be an integer in [1, 1024]");
  }
  t.gpus_per_machine = static_cast<int>(gpm);
  if (gpus_per_machine > 0) t.gpus_per_machine = gpus_per_machine;
  t.machines = machines;
  Result<bool> v = t.Validate();
  if (!v.ok()) {
    Failure f = v.failure();
    f.file = source;
    return f;
  }
  return t;
}

Result<Topology> LoadTopology(const std::string& preset_or_file, int machines,
                              int gpus_per_machine) {
  Topology t;
  if (PresetByName(preset_or_file, &t)) {
    return MakePresetTopology(preset_or_file, machines, gpus_per_machine);
  }
  std::ifstream in(preset_or_file);
  if (!in) {
    std::string known;
    for (const auto& n : PresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Failure{"neither a preset (" + known + ") nor a readable JSON file", preset_or_file, 0,
                   "cluster"};
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseTopologyJson(ss.str(), preset_or_file, machines, gpus_per_machine);
}

}  // namespace ditscale::sp
