// `ditscale plan`: manifest -> shapes -> policy -> plan -> simulated metrics (and files).
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/fit.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/report.h"
#include "ditscale/balance/shaped_reader.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/core/error.h"
#include "ditscale/core/progress.h"
#include "ditscale/core/range.h"
#include "tools/cli.h"
#include "tools/cli_options.h"
#include "tools/write_file.h"

namespace ditscale::cli {
namespace {

using namespace ditscale::balance;  // NOLINT

struct PlanArgs {
  std::string manifest, model, cost_file, bench_file, policy = "balanced", tail = "drop";
  std::string out, emit_batches, report;
  int world_size = 1;
  double gpu_mem_gib = 141, mem_safety = 0.1, m_comp = 0, budget = 0, noise = 0;
  int64_t m_mem = 0, epoch = 0;
  uint64_t seed = 0;
  bool compare = false, json = false, skip_bad_rows = false, budget_sweep = false;
  bool overhead_per_mb = false, quiet = false;
};

// Process CPU seconds (all threads): robust to a loaded machine.
double CpuSeconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

// CPU seconds of the calling thread (the policies of --compare run on two threads).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) throw Error(r.failure().ToString());
  return std::move(r).value();
}

struct PolicyRun {
  Plan plan;
  SimResult sim;
  double plan_s = 0, sim_s = 0, plan_cpu_s = 0;
};

// Mean micro-batches (forward/backward passes) per rank and step: each costs a_mb.
double MicroBatchesPerRankStep(const SimResult& s) {
  const double cells = static_cast<double>(s.num_steps) * s.world_size;
  return cells > 0 ? static_cast<double>(s.micro_batches) / cells : 0;
}

// Dropped samples / samples of the epoch (trained + dropped).
double DroppedFraction(const SimResult& s) {
  const double all = static_cast<double>(s.samples + s.dropped_samples);
  return all > 0 ? static_cast<double>(s.dropped_samples) / all : 0;
}

nlohmann::json PolicyJson(const PolicyRun& r) {
  const SimResult& s = r.sim;
  return {{"compute_cv", s.compute_cv},
          {"bubble_fraction", s.bubble_fraction},
          {"tokens_per_s_per_gpu", s.tokens_per_s_per_gpu},
          {"epoch_time_s", s.epoch_time_s},
          {"lower_bound_s", s.lower_bound_s},
          {"epoch_over_lower_bound", s.lower_bound_s > 0 ? s.epoch_time_s / s.lower_bound_s : 0},
          {"step_time_cv", s.step_time_cv},
          {"num_steps", s.num_steps},
          {"dropped_samples", s.dropped_samples},
          {"dropped_fraction", DroppedFraction(s)},
          {"rank_budget_raised", r.plan.rank_budget_raised},
          {"padded_micro_batches", s.padded_micro_batches},
          {"micro_batches", s.micro_batches},
          {"micro_batches_per_rank_step", MicroBatchesPerRankStep(s)},
          {"samples", s.samples},
          {"tokens", s.tokens},
          {"mean_samples_per_step", s.mean_samples_per_step},
          {"m_comp", r.plan.m_comp},
          {"p", r.plan.p},
          {"m_mem_tokens", r.plan.m_mem_tokens},
          {"rank_budget_s", r.plan.rank_budget_s},
          {"samples_over_m_mem", r.plan.samples_over_m_mem},
          {"plan_time_s", r.plan_s},
          {"plan_cpu_s", r.plan_cpu_s},
          {"simulate_time_s", r.sim_s}};
}

// One JSON line per (step, rank), written through a large buffer.
void EmitBatches(const std::string& path, const Plan& plan, const SimResult& sim) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw Error("cannot open " + path + " for writing: " + std::strerror(errno));
  std::vector<char> buf(1 << 20);
  std::setvbuf(f, buf.data(), _IOFBF, buf.size());
  const int64_t w = plan.world_size;
  for (int64_t k = 0; k < plan.num_steps(); ++k) {
    for (int64_t r = 0; r < w; ++r) {
      std::fprintf(f, "{\"step\":%lld,\"rank\":%lld,\"micro_batches\":[", static_cast<long long>(k),
                   static_cast<long long>(r));
      for (int64_t i = plan.rank_offsets[k * w + r]; i < plan.rank_offsets[k * w + r + 1]; ++i) {
        const MicroBatch& mb = plan.micro_batches[plan.work[i]];
        std::fputs(i == plan.rank_offsets[k * w + r] ? "[" : ",[", f);
        for (int64_t j = mb.begin; j < mb.end; ++j) {
          std::fprintf(f, j == mb.begin ? "%lld" : ",%lld", static_cast<long long>(plan.ids[j]));
        }
        std::fputc(']', f);
      }
      std::fprintf(f, "],\"predicted_cost_s\":%.9g}\n", sim.rank_cost_s[k * w + r]);
    }
  }
  CloseChecked(f, path);
}

