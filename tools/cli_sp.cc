// `ditscale sp plan` and `ditscale sp simulate`: the SwiftFusion planner and simulator.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/sp/planner.h"
#include "ditscale/sp/simulator.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/sp/topology.h"
#include "ditscale/sp/workload.h"
#include "tools/cli.h"
#include "tools/cli_options.h"

namespace ditscale::cli {
namespace {

// Numeric options with their ranges (tools/cli_options.h). A size option left out takes the
// cluster's / model's default (the 0 below); a given value must lie in its range.
struct CommonArgs {
  std::string cluster = "p4de";
  int machines = 1;
  int gpus_per_machine = 0;  // absent: the cluster's
  std::string model = "flux";
  int height = 0, width = 0, frames = 0, batch = 1;  // 0 (absent): the model's
  double duration_s = 0;                             // 0 (absent): the model's
  bool json = false;
};

void AddCommon(CLI::App* cmd, CommonArgs* a) {
  cmd->add_option("--cluster", a->cluster, "p4de | h100-8x | h200-local | FILE.json")
      ->capture_default_str();
  AddNumber(cmd, "--machines", &a->machines, 1, sp::kMaxMachines, "number of machines");
  AddNumber(cmd, "--gpus-per-machine", &a->gpus_per_machine, 1, sp::kMaxGpusPerMachine,
            "GPUs per machine (absent: the cluster's; machines x GPUs <= " +
                std::to_string(sp::kMaxRanks) + ")")
      ->default_str("");
  cmd->add_option("--model", a->model,
                  "flux | cogvideox-5b | cogvideox-2b | wan2.1-14b | hunyuanvideo")
      ->capture_default_str();
  AddNumber(cmd, "--height", &a->height, 16, sp::kMaxImageSide,
            "image/video height in pixels, a multiple of 16 (absent: the model's)")
      ->default_str("");
  AddNumber(cmd, "--width", &a->width, 16, sp::kMaxImageSide,
            "image/video width in pixels, a multiple of 16 (absent: the model's)")
      ->default_str("");
  AddNumber(cmd, "--duration-s", &a->duration_s, 1e-3, sp::kMaxDurationS,
            "video duration in seconds (video models; absent: the model's)")
      ->default_str("");
  AddNumber(cmd, "--frames", &a->frames, 1, sp::kMaxFrames,
            "video frames, overrides --duration-s (video models; absent: the model's)")
      ->default_str("");
  AddNumber(cmd, "--batch", &a->batch, 1, sp::kMaxBatch, "batch size");
  cmd->add_flag("--json", a->json, "print JSON instead of a table");
}

// The option a library failure's field belongs to, else "".
std::string OptionOf(const std::string& column) {
  static const std::vector<std::pair<std::string, std::string>> map = {
      {"machines", "--machines"},
      {"gpus_per_machine", "--gpus-per-machine"},
      {"height", "--height"},
      {"width", "--width"},
      {"frames", "--frames"},
      {"duration_s", "--duration-s"},
      {"batch", "--batch"},
      {"torus_chunks", "--chunks"},
      {"ulysses_chunks", "--ulysses-chunks"},
      {"ulysses_degree", "--ulysses"},
      {"ring_degree", "--ring"},
      {"comm_sms", "--comm-sms"},
      {"model", "--model"},
      {"cluster", "--cluster"},
      {"strategy", "--strategy"},
      {"strategies", "--strategies"},
  };
  for (const auto& [c, o] : map) {
    if (c == column) return o;
  }
  return "";
}

// The value, or throws an Error prefixed with the option the failure is about ("--height: 1000
// is not a multiple of 16"), or with `what` when it is about no option (a file, a plan). A
// failure naming a file is about that file's field, not an option, unless `options_over_file`
// (a configuration checked against the cluster: "--comm-sms: p4de: ... no SM partitions").
template <typename T>
T OrThrow(Result<T> r, const std::string& what, bool options_over_file = false) {
  if (r.ok()) return std::move(r).ValueOrThrow();
  const Failure& f = r.failure();
  const std::string option = f.file.empty() || options_over_file ? OptionOf(f.column) : "";
  if (!option.empty()) {
    throw Error(option + ": " + (f.file.empty() ? "" : f.file + ": ") + f.message);
  }
  throw Error(what + ": " + f.ToString());
}

// The options that set the sequence length, as given ("--height 16384, --width 16384, --frames
// 61"; --duration-s only without --frames, which overrides it), or "--model M (its default
// size)" when none was given.
std::string SizeOptions(const CommonArgs& a) {
  std::string s;
  auto add = [&](const char* name, const std::string& v) {
    s += (s.empty() ? "" : ", ") + std::string(name) + " " + v;
  };
  if (a.height > 0) add("--height", std::to_string(a.height));
  if (a.width > 0) add("--width", std::to_string(a.width));
  if (a.frames > 0) add("--frames", std::to_string(a.frames));
  if (a.frames == 0 && a.duration_s > 0) add("--duration-s", FormatNumber(a.duration_s));
  return s.empty() ? "--model " + a.model + " (its default size)" : s;
}

sp::Topology LoadCluster(const CommonArgs& a) {
  return OrThrow(sp::LoadTopology(a.cluster, a.machines, a.gpus_per_machine), "--cluster");
}

sp::Workload LoadWorkload(const CommonArgs& a) {
  sp::WorkloadOptions o;
  o.height = a.height;
  o.width = a.width;
  o.duration_s = a.duration_s;
  o.frames = a.frames;
  o.batch = a.batch;
  Result<sp::Workload> w = sp::MakeWorkload(a.model, o);
  // Over kMaxTokens: MakeWorkload names the field "frames" (video) or "height" (image) whichever
  // options were given; the error names the size options that were.
  if (!w.ok() && (w.failure().column == "frames" || w.failure().column == "height") &&
      w.failure().message.find("exceed the limit of") != std::string::npos) {
    throw Error(SizeOptions(a) + ": " + w.failure().message);
  }
  return OrThrow(std::move(w), "--model");
}

// The schedule limits on the sequence that hold for every configuration of the mesh (each has
// U x R = all ranks): at least one image token per rank, and ranks x (S + T) <= kMaxRankTokens
// (strategies.h). Checked here so that `sp simulate` and `sp plan` report them against the
// options that made the sequence, with the value and the limit, instead of as "column
// 'seq_tokens'" of each candidate.
void CheckSequenceFits(const CommonArgs& a, const sp::Topology& t, const sp::Workload& w) {
  const int64_t n = t.world_size();
  const std::string ranks =
      fmt::format("{} ranks ({} x {} GPUs)", n, t.machines, t.gpus_per_machine);
  if (w.tokens < n) {
    throw Error(
        fmt::format("{}: S = {} image tokens, fewer than the {}: each rank needs at least one",
                    SizeOptions(a), w.tokens, ranks));
  }
  const int64_t limit = sp::kMaxRankTokens / n;
  if (w.tokens + w.text_tokens > limit) {
    throw Error(fmt::format(
        "{}: {} tokens ({} image + {} text) on {} exceed the schedule limit of {} tokens on {} "
        "ranks ({} rank-tokens)",
        SizeOptions(a), w.tokens + w.text_tokens, w.tokens, w.text_tokens, ranks, limit, n,
        sp::kMaxRankTokens));
  }
}

// --ulysses / --ring against the mesh: U x R must be its rank count (0 = the strategy's default).
void CheckDegrees(const sp::Topology& t, const sp::SpConfig& c) {
  const int n = t.world_size();
  const std::string mesh =
      fmt::format("the {} ranks of the mesh ({} x {} GPUs)", n, t.machines, t.gpus_per_machine);
  const std::pair<const char*, int> degrees[] = {{"--ulysses", c.ulysses_degree},
                                                 {"--ring", c.ring_degree}};
  for (const auto& [option, d] : degrees) {
    if (d > 0 && n % d != 0) throw Error(fmt::format("{}: {} does not divide {}", option, d, mesh));
  }
  if (c.ulysses_degree > 0 && c.ring_degree > 0 && c.ulysses_degree * c.ring_degree != n) {
    throw Error(fmt::format("--ulysses {} x --ring {} = {} is not {}", c.ulysses_degree,
                            c.ring_degree, c.ulysses_degree * c.ring_degree, mesh));
  }
}

nlohmann::json ContextJson(const sp::Topology& t, const sp::Workload& w) {
  return {{"cluster", t.name},
          {"machines", t.machines},
          {"gpus_per_machine", t.gpus_per_machine},
          {"workload",
           {{"model", w.model},
            {"batch", w.batch},
            {"tokens", w.tokens},
            {"text_tokens", w.text_tokens},
            {"heads", w.heads},
            {"head_dim", w.head_dim},
            {"layers", w.layers}}}};
}

// `name_width`: the configuration column, as wide as the longest name shown (the mixed transport
// "one-sided intra / two-sided inter" makes names long).
std::string Row(int rank, const sp::PlanCandidate& c, double ref_layer_s, int name_width) {
  return fmt::format(
      "{:>3}  {:<{}} {:>9.2f} {:>9.3f} {:>8.2f} {:>7.0f}% {:>10.1f} {:>9.2f} {:>8}", rank, c.Name(),
      name_width, c.sim.layer_s * 1e3, c.step.step_s, c.sim.mean_exposed_comm_s() * 1e3,
      100 * c.hidden_comm_fraction(), c.max_inter_bytes_per_rank / 1e6,
      c.max_work_bytes_per_rank / 1e9,
      ref_layer_s > 0 ? fmt::format("{:.2f}x", ref_layer_s / c.sim.layer_s) : std::string("n/a"));
}

std::string Header(const char* ref, int name_width) {
  return fmt::format("{:>3}  {:<{}} {:>9} {:>9} {:>8} {:>8} {:>10} {:>9} {:>8}\n", "#",
                     "configuration", name_width, "layer ms", "step s", "exp. ms", "hidden",
                     "inter MB/r", "work GB/r", ref);
}

void RunPlan(const CommonArgs& a, int top, const std::vector<std::string>& strategies,
             const std::vector<int>& chunks, const std::vector<int>& ulysses_chunks,
             double mem_limit_gib, const std::vector<std::string>& transports,
             bool no_sm_partitions) {
  sp::Topology topo = LoadCluster(a);
  sp::Workload wl = LoadWorkload(a);
  CheckSequenceFits(a, topo, wl);
  sp::PlanOptions opt;
  for (const std::string& s : strategies) {
    Result<sp::Strategy> parsed = sp::ParseStrategy(s);
    if (!parsed.ok()) throw Error("--strategies: " + parsed.failure().message);
    opt.strategies.push_back(parsed.value());
  }
  opt.sm_partitions = !no_sm_partitions;
  if (!transports.empty()) {
    // Validated by the option's check: nccl, nvshmem, nvshmem-intra.
    auto has = [&](const char* t) {
      return std::find(transports.begin(), transports.end(), t) != transports.end();
    };
    opt.two_sided = has("nccl");
    opt.one_sided = has("nvshmem");
    opt.one_sided_intra_only = has("nvshmem-intra");
  }
  if (!chunks.empty()) opt.torus_chunks = chunks;
  if (!ulysses_chunks.empty()) opt.ulysses_chunks = ulysses_chunks;
  if (mem_limit_gib > 0) opt.max_work_bytes_per_rank = static_cast<int64_t>(mem_limit_gib * 1e9);
  Result<sp::PlanResult> planned = sp::Plan(topo, wl, opt);
  if (!planned.ok() && planned.failure().column == "strategy") {
    // "no feasible configuration: ...": about no option (--strategies was parsed above).
    throw Error("plan: " + planned.failure().message);
  }
  sp::PlanResult plan = OrThrow(std::move(planned), "plan");
  // Baseline: the best USP; with one GPU per machine USP is a plain ring (not enumerated
  // twice), so the best ring stands in for it.
  double best_usp = 0;
  const char* ref_name = "vs usp";
  for (const char* base : {"usp", "ring"}) {
    for (const auto& c : plan.ranked) {
      if (sp::StrategyName(c.config.strategy) == base) {
        best_usp = c.sim.layer_s;
        break;
      }
    }
    if (best_usp > 0) break;
    ref_name = "vs ring";
  }
  int shown = top > 0 ? std::min<int>(top, int(plan.ranked.size())) : int(plan.ranked.size());
  if (a.json) {
    nlohmann::json j = ContextJson(topo, wl);
    j["candidates"] = nlohmann::json::array();
    for (int i = 0; i < shown; ++i) {
      nlohmann::json c = sp::PlanCandidateJson(plan.ranked[i]);
      c["rank"] = i + 1;
      if (best_usp > 0) c["speedup_vs_best_usp"] = best_usp / plan.ranked[i].sim.layer_s;
      j["candidates"].push_back(c);
    }
    j["speedup_baseline"] = ref_name + 3;  // "usp" or "ring" (one GPU per machine)
    j["evaluated"] = plan.ranked.size();
    j["skipped"] = plan.skipped;
    j["explanation"] = plan.explanation;
    fmt::print("{}\n", j.dump(1));
    return;
  }
  fmt::print("cluster {} ({} x {} GPUs), {}\n", topo.name, topo.machines, topo.gpus_per_machine,
             wl.Describe());
  int width = 38;
  for (int i = 0; i < shown; ++i) width = std::max<int>(width, plan.ranked[i].Name().size());
  fmt::print("{}", Header(ref_name, width));
  for (int i = 0; i < shown; ++i) {
    fmt::print("{}\n", Row(i + 1, plan.ranked[i], best_usp, width));
  }
  fmt::print("({} configurations simulated, {} skipped)\n\n{}\n", plan.ranked.size(),
             plan.skipped.size(), plan.explanation);
  for (const auto& s : plan.skipped) fmt::print("skipped: {}\n", s);
}

void RunSimulate(const CommonArgs& a, sp::SpConfig cfg) {
  sp::Topology topo = LoadCluster(a);
  sp::Workload wl = LoadWorkload(a);
  CheckSequenceFits(a, topo, wl);
  CheckDegrees(topo, cfg);
  sp::PlanCandidate c = OrThrow(sp::EvaluateConfig(topo, wl, cfg), "simulate", true);
  if (a.json) {
    nlohmann::json j = ContextJson(topo, wl);
    j.update(sp::PlanCandidateJson(c));
    fmt::print("{}\n", j.dump(1));
    return;
  }
  fmt::print("cluster {} ({} x {} GPUs), {}\n", topo.name, topo.machines, topo.gpus_per_machine,
             wl.Describe());
  fmt::print(
      "{}: predicted attention layer {:.3f} ms, linear layers {:.3f} ms per layer per "
      "rank, step {:.3f} s ({} layers)\n",
      c.Name(), c.sim.layer_s * 1e3, c.step.linear_layer_s * 1e3, c.step.step_s, wl.layers);
  fmt::print(
      "mean per rank: compute {:.3f} ms, exposed communication {:.3f} ms, idle {:.3f} ms;"
      " communication active {:.3f} ms ({:.0f}% hidden)\n",
      c.sim.mean_compute_s() * 1e3, c.sim.mean_exposed_comm_s() * 1e3, c.sim.mean_idle_s() * 1e3,
      c.sim.mean_comm_active_s() * 1e3, 100 * c.hidden_comm_fraction());
  fmt::print(
      "bytes per rank (max): inter-machine {:.1f} MB, intra-machine {:.1f} MB; "
      "inter-machine links busy {:.3f} ms\n",
      c.max_inter_bytes_per_rank / 1e6, c.max_intra_bytes_per_rank / 1e6, c.sim.inter_busy_s * 1e3);
  fmt::print("critical path: {}\n", c.sim.critical_path.Describe());
  fmt::print("{:>5} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "rank", "end ms", "compute", "exposed",
             "idle", "inter MB");
  for (size_t r = 0; r < c.sim.ranks.size(); ++r) {
    const sp::RankBreakdown& x = c.sim.ranks[r];
    fmt::print("{:>5} {:>10.3f} {:>10.3f} {:>10.3f} {:>10.3f} {:>12.1f}\n", r, x.end_s * 1e3,
               x.compute_s * 1e3, x.exposed_comm_s * 1e3, x.idle_s * 1e3, x.sent_inter_bytes / 1e6);
  }
}

}  // namespace

void RegisterSpCommands(CLI::App& app) {
  CLI::App* sp = app.add_subcommand("sp", "SwiftFusion sequence-parallel planning and simulation");
  sp->require_subcommand(1);

  auto plan_args = std::make_shared<CommonArgs>();
  auto top = std::make_shared<int>(10);
  auto strategies = std::make_shared<std::vector<std::string>>();
  auto chunks = std::make_shared<std::vector<int>>();
  auto ulysses_chunks = std::make_shared<std::vector<int>>();
  CLI::App* plan = sp->add_subcommand("plan", "rank every feasible strategy, degree and chunking");
  AddCommon(plan, plan_args.get());
  AddNumber(plan, "--top", top.get(), 0, 1 << 20, "show the K fastest (0 = all)");
  plan->add_option("--strategies", *strategies, "restrict to these strategies")
      ->delimiter(',')
      ->expected(1, sp::kMaxPlanListSize);
  AddNumberList(plan, "--chunks", chunks.get(), 1, sp::kMaxTorusChunks,
                "torus chunk counts to try (default 1,2,4,8; at most " +
                    std::to_string(sp::kMaxPlanListSize) + " values)")
      ->expected(1, sp::kMaxPlanListSize);
  AddNumberList(plan, "--ulysses-chunks", ulysses_chunks.get(), 1, sp::kMaxUlyssesChunks,
                "ulysses head chunk counts to try (default 1: plain ulysses; at most " +
                    std::to_string(sp::kMaxPlanListSize) + " values)")
      ->expected(1, sp::kMaxPlanListSize);
  auto mem_limit = std::make_shared<double>(0);
  AddNumber(plan, "--mem-limit-gb", mem_limit.get(), 0.0, 1e6,
            "skip configurations needing more work memory per rank (GB; 0 = no limit)");
  auto transports = std::make_shared<std::vector<std::string>>();
  plan->add_option("--transports", *transports,
                   "transports to try: nccl, nvshmem (puts on every link), nvshmem-intra (puts "
                   "within machines, NCCL between them); default all")
      ->delimiter(',')
      ->check(CLI::IsMember({"nccl", "nvshmem", "nvshmem-intra"}));
  auto no_partitions = std::make_shared<bool>(false);
  plan->add_flag("--no-sm-partitions", *no_partitions,
                 "leave out the configurations that keep SMs free for communication (comm_sms)");
  plan->callback([=] {
    RunPlan(*plan_args, *top, *strategies, *chunks, *ulysses_chunks, *mem_limit, *transports,
            *no_partitions);
  });

  auto sim_args = std::make_shared<CommonArgs>();
  auto cfg = std::make_shared<sp::SpConfig>();
  CLI::App* sim = sp->add_subcommand("simulate", "predict one configuration with its breakdown");
  AddCommon(sim, sim_args.get());
  auto strategy = std::make_shared<std::string>();
  sim->add_option("--strategy", *strategy,
                  "ulysses | ulysses-overlap | ring | usp | swiftfusion-tas | torus")
      ->required();
  AddNumber(sim, "--ulysses", &cfg->ulysses_degree, 0, sp::kMaxRanks,
            "Ulysses degree U (0 = the strategy's default)");
  AddNumber(sim, "--ring", &cfg->ring_degree, 0, sp::kMaxRanks,
            "Ring degree R (0 = the strategy's default)");
  AddNumber(sim, "--chunks", &cfg->torus_chunks, 1, sp::kMaxTorusChunks,
            "torus token chunks (ulysses head chunks: --ulysses-chunks)");
  AddNumber(sim, "--ulysses-chunks", &cfg->ulysses_chunks, 1, sp::kMaxUlyssesChunks,
            "ulysses head chunks, each chunk's all-to-all pipelined with the attention of the "
            "chunk before (at most the kv heads per Ulysses rank)");
  sim->add_flag("--one-sided", cfg->one_sided, "one-sided (NVSHMEM put/signal) transport");
  AddNumber(sim, "--comm-sms", &cfg->comm_sms, 0, 65536,
            "SMs kept free of the compute stream for communication kernels (a CUDA green "
            "context; 0 = the whole GPU computes)");
  auto transport = std::make_shared<std::string>();
  sim->add_option("--transport", *transport,
                  "nccl | nvshmem | nvshmem-intra (puts within machines, NCCL between them); "
                  "overrides --one-sided")
      ->check(CLI::IsMember({"nccl", "nvshmem", "nvshmem-intra"}));
  sim->callback([=] {
    sp::SpConfig c = *cfg;
    Result<sp::Strategy> parsed = sp::ParseStrategy(*strategy);
    if (!parsed.ok()) throw Error("--strategy: " + parsed.failure().message);
    c.strategy = parsed.value();
    if (c.strategy == sp::Strategy::kUlysses && c.torus_chunks > 1) {
      throw Error(fmt::format(
          "--chunks: {} token chunks are torus's; ulysses head chunks: --ulysses-chunks {}",
          c.torus_chunks, c.torus_chunks));
    }
    if (!transport->empty()) sp::SetTransport(*transport, &c);
    RunSimulate(*sim_args, c);
  });
}

}  // namespace ditscale::cli
