#include "ditscale/sp/planner.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/core/range.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

std::string Ms(double s) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(s < 0.01 ? 3 : s < 1 ? 2 : 1);
  os << s * 1e3 << " ms";
  return os.str();
}

std::string Ratio(double x) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(2);
  os << x << "x";
  return os.str();
}

std::string Bytes(double b) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  if (b >= 1e9) {
    os << b / 1e9 << " GB";
  } else {
    os << b / 1e6 << " MB";
  }
  return os.str();
}

std::string Pct(double f) { return std::to_string(std::lround(100 * f)) + "%"; }

}  // namespace

std::string PlanCandidate::Name() const {
  std::ostringstream os;
  os << config.strategy << " U=" << config.ulysses_degree << " R=" << config.ring_degree;
  if (config.strategy == Strategy::kTorus) os << " chunks=" << config.torus_chunks;
  if (config.ulysses_chunks > 1) os << " ulysses_chunks=" << config.ulysses_chunks;
  os << " " << TransportDescription(config);
  if (config.comm_sms > 0) os << " comm_sms=" << config.comm_sms;
  return os.str();
}

double PlanCandidate::hidden_comm_fraction() const {
  double active = sim.mean_comm_active_s();
  if (active <= 0) return 1.0;
  return std::clamp(1.0 - sim.mean_exposed_comm_s() / active, 0.0, 1.0);
}

Result<PlanCandidate> EvaluateConfig(const Topology& topology, const Workload& workload,
                                     const SpConfig& config) {
  if (Result<bool> v = topology.Validate(); !v.ok()) return v.failure();
  if (Result<bool> v = workload.Validate(); !v.ok()) return v.failure();
  SpMesh mesh;
  mesh.machines = topology.machines;
  mesh.gpus_per_machine = topology.gpus_per_machine;
  AttentionShape shape = ToAttentionShape(workload);
  SpConfig cfg = config;
  if (cfg.attention_slots == 0) {  // the kernel's waves as the topology models them
    cfg.attention_slots = topology.attention_slots;
    cfg.attention_tile_tokens = topology.attention_tile_tokens;
  }
  Result<Schedule> schedule = BuildSchedule(mesh, cfg, shape);
  if (!schedule.ok()) return schedule.failure();
  Result<SimResult> sim = Simulate(*schedule, topology);
  if (!sim.ok()) return sim.failure();
  PlanCandidate c;
  c.config = schedule->config;
  c.sim = std::move(sim).ValueOrThrow();
  c.step = PredictStep(c.sim, workload, topology);
  for (const RankBreakdown& r : c.sim.ranks) {
    c.max_inter_bytes_per_rank = std::max(c.max_inter_bytes_per_rank, r.sent_inter_bytes);
    c.max_intra_bytes_per_rank = std::max(c.max_intra_bytes_per_rank, r.sent_intra_bytes);
  }
  for (int64_t b : WorkBytesPerRank(*schedule)) {
    c.max_work_bytes_per_rank = std::max(c.max_work_bytes_per_rank, b);
  }
  return c;
}