void PrintTable(const std::vector<Policy>& policies, const std::vector<PolicyRun>& runs) {
  std::printf("%-12s %12s %10s %12s %12s %8s %10s %8s %9s %8s\n", "policy", "tok/s/GPU", "CV",
              "epoch (s)", "lower bd (s)", "ep/lb", "bubble", "steps", "dropped", "mb/rank");
  for (size_t i = 0; i < runs.size(); ++i) {
    const SimResult& s = runs[i].sim;
    std::printf("%-12s %12.1f %9.2f%% %12.1f %12.1f %8.4f %9.2f%% %8lld %9lld %8.2f\n",
                PolicyName(policies[i]), s.tokens_per_s_per_gpu, 100 * s.compute_cv, s.epoch_time_s,
                s.lower_bound_s, s.lower_bound_s > 0 ? s.epoch_time_s / s.lower_bound_s : 0,
                100 * s.bubble_fraction, static_cast<long long>(s.num_steps),
                static_cast<long long>(s.dropped_samples), MicroBatchesPerRankStep(s));
  }
}

void RunPlan(const PlanArgs& a) {
  const auto t_start = std::chrono::steady_clock::now();
  if (!a.cost_file.empty() && !a.bench_file.empty()) {
    throw Error("give at most one of --cost and --bench");
  }
  const Policy main_policy = Unwrap(ParsePolicy(a.policy));
  const TailPolicy tail = Unwrap(ParseTailPolicy(a.tail));
  const bool progress = !a.quiet && Progress::DefaultEnabled();

  const ModelPreset model = Unwrap(ResolveModel(a.model));
  CostModel cost;
  MemoryModel memory = AnalyticalMemory(model);
  nlohmann::json fit_json;
  if (!a.cost_file.empty()) {
    MemoryModel m;
    m.m1 = -1;
    cost = Unwrap(LoadCostModel(a.cost_file, &m));
    if (m.m1 > 0) memory = m;
  } else if (!a.bench_file.empty()) {
    const BenchTable table = Unwrap(ReadBenchCsv(a.bench_file));
    const FitResult fit = Unwrap(FitBench(table));
    if (auto why = FitProblem(fit)) throw Error(a.bench_file + ": unusable fit: " + *why);
    cost = fit.best().model;
    if (fit.memory) memory = fit.memory->model;
    fit_json = {{"chosen", cost.kind == CostModel::Kind::kPower ? "power" : "quadratic"},
                {"r2", fit.best().quality.r2},
                {"reason", fit.choice_reason}};
  } else {
    cost = AnalyticalCost(model);
  }
  // --overhead-per-micro-batch: the conservative accounting, a_mb := a + a_mb, a := 0, applied to
  // the cost model itself so the planner, the simulator, --json and the report all see it.
  if (a.overhead_per_mb) {
    cost = OverheadPerMicroBatch(cost);
    cost.source += " (overhead per micro-batch)";
  }
  int64_t m_mem = a.m_mem;
  if (m_mem <= 0) {
    m_mem = memory.MaxTokens(a.gpu_mem_gib * 1024.0 * 1024.0 * 1024.0, a.mem_safety);
    if (m_mem < 1) {
      throw Error("the memory model leaves no room for activations on a " +
                  FormatNumber(a.gpu_mem_gib) + " GiB GPU (m0 = " + FormatNumber(memory.m0) +
                  " bytes); raise --gpu-mem-gib or give --m-mem");
    }
    if (m_mem > kMaxMMemTokens) {
      throw Error("the memory model (m1 = " + FormatNumber(memory.m1) +
                  " bytes per token) gives M_mem = " + FormatNumber(static_cast<long long>(m_mem)) +
                  " tokens, above the limit " +
                  FormatNumber(static_cast<long long>(kMaxMMemTokens)) +
                  "; check the memory model or give --m-mem");
    }
  }

  auto t0 = std::chrono::steady_clock::now();
  ManifestOptions mo;
  mo.skip_bad_rows = a.skip_bad_rows;
  Manifest manifest;  // the counts only: a CSV file's rows are mapped to shapes while parsed
  const double c0 = CpuSeconds();
  ShapedManifest shaped = Unwrap(ReadShapedManifest(a.manifest, model, mo, &manifest));
  // Reading and shaping are one step (shaped_reader.h): "parse" times both, "shape" is 0.
  const double parse_s = Seconds(t0), parse_cpu_s = CpuSeconds() - c0;
  const double shape_s = 0, shape_cpu_s = 0;
  const auto num_samples = static_cast<int64_t>(shaped.shape_of.size());
  if (manifest.rows_skipped > 0 && !a.json) {
    std::fprintf(stderr, "skipped %lld bad rows of %lld, e.g. %s\n",
                 static_cast<long long>(manifest.rows_skipped),
                 static_cast<long long>(manifest.rows_total),
                 manifest.skipped_examples.empty() ? "" : manifest.skipped_examples[0].c_str());
  }

  PlanOptions po;
  po.world_size = a.world_size;
  po.seed = a.seed;
  po.epoch = a.epoch;
  po.m_mem_tokens = m_mem;
  po.m_comp = a.m_comp;
  po.rank_budget_s = a.budget;
  po.tail = tail;
  SimOptions so;
  so.noise_sigma = a.noise;
  so.noise_seed = a.seed;
  so.keep_rank_costs = true;

  std::vector<Policy> policies;
  if (a.compare) {
    policies = {Policy::kEqualToken, Policy::kAdaptive, Policy::kBalanced};
  } else {
    policies = {main_policy};
  }
  // M_comp is chosen once (adaptive's search) and shared by adaptive and balanced.
  double mcomp_s = 0;
  if (po.m_comp <= 0) {
    t0 = std::chrono::steady_clock::now();
    po.m_comp = ChooseMComp(shaped, cost, po, PlanExponent(shaped, cost)).m_comp;
    mcomp_s = Seconds(t0);
  }
  std::vector<PolicyRun> runs(policies.size());
  auto run_policy = [&](size_t i) {
    PlanOptions opt = po;
    opt.policy = policies[i];
    auto t = std::chrono::steady_clock::now();
    const double c0 = ThreadCpuSeconds();
    runs[i].plan = Unwrap(MakePlan(shaped, cost, opt));
    runs[i].plan_s = Seconds(t);
    runs[i].plan_cpu_s = ThreadCpuSeconds() - c0;
    t = std::chrono::steady_clock::now();
    runs[i].sim = Simulate(runs[i].plan, shaped, cost, so);
    runs[i].sim_s = Seconds(t);
    const bool keep_plan =
        policies[i] == main_policy && (!a.emit_batches.empty() || !a.out.empty());
    if (!keep_plan) {
      Plan light;  // keep the summary fields, free the big arrays
      light.policy = runs[i].plan.policy;
      light.m_comp = runs[i].plan.m_comp;
      light.p = runs[i].plan.p;
      light.m_mem_tokens = runs[i].plan.m_mem_tokens;
      light.rank_budget_s = runs[i].plan.rank_budget_s;
      light.samples_over_m_mem = runs[i].plan.samples_over_m_mem;
      light.rank_budget_raised = runs[i].plan.rank_budget_raised;
      light.batch_size_of_shape = runs[i].plan.batch_size_of_shape;
      runs[i].plan = std::move(light);
    }
  };
  {
    Progress bar("plan", static_cast<int64_t>(policies.size()), progress);
    // The policies are independent: with --compare the last one (balanced, the slowest) runs on
    // a second thread while this one runs the others. Plans are deterministic either way.
    std::exception_ptr worker_error;
    std::thread worker;
    size_t local = policies.size();
    if (policies.size() > 1 && std::thread::hardware_concurrency() >= 2) {
      local = policies.size() - 1;
      worker = std::thread([&] {
        try {
          run_policy(policies.size() - 1);
        } catch (...) {
          worker_error = std::current_exception();
        }
      });
    }
    try {
      for (size_t i = 0; i < local; ++i) {
        run_policy(i);
        bar.Update(static_cast<int64_t>(i) + 1);
      }
    } catch (...) {
      if (worker.joinable()) worker.join();
      throw;
    }
    if (worker.joinable()) worker.join();
    if (worker_error) std::rethrow_exception(worker_error);
    bar.Update(static_cast<int64_t>(policies.size()));
  }
  for (size_t i = 0; i < policies.size(); ++i) {
    const SimResult& s = runs[i].sim;
    if (DroppedFraction(s) > kDroppedWarnFraction) {
      std::fprintf(stderr,
                   "warning: policy %s drops %lld of %lld samples (%.1f%%, more than %g%%): the "
                   "last step of tail policy '%s' with %d ranks; use --tail pad or keep, or "
                   "fewer ranks\n",
                   PolicyName(policies[i]), static_cast<long long>(s.dropped_samples),
                   static_cast<long long>(s.samples + s.dropped_samples), 100 * DroppedFraction(s),
                   100 * kDroppedWarnFraction, TailPolicyName(tail), a.world_size);
    }
    if (runs[i].plan.rank_budget_raised && !a.quiet) {
      std::fprintf(stderr,
                   "note: policy %s: the default per-rank budget was raised to %.4g s, the cost "
                   "of the most expensive sample\n",
                   PolicyName(policies[i]), runs[i].plan.rank_budget_s);
    }
  }
  std::vector<BudgetSweepRow> sweep;
  if (a.budget_sweep) {
    PlanOptions bo = po;
    bo.policy = Policy::kBalanced;
    bo.rank_budget_s = 0;
    const double base = DefaultRankBudget(shaped, cost, bo.m_comp, PlanExponent(shaped, cost));
    // Budgets below one most expensive sample are refused by MakePlan: the sweep starts there.
    const double floor_budget = MinRankBudget(shaped, cost);
    // The default budget is already at least one most expensive sample (smaller budgets are
    // raised to it), so the sweep starts there; budgets that end up equal are shown once.
    const double mult[] = {1, 1.5, 2, 3, 4, 6, 8, 16};
    SimOptions quick = so;
    quick.keep_rank_costs = false;
    Progress bar("budget sweep", 8, progress);
    for (int i = 0; i < 8; ++i) {
      bo.rank_budget_s = std::max(base * mult[i], floor_budget);
      const Plan plan = Unwrap(MakePlan(shaped, cost, bo));
      if (!sweep.empty() && plan.rank_budget_s == sweep.back().budget_s) continue;
      const SimResult s = Simulate(plan, shaped, cost, quick);
      sweep.push_back({plan.rank_budget_s, s.compute_cv, s.epoch_time_s, s.lower_bound_s,
                       s.num_steps, s.mean_samples_per_step, s.tokens_per_s_per_gpu});
      bar.Update(i + 1);
    }
  }

  size_t main_idx = 0;
  for (size_t i = 0; i < policies.size(); ++i) {
    if (policies[i] == main_policy) main_idx = i;
  }
  if (!a.emit_batches.empty()) EmitBatches(a.emit_batches, runs[main_idx].plan, runs[main_idx].sim);

  nlohmann::json j;
  j["manifest"] = a.manifest;
  j["model"] = model.name;
  j["cost"] = nlohmann::json::parse(CostModelToJson(cost, &memory));
  j["cost_source"] = cost.source;
  if (!fit_json.is_null()) j["fit"] = fit_json;
  j["world_size"] = a.world_size;
  j["seed"] = a.seed;
  j["epoch"] = a.epoch;
  j["tail"] = TailPolicyName(tail);
  j["overhead_per_micro_batch"] = a.overhead_per_mb;
  j["noise_sigma"] = a.noise;
  j["m_mem_tokens"] = m_mem;
  j["m_comp"] = po.m_comp;
  j["rows_total"] = manifest.rows_total;
  j["samples"] = num_samples;
  j["skipped_rows"] = manifest.rows_skipped;
  j["distinct_shapes"] = static_cast<int64_t>(shaped.shapes.size());
  for (size_t i = 0; i < policies.size(); ++i) {
    j["policies"][PolicyName(policies[i])] = PolicyJson(runs[i]);
  }
  for (const auto& r : sweep) {
    j["budget_sweep"].push_back({{"rank_budget_s", r.budget_s},
                                 {"compute_cv", r.compute_cv},
                                 {"epoch_time_s", r.epoch_time_s},
                                 {"lower_bound_s", r.lower_bound_s},
                                 {"num_steps", r.num_steps},
                                 {"mean_samples_per_step", r.mean_samples_per_step},
                                 {"tokens_per_s_per_gpu", r.tokens_per_s_per_gpu}});
  }
  j["timing_cpu_s"] = {{"parse", parse_cpu_s}, {"shape", shape_cpu_s}, {"total", CpuSeconds()}};
  j["timing_s"] = {{"parse", parse_s},
                   {"shape", shape_s},
                   {"m_comp_search", mcomp_s},
                   {"total", Seconds(t_start)}};

  if (!a.out.empty()) {
    const Plan& p = runs[main_idx].plan;
    nlohmann::json s = PolicyJson(runs[main_idx]);
    s["policy"] = PolicyName(p.policy);
    s["world_size"] = a.world_size;
    s["seed"] = a.seed;
    s["epoch"] = a.epoch;
    s["manifest"] = a.manifest;
    s["model"] = model.name;
    s["cost"] = j["cost"];
    for (size_t sh = 0; sh < shaped.shapes.size(); ++sh) {
      const TrainShape& t = shaped.shapes[sh];
      s["buckets"].push_back({{"frames", t.frames},
                              {"height", t.height},
                              {"width", t.width},
                              {"seq_len", t.seq_len},
                              {"count", sh < shaped.count.size() ? shaped.count[sh] : 0},
                              {"batch_size", p.batch_size_of_shape[sh]}});
    }
    WriteFileChecked(a.out, s.dump(2) + "\n");
  }
  if (!a.report.empty()) {
    ReportInput in;
    in.title = "ditscale plan: " + a.manifest;
    in.settings = {{"manifest", a.manifest},
                   {"model", model.name},
                   {"cost model", cost.source},
                   {"world size", std::to_string(a.world_size)},
                   {"M_mem (tokens)", std::to_string(m_mem)},
                   {"M_comp", std::to_string(po.m_comp)},
                   {"samples", std::to_string(num_samples)},
                   {"skipped rows", std::to_string(manifest.rows_skipped)},
                   {"seed / epoch", std::to_string(a.seed) + " / " + std::to_string(a.epoch)}};
    for (const auto& t : shaped.shapes) in.seq_len_of_shape.push_back(t.seq_len);
    in.count_of_shape = shaped.count;
    for (size_t i = 0; i < policies.size(); ++i) {
      in.policies.push_back({PolicyName(policies[i]), runs[i].sim, runs[i].plan.batch_size_of_shape,
                             runs[i].plan.m_comp, runs[i].plan.p, runs[i].plan.rank_budget_s});
    }
    in.budget_sweep = sweep;
    Unwrap(WriteReportHtml(a.report, in));
  }

  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf("manifest %s: %lld samples (%lld rows, %lld skipped), %zu shapes; model %s\n",
              a.manifest.c_str(), static_cast<long long>(num_samples),
              static_cast<long long>(manifest.rows_total),
              static_cast<long long>(manifest.rows_skipped), shaped.shapes.size(),
              model.name.c_str());
  std::printf("cost %s; M_mem %lld tokens; M_comp %.6g (p = %.3f); %d ranks; tail %s\n",
              cost.source.c_str(), static_cast<long long>(m_mem), po.m_comp, runs[0].plan.p,
              a.world_size, TailPolicyName(tail));
  std::printf("fixed overheads: a %.4g s per step and rank, a_mb %.4g s per micro-batch\n", cost.a,
              cost.a_mb);
  for (size_t i = 0; i < policies.size(); ++i) {
    if (policies[i] == Policy::kBalanced) {
      std::printf("balanced per-rank budget %.4g s\n", runs[i].plan.rank_budget_s);
    }
  }
  PrintTable(policies, runs);
  if (!sweep.empty()) {
    std::printf("\nbalanced budget sweep\n%12s %9s %12s %8s %8s %12s\n", "budget (s)", "CV",
                "epoch (s)", "ep/lb", "steps", "samples/step");
    for (const auto& r : sweep) {
      std::printf("%12.4g %8.2f%% %12.1f %8.4f %8lld %12.1f\n", r.budget_s, 100 * r.compute_cv,
                  r.epoch_time_s, r.lower_bound_s > 0 ? r.epoch_time_s / r.lower_bound_s : 0,
                  static_cast<long long>(r.num_steps), r.mean_samples_per_step);
    }
  }
  std::printf("time: parse %.3f s, shape %.3f s, total %.3f s\n", parse_s, shape_s,
              Seconds(t_start));
}

}  // namespace