namespace {

// A list option (strategies, chunk counts) holds 1 to kMaxPlanListSize entries.
std::optional<Failure> CheckListSize(size_t size, bool may_be_empty, const char* what,
                                     const char* field) {
  if ((size > 0 || may_be_empty) && size <= size_t(kMaxPlanListSize)) return std::nullopt;
  if (may_be_empty) {
    return Failure::InvalidArgument(
        std::to_string(size) + " " + what + " given, at most " + std::to_string(kMaxPlanListSize),
        field);
  }
  return Failure::InvalidArgument(std::to_string(size) + " " + what + " given, expected 1 to " +
                                      std::to_string(kMaxPlanListSize),
                                  field);
}

// Every value of a chunk list in [1, hi]; the message without the field's name (it is the field).
std::optional<Failure> CheckChunks(const std::vector<int>& chunks, const std::string& field,
                                   long long hi) {
  for (int c : chunks) {
    if (auto e = RangeError(field, static_cast<long long>(c), 1, hi)) {
      return Failure::InvalidArgument(e->substr(field.size() + 2), field);
    }
  }
  return std::nullopt;
}

// The ranges of PlanOptions (planner.h), in the order the fields are documented.
std::optional<Failure> CheckOptions(const PlanOptions& options, size_t strategies) {
  if (auto f = CheckListSize(strategies, true, "strategies", "strategies")) return f;
  if (auto f = CheckListSize(options.torus_chunks.size(), false, "chunk counts", "torus_chunks")) {
    return f;
  }
  if (auto f = CheckChunks(options.torus_chunks, "torus_chunks", kMaxTorusChunks)) return f;
  if (auto f =
          CheckListSize(options.ulysses_chunks.size(), false, "chunk counts", "ulysses_chunks")) {
    return f;
  }
  if (auto f = CheckChunks(options.ulysses_chunks, "ulysses_chunks", kMaxUlyssesChunks)) return f;
  if (auto e = RangeError("max_schedule_ops", static_cast<long long>(options.max_schedule_ops), 1,
                          kMaxScheduleOps)) {
    return Failure::InvalidArgument(e->substr(18), "max_schedule_ops");
  }
  if (options.max_total_ops < 1) {
    return Failure::InvalidArgument(std::to_string(options.max_total_ops) + " must be >= 1",
                                    "max_total_ops");
  }
  return std::nullopt;
}

// (one_sided, one_sided_inter) of the transports asked for. Puts within machines and NCCL
// between them only with more than one machine (on one machine it is the plain one-sided
// schedule, already enumerated).
std::vector<std::pair<bool, bool>> Transports(const PlanOptions& options, int machines) {
  std::vector<std::pair<bool, bool>> transports;
  if (options.two_sided) transports.push_back({false, true});
  if (options.one_sided) transports.push_back({true, true});
  if (options.one_sided_intra_only && machines > 1) {
    transports.push_back({true, false});
  } else if (options.one_sided_intra_only && !options.one_sided) {
    transports.push_back({true, true});  // one machine: the same schedule
  }
  return transports;
}

// The (Ulysses, ring) degrees with U * R = n that strategy s runs on.
std::vector<std::pair<int, int>> DegreesOf(Strategy s, int n) {
  std::vector<std::pair<int, int>> degrees;
  for (int u = 1; u <= n; ++u) {
    if (n % u != 0) continue;
    const int r = n / u;
    bool take = false;
    switch (s) {
      case Strategy::kUlysses:
      case Strategy::kUlyssesOverlap:
        take = r == 1;
        break;
      case Strategy::kRing:
        take = u == 1;
        break;
      case Strategy::kUsp:
      case Strategy::kSwiftFusionTas:
        take = u > 1 && r > 1;
        break;
      case Strategy::kTorus:
        take = u > 1;
        break;
    }
    if (take) degrees.push_back({u, r});
  }
  return degrees;
}

// 1. Enumerate: every strategy x degrees x chunk count x transport, then (with SM partitions
// asked for and offered) the same list again with comm_sms.
std::vector<SpConfig> Enumerate(const Topology& topology, const PlanOptions& options,
                                const std::vector<Strategy>& strategies,
                                const std::vector<std::pair<bool, bool>>& transports) {
  std::vector<SpConfig> configs;
  for (Strategy s : strategies) {
    for (auto [u, r] : DegreesOf(s, topology.world_size())) {
      // Torus: token chunks; ulysses: head chunks (only where U > 1 has an all-to-all to cut).
      std::vector<int> chunks = {1};
      if (s == Strategy::kTorus) chunks = options.torus_chunks;
      if (s == Strategy::kUlysses && u > 1) chunks = options.ulysses_chunks;
      for (int c : chunks) {
        for (auto [one, inter] : transports) {
          SpConfig cfg;
          cfg.strategy = s;
          cfg.ulysses_degree = u;
          cfg.ring_degree = r;
          (s == Strategy::kUlysses ? cfg.ulysses_chunks : cfg.torus_chunks) = c;
          cfg.one_sided = one;
          cfg.one_sided_inter = inter;
          configs.push_back(cfg);
        }
      }
    }
  }
  const int comm_sms = topology.SmallestCommSms();
  if (options.sm_partitions && comm_sms > 0 && topology.attention_holds_sms) {
    const size_t whole = configs.size();
    for (size_t i = 0; i < whole; ++i) {
      SpConfig cfg = configs[i];
      cfg.comm_sms = comm_sms;
      configs.push_back(cfg);
    }
  }
  return configs;
}

std::string NameOf(const SpConfig& cfg) {
  PlanCandidate named;
  named.config = cfg;
  return named.Name();
}

// 2. Budget (planner.h, bounded search): resolve and estimate every candidate, choose the
// cheapest within the plan's budget; *skip gets the reason of every one not chosen.
std::vector<char> ChooseWithinBudget(const Topology& topology, const Workload& workload,
                                     const PlanOptions& options,
                                     const std::vector<SpConfig>& configs,
                                     std::vector<std::string>* skip) {
  const SpMesh mesh{topology.machines, topology.gpus_per_machine};
  const AttentionShape shape = ToAttentionShape(workload);
  const int64_t tokens_per_rank = shape.seq_tokens / std::max(1, topology.world_size());
  skip->assign(configs.size(), "");
  std::vector<int64_t> estimate(configs.size(), 0);
  std::vector<size_t> feasible;
  for (size_t i = 0; i < configs.size(); ++i) {
    const SpConfig& cfg = configs[i];
    Result<SpConfig> r = ResolveConfig(mesh, cfg, shape);
    if (!r.ok()) {
      (*skip)[i] = NameOf(cfg) + ": " + r.failure().ToString();
      continue;
    }
    if (cfg.strategy == Strategy::kTorus && cfg.torus_chunks > 1 &&
        cfg.torus_chunks > tokens_per_rank) {
      (*skip)[i] = NameOf(cfg) + ": more chunks than the " + std::to_string(tokens_per_rank) +
                   " tokens per rank (the schedule of chunks=" + std::to_string(tokens_per_rank) +
                   ")";
      continue;
    }
    estimate[i] = ScheduleOpsEstimate(*r, shape);
    if (estimate[i] > options.max_schedule_ops) {
      (*skip)[i] = NameOf(cfg) + ": about " + std::to_string(estimate[i]) +
                   " ops, over the planner's limit of " + std::to_string(options.max_schedule_ops) +
                   " ops per schedule";
      continue;
    }
    feasible.push_back(i);
  }
  std::stable_sort(feasible.begin(), feasible.end(),
                   [&](size_t a, size_t b) { return estimate[a] < estimate[b]; });
  std::vector<char> chosen(configs.size(), 0);
  int64_t spent = 0;
  for (size_t i : feasible) {
    if (spent + estimate[i] > options.max_total_ops) {
      (*skip)[i] = NameOf(configs[i]) + ": not simulated: about " + std::to_string(estimate[i]) +
                   " ops, over what is left of the plan's budget of " +
                   std::to_string(options.max_total_ops) + " ops (" + std::to_string(spent) +
                   " spent on smaller schedules)";
      continue;
    }
    spent += estimate[i];
    chosen[i] = 1;
  }
  return chosen;
}

// 3. Simulate the chosen candidates (in enumeration order); the others, and those over the work
// memory limit or failing, are reported in out->skipped.
void SimulateChosen(const Topology& topology, const Workload& workload, const PlanOptions& options,
                    const std::vector<SpConfig>& configs, const std::vector<char>& chosen,
                    const std::vector<std::string>& skip, PlanResult* out) {
  for (size_t i = 0; i < configs.size(); ++i) {
    const SpConfig& cfg = configs[i];
    if (!chosen[i]) {
      out->skipped.push_back(skip[i]);
      continue;
    }
    Result<PlanCandidate> c = EvaluateConfig(topology, workload, cfg);
    if (c.ok() && options.max_work_bytes_per_rank > 0 &&
        c->max_work_bytes_per_rank > options.max_work_bytes_per_rank) {
      std::ostringstream why;
      why << c->Name() << ": needs " << c->max_work_bytes_per_rank / 1e6
          << " MB of work memory on a rank, over the limit of "
          << options.max_work_bytes_per_rank / 1e6 << " MB";
      out->skipped.push_back(why.str());
    } else if (c.ok()) {
      out->ranked.push_back(std::move(c).ValueOrThrow());
    } else {
      out->skipped.push_back(NameOf(cfg) + ": " + c.failure().ToString());
    }
  }
}

}  // namespace

// check -> enumerate -> budget -> simulate -> rank -> explain.
Result<PlanResult> Plan(const Topology& topology, const Workload& workload,
                        const PlanOptions& options) {
  Result<bool> v = topology.Validate();
  if (!v.ok()) return v.failure();
  v = workload.Validate();
  if (!v.ok()) return v.failure();
  std::vector<Strategy> strategies = options.strategies;
  if (strategies.empty()) strategies.assign(kAllStrategies.begin(), kAllStrategies.end());
  if (auto f = CheckOptions(options, strategies.size())) return *f;
  const auto transports = Transports(options, topology.machines);
  if (transports.empty()) return Failure::InvalidArgument("no transport selected", "one_sided");
  const std::vector<SpConfig> configs = Enumerate(topology, options, strategies, transports);
  if (configs.size() > kMaxPlanCandidates) {
    return Failure::InvalidArgument(std::to_string(configs.size()) +
                                        " candidates, over the limit of " +
                                        std::to_string(kMaxPlanCandidates),
                                    "strategies");
  }
  std::vector<std::string> skip;
  const std::vector<char> chosen = ChooseWithinBudget(topology, workload, options, configs, &skip);
  PlanResult out;
  SimulateChosen(topology, workload, options, configs, chosen, skip, &out);
  if (out.ranked.empty()) {
    std::string why = out.skipped.empty() ? "no configuration enumerated" : out.skipped[0];
    return Failure::Infeasible("no feasible configuration: " + why, "strategy");
  }
  std::stable_sort(out.ranked.begin(), out.ranked.end(),
                   [](const PlanCandidate& a, const PlanCandidate& b) {
                     if (a.sim.layer_s != b.sim.layer_s) return a.sim.layer_s < b.sim.layer_s;
                     return a.max_inter_bytes_per_rank < b.max_inter_bytes_per_rank;
                   });
  out.explanation = ExplainWinner(out.ranked);
  return out;
}