void RegisterPlanCommand(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Plan what every data-parallel rank trains on at every step, and simulate it");
  sub->add_option("--manifest", a->manifest, "Manifest (CSV, JSONL or Parquet: .parquet, .pq)")->required();
  sub->add_option("--model", a->model, "Model preset name or JSON model file")->required();
  AddNumber(sub, "--world-size", &a->world_size, 1, kMaxWorldSize, "Data-parallel ranks")
      ->required();
  sub->add_option("--cost", a->cost_file, "Cost model JSON (default: analytical H200 cost)");
  sub->add_option("--bench", a->bench_file, "Shape benchmark CSV to fit the cost model from");
  AddNumber(sub, "--gpu-mem-gib", &a->gpu_mem_gib, 0.001, 1048576.0, "GPU memory for M_mem (GiB)");
  AddNumber(sub, "--mem-safety", &a->mem_safety, 0.0, 0.99,
            "Memory safety margin (fraction of GPU memory kept free)");
  AddNumber<int64_t>(sub, "--m-mem", &a->m_mem, 0, kMaxMMemTokens,
                     "M_mem, tokens per batch (0: from the memory model)");
  AddNumber(sub, "--m-comp", &a->m_comp, 0.0, kMaxMComp,
            "M_comp (0: minimise simulated epoch time)");
  sub->add_option("--policy", a->policy, "equal-token | adaptive | balanced")
      ->capture_default_str();
  sub->add_option("--tail", a->tail, "Last-step tail policy: drop | pad | keep")
      ->capture_default_str();
  AddNumber<uint64_t>(sub, "--seed", &a->seed, 0, std::numeric_limits<uint64_t>::max(),
                      "Shuffle seed");
  AddNumber<int64_t>(sub, "--epoch", &a->epoch, 0, std::numeric_limits<int64_t>::max(), "Epoch");
  AddNumber(sub, "--budget", &a->budget, 0.0, kMaxRankBudgetS,
            "Balanced per-rank budget per step, s (0: default; below the most expensive "
            "sample's cost: an error)");
  sub->add_flag("--budget-sweep", a->budget_sweep,
                "Sweep the balanced per-rank budget (1x..16x the default)");
  AddNumber(sub, "--noise", &a->noise, 0.0, 10.0,
            "Lognormal sigma of simulated per-micro-batch noise");
  sub->add_flag("--overhead-per-micro-batch", a->overhead_per_mb,
                "Charge the whole fixed overhead per micro-batch: a_mb := a + a_mb, a := 0 "
                "(conservative; a fitted a_mb is the accurate way)");
  sub->add_flag("--compare", a->compare, "Run the three policies side by side");
  sub->add_flag("--json", a->json, "Print one JSON object");
  sub->add_option("--out", a->out, "Write the plan summary JSON");
  sub->add_option("--emit-batches", a->emit_batches, "Write one JSON line per (step, rank)");
  sub->add_option("--report", a->report, "Write a self-contained HTML report");
  sub->add_flag("--skip-bad-rows", a->skip_bad_rows, "Skip and count bad manifest rows");
  sub->add_flag("--quiet", a->quiet, "No progress output");
  sub->callback([a] { RunPlan(*a); });
}

}  // namespace ditscale::cli