std::string ExplainWinner(const std::vector<PlanCandidate>& ranked) {
  if (ranked.empty()) return "";
  const PlanCandidate& w = ranked[0];
  std::ostringstream os;
  os << w.Name() << " wins: " << Ms(w.sim.layer_s) << " per attention layer, " << Ms(w.step.step_s)
     << " per step. Its critical path: " << w.sim.critical_path.Describe() << ". It overlaps "
     << Pct(w.hidden_comm_fraction())
     << " of its communication time with compute (exposed communication "
     << Ms(w.sim.mean_exposed_comm_s()) << " per rank)";
  if (w.sim.inter_busy_s > 0) {
    os << "; inter-machine links move data for " << Ms(w.sim.inter_busy_s) << " of the layer";
  }
  os << ".";
  // Best candidate of each other strategy (ranked is sorted, so the first seen is the best).
  std::map<std::string, const PlanCandidate*> best;
  // Keyed by name: the comparisons follow in the names' alphabetical order.
  for (const PlanCandidate& c : ranked) {
    best.try_emplace(std::string(StrategyName(c.config.strategy)), &c);
  }
  for (const auto& [name, c] : best) {
    if (c->config.strategy == w.config.strategy) continue;
    os << "\n  vs best " << name << " (" << c->Name() << ", " << Ms(c->sim.layer_s) << "): " << name
       << " is " << Ratio(c->sim.layer_s / w.sim.layer_s) << " slower";
    double wb = double(w.max_inter_bytes_per_rank), cb = double(c->max_inter_bytes_per_rank);
    if (cb > 0 && wb > 0 && std::abs(cb / wb - 1) > 0.05) {
      os << "; moves " << Ratio(cb >= wb ? cb / wb : wb / cb) << (cb >= wb ? " more" : " fewer")
         << " bytes per rank over the inter-machine network (" << Bytes(cb) << " vs " << Bytes(wb)
         << ")";
    } else if (cb > 0 && wb == 0) {
      os << "; sends " << Bytes(cb) << " per rank across machines, the winner none";
    }
    os << "; hides " << Pct(c->hidden_comm_fraction()) << " of its communication (exposed "
       << Ms(c->sim.mean_exposed_comm_s()) << " per rank)";
  }
  // The same configuration with each other transport that was enumerated.
  for (const PlanCandidate& c : ranked) {
    const SpConfig& a = c.config;
    const SpConfig& b = w.config;
    if (a.strategy == b.strategy && a.ulysses_degree == b.ulysses_degree &&
        a.ring_degree == b.ring_degree && a.torus_chunks == b.torus_chunks &&
        a.ulysses_chunks == b.ulysses_chunks &&
        (a.one_sided != b.one_sided || a.one_sided_inter != b.one_sided_inter)) {
      os << "\n  the same with " << TransportDescription(a) << " transport: " << Ms(c.sim.layer_s)
         << " ("
         << (c.sim.layer_s >= w.sim.layer_s ? Ratio(c.sim.layer_s / w.sim.layer_s) + " slower"
                                            : Ratio(w.sim.layer_s / c.sim.layer_s) + " faster")
         << ")";
    }
  }
  return os.str();
}

nlohmann::json PlanCandidateJson(const PlanCandidate& c) {
  nlohmann::json j;
  j["name"] = c.Name();
  j["strategy"] = std::string(StrategyName(c.config.strategy));
  j["ulysses_degree"] = c.config.ulysses_degree;
  j["ring_degree"] = c.config.ring_degree;
  j["torus_chunks"] = c.config.torus_chunks;
  j["ulysses_chunks"] = c.config.ulysses_chunks;
  j["one_sided"] = c.config.one_sided;
  j["one_sided_inter"] = c.config.one_sided_inter;
  j["transport"] = TransportName(c.config);
  j["comm_sms"] = c.config.comm_sms;
  j["predicted_layer_s"] = c.sim.layer_s;
  j["predicted_step_s"] = c.step.step_s;
  j["linear_layer_s"] = c.step.linear_layer_s;
  j["max_inter_bytes_per_rank"] = c.max_inter_bytes_per_rank;
  j["max_intra_bytes_per_rank"] = c.max_intra_bytes_per_rank;
  j["max_work_bytes_per_rank"] = c.max_work_bytes_per_rank;
  j["inter_busy_s"] = c.sim.inter_busy_s;
  j["hidden_comm_fraction"] = c.hidden_comm_fraction();
  nlohmann::json b;
  b["mean_compute_s"] = c.sim.mean_compute_s();
  b["mean_exposed_comm_s"] = c.sim.mean_exposed_comm_s();
  b["mean_idle_s"] = c.sim.mean_idle_s();
  b["mean_comm_active_s"] = c.sim.mean_comm_active_s();
  nlohmann::json per_rank = nlohmann::json::array();
  for (size_t r = 0; r < c.sim.ranks.size(); ++r) {
    const sp::RankBreakdown& x = c.sim.ranks[r];
    per_rank.push_back({{"rank", r},
                        {"end_s", x.end_s},
                        {"compute_s", x.compute_s},
                        {"exposed_comm_s", x.exposed_comm_s},
                        {"idle_s", x.idle_s},
                        {"comm_active_s", x.comm_active_s},
                        {"attention_s", x.attention_s},
                        {"sent_intra_bytes", x.sent_intra_bytes},
                        {"sent_inter_bytes", x.sent_inter_bytes}});
  }
  b["per_rank"] = per_rank;
  j["breakdown"] = b;
  const sp::CriticalPath& cp = c.sim.critical_path;
  j["critical_path"] = {{"attention_s", cp.attention_s},
                        {"memory_s", cp.memory_s},
                        {"intra_transfer_s", cp.intra_transfer_s},
                        {"inter_transfer_s", cp.inter_transfer_s},
                        {"signal_s", cp.signal_s},
                        {"ops", cp.ops},
                        {"summary", cp.Describe()}};
  return j;
}

}  // namespace ditscale::sp
