// `ditscale plan`: manifest -> shapes -> policy -> plan -> simulated metrics (and files).
#include "tools/cli_plan.h"

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
namespace plan {
namespace {

// CPU seconds of the calling thread (the policies of --compare run on two threads).
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The models of --model and --cost / --bench (at most one of them: RunPlan checks).
Models LoadModels(const PlanArgs& a) {
  Models m{Unwrap(ResolveModel(a.model)), {}, {}, {}};
  m.memory = AnalyticalMemory(m.model);
  if (!a.cost_file.empty()) {
    MemoryModel mm;
    mm.m1 = -1;
    m.cost = Unwrap(LoadCostModel(a.cost_file, &mm));
    if (mm.m1 > 0) m.memory = mm;
  } else if (!a.bench_file.empty()) {
    const BenchTable table = Unwrap(ReadBenchCsv(a.bench_file));
    const FitResult fit = Unwrap(FitBench(table));
    if (auto why = FitProblem(fit)) throw Error(a.bench_file + ": unusable fit: " + *why);
    m.cost = fit.best().model;
    if (fit.memory) m.memory = fit.memory->model;
    m.fit_json = {{"chosen", m.cost.kind == CostModel::Kind::kPower ? "power" : "quadratic"},
                  {"r2", fit.best().quality.r2},
                  {"reason", fit.choice_reason}};
  } else {
    m.cost = AnalyticalCost(m.model);
  }
  // --overhead-per-micro-batch: the conservative accounting, a_mb := a + a_mb, a := 0, applied to
  // the cost model itself so the planner, the simulator, --json and the report all see it.
  if (a.overhead_per_mb) {
    m.cost = OverheadPerMicroBatch(m.cost);
    m.cost.source += " (overhead per micro-batch)";
  }
  return m;
}

// M_mem: --m-mem, or what the memory model leaves on a --gpu-mem-gib GPU.
int64_t MemoryBudgetTokens(const PlanArgs& a, const MemoryModel& memory) {
  if (a.m_mem > 0) return a.m_mem;
  const int64_t m_mem = memory.MaxTokens(a.gpu_mem_gib * 1024.0 * 1024.0 * 1024.0, a.mem_safety);
  if (m_mem < 1) {
    throw Error("the memory model leaves no room for activations on a " +
                FormatNumber(a.gpu_mem_gib) + " GiB GPU (m0 = " + FormatNumber(memory.m0) +
                " bytes); raise --gpu-mem-gib or give --m-mem");
  }
  if (m_mem > kMaxMMemTokens) {
    throw Error("the memory model (m1 = " + FormatNumber(memory.m1) +
                " bytes per token) gives M_mem = " + FormatNumber(static_cast<long long>(m_mem)) +
                " tokens, above the limit " + FormatNumber(static_cast<long long>(kMaxMMemTokens)) +
                "; check the memory model or give --m-mem");
  }
  return m_mem;
}

Corpus ReadCorpus(const PlanArgs& a, const ModelPreset& model) {
  const auto t0 = std::chrono::steady_clock::now();
  ManifestOptions mo;
  mo.skip_bad_rows = a.skip_bad_rows;
  Corpus c;
  const double c0 = CpuSeconds();
  c.shaped = Unwrap(ReadShapedManifest(a.manifest, model, mo, &c.manifest));
  c.parse_s = Seconds(t0);
  c.parse_cpu_s = CpuSeconds() - c0;
  c.num_samples = static_cast<int64_t>(c.shaped.shape_of.size());
  if (c.manifest.rows_skipped > 0 && !a.json) {
    std::fprintf(stderr, "skipped %lld bad rows of %lld, e.g. %s\n",
                 static_cast<long long>(c.manifest.rows_skipped),
                 static_cast<long long>(c.manifest.rows_total),
                 c.manifest.skipped_examples.empty() ? "" : c.manifest.skipped_examples[0].c_str());
  }
  return c;
}

// Samples longer than M_mem run alone (B = 1) and may not fit in GPU memory: a warning naming
// how many; a plan in which every sample is over M_mem cannot be used and is an error.
void CheckMemoryBudget(const Corpus& c, int64_t m_mem) {
  std::vector<int64_t> count = c.shaped.count;
  if (count.size() != c.shaped.shapes.size()) {
    count.assign(c.shaped.shapes.size(), 0);
    for (int32_t s : c.shaped.shape_of) ++count[s];
  }
  int64_t over = 0, shortest = 0, longest = 0;
  for (size_t s = 0; s < c.shaped.shapes.size(); ++s) {
    const int64_t len = c.shaped.shapes[s].seq_len;
    if (count[s] == 0) continue;
    if (shortest == 0 || len < shortest) shortest = len;
    if (len > m_mem) {
      over += count[s];
      longest = std::max(longest, len);
    }
  }
  if (over == 0) return;
  if (over == c.num_samples) {
    throw Error("every sample (" + std::to_string(over) +
                " of them) is over the memory budget M_mem = " + std::to_string(m_mem) +
                " tokens (the shortest has S = " + std::to_string(shortest) +
                " tokens): each would run alone and not fit in GPU memory; give --m-mem >= " +
                std::to_string(shortest) +
                ", or leave --m-mem at 0 to derive M_mem from the memory model and --gpu-mem-gib");
  }
  std::fprintf(stderr,
               "warning: %lld of %lld samples (%.1f%%) are over the memory budget M_mem = %lld "
               "tokens (S up to %lld): they run alone (B = 1) and may not fit in GPU memory; "
               "raise --m-mem to %lld or leave the longest samples out of the manifest\n",
               static_cast<long long>(over), static_cast<long long>(c.num_samples),
               100.0 * static_cast<double>(over) / static_cast<double>(c.num_samples),
               static_cast<long long>(m_mem), static_cast<long long>(longest),
               static_cast<long long>(longest));
}

// A plan's summary fields without its big arrays.
Plan LightPlan(const Plan& plan) {
  Plan light;
  light.policy = plan.policy;
  light.m_comp = plan.m_comp;
  light.p = plan.p;
  light.m_mem_tokens = plan.m_mem_tokens;
  light.rank_budget_s = plan.rank_budget_s;
  light.samples_over_m_mem = plan.samples_over_m_mem;
  light.rank_budget_raised = plan.rank_budget_raised;
  light.samples_unfit = plan.samples_unfit;
  light.sp_degrees = plan.sp_degrees;
  light.batch_size_of_shape = plan.batch_size_of_shape;
  return light;
}

// Plans and simulates runs.runs[i]; keeps the whole plan only where it is written out.
void RunPolicy(const PlanArgs& a, const Corpus& c, const CostModel& cost, size_t i, Runs& runs) {
  PlanOptions opt = runs.po;
  opt.policy = runs.policies[i];
  opt.sp_degrees = runs.sp_degrees[i];
  if (opt.sp_degrees.empty()) opt.sp_comm_per_sample_s.clear();
  PolicyRun& r = runs.runs[i];
  auto t = std::chrono::steady_clock::now();
  const double c0 = ThreadCpuSeconds();
  r.plan = Unwrap(MakePlan(c.shaped, cost, opt));
  r.plan_s = Seconds(t);
  r.plan_cpu_s = ThreadCpuSeconds() - c0;
  t = std::chrono::steady_clock::now();
  r.sim = Simulate(r.plan, c.shaped, cost, runs.so);
  r.sim_s = Seconds(t);
  const bool keep_plan = i == runs.main_idx && (!a.emit_batches.empty() || !a.out.empty());
  if (!keep_plan) r.plan = LightPlan(r.plan);
}

// Runs run(0..n-1). The policies are independent: with --compare the last one (balanced, the
// slowest) runs on a second thread while this one runs the others. Plans are deterministic
// either way.
template <typename F>
void RunAll(size_t n, bool progress, F&& run) {
  Progress bar("plan", static_cast<int64_t>(n), progress);
  std::exception_ptr worker_error;
  std::thread worker;
  size_t local = n;
  if (n > 1 && std::thread::hardware_concurrency() >= 2) {
    local = n - 1;
    worker = std::thread([&] {
      try {
        run(n - 1);
      } catch (...) {
        worker_error = std::current_exception();
      }
    });
  }
  try {
    for (size_t i = 0; i < local; ++i) {
      run(i);
      bar.Update(static_cast<int64_t>(i) + 1);
    }
  } catch (...) {
    if (worker.joinable()) worker.join();
    throw;
  }
  if (worker.joinable()) worker.join();
  if (worker_error) std::rethrow_exception(worker_error);
  bar.Update(static_cast<int64_t>(n));
}

// --policy (or the three of --compare), with M_comp chosen once (adaptive's search) and shared
// by adaptive and balanced; the runs of --sp-degrees (cli_plan_sp.cc) after them.
Runs RunPolicies(const PlanArgs& a, const Corpus& c, const Models& m, int64_t m_mem,
                 Policy main_policy, TailPolicy tail, bool progress) {
  const CostModel& cost = m.cost;
  Runs runs;
  runs.po.world_size = a.world_size;
  runs.po.seed = a.seed;
  runs.po.epoch = a.epoch;
  runs.po.m_mem_tokens = m_mem;
  runs.po.m_comp = a.m_comp;
  runs.po.rank_budget_s = a.budget;
  runs.po.tail = tail;
  runs.so.noise_sigma = a.noise;
  runs.so.noise_seed = a.seed;
  runs.so.keep_rank_costs = true;
  if (a.compare) {
    runs.policies = {Policy::kEqualToken, Policy::kAdaptive, Policy::kBalanced};
  } else {
    runs.policies = {main_policy};
  }
  for (size_t i = 0; i < runs.policies.size(); ++i) {
    if (runs.policies[i] == main_policy) runs.main_idx = i;
  }
  runs.sp_degrees.assign(runs.policies.size(), {});
  const int sp_main = AddSpRuns(a, m.model, c, runs);
  if (sp_main >= 0) {
    if (!a.compare) {  // the run with degrees replaces the plain one
      runs.policies.erase(runs.policies.begin());
      runs.sp_degrees.erase(runs.sp_degrees.begin());
    }
    runs.main_idx = a.compare ? static_cast<size_t>(sp_main) : 0;
  }
  if (runs.po.m_comp <= 0) {
    const auto t0 = std::chrono::steady_clock::now();
    runs.po.m_comp = ChooseMComp(c.shaped, cost, runs.po, PlanExponent(c.shaped, cost)).m_comp;
    runs.mcomp_s = Seconds(t0);
  }
  runs.runs.resize(runs.policies.size());
  RunAll(runs.policies.size(), progress, [&](size_t i) { RunPolicy(a, c, cost, i, runs); });
  return runs;
}

// Warnings and notes about the plans, on stderr.
void WarnAboutPlans(const PlanArgs& a, const Runs& runs, TailPolicy tail) {
  for (size_t i = 0; i < runs.policies.size(); ++i) {
    const SimResult& s = runs.runs[i].sim;
    const int64_t unfit = runs.runs[i].plan.samples_unfit;
    if (unfit > 0) {
      std::fprintf(stderr,
                   "warning: policy %s drops %lld of %lld samples: over M_mem = %lld tokens per "
                   "rank at every degree of --sp-degrees (S > the largest degree x M_mem)\n",
                   RunName(runs, i).c_str(), static_cast<long long>(unfit),
                   static_cast<long long>(s.samples + s.dropped_samples),
                   static_cast<long long>(runs.po.m_mem_tokens));
    }
    const double tail_dropped = static_cast<double>(s.dropped_samples - unfit);
    const double all = static_cast<double>(s.samples + s.dropped_samples);
    if (all > 0 && tail_dropped / all > kDroppedWarnFraction) {
      std::fprintf(stderr,
                   "warning: policy %s drops %lld of %lld samples (%.1f%%, more than %g%%): the "
                   "last step of tail policy '%s' with %d ranks; use --tail pad or keep, or "
                   "fewer ranks\n",
                   RunName(runs, i).c_str(), static_cast<long long>(tail_dropped),
                   static_cast<long long>(all), 100 * tail_dropped / all,
                   100 * kDroppedWarnFraction, TailPolicyName(tail), a.world_size);
    }
    if (runs.runs[i].plan.rank_budget_raised && !a.quiet) {
      std::fprintf(stderr,
                   "note: policy %s: the default per-rank budget was raised to %.4g s, the cost "
                   "of the most expensive sample\n",
                   RunName(runs, i).c_str(), runs.runs[i].plan.rank_budget_s);
    }
  }
}

// --budget-sweep: the balanced policy at 1x..16x the default budget, from the smallest budget
// MakePlan accepts (one most expensive sample); budgets that end up equal are shown once.
std::vector<BudgetSweepRow> BudgetSweep(const Corpus& c, const CostModel& cost, const Runs& runs,
                                        bool progress) {
  std::vector<BudgetSweepRow> sweep;
  PlanOptions bo = runs.po;
  bo.policy = Policy::kBalanced;
  bo.rank_budget_s = 0;
  bo.sp_degrees = runs.sp_degrees[runs.main_idx];  // --sp-degrees: the main run's
  const double base = DefaultRankBudget(c.shaped, cost, bo.m_comp, PlanExponent(c.shaped, cost));
  const double floor_budget = MinRankBudget(c.shaped, cost, bo);
  const double mult[] = {1, 1.5, 2, 3, 4, 6, 8, 16};
  SimOptions quick = runs.so;
  quick.keep_rank_costs = false;
  Progress bar("budget sweep", 8, progress);
  for (int i = 0; i < 8; ++i) {
    bo.rank_budget_s = std::max(base * mult[i], floor_budget);
    const Plan plan = Unwrap(MakePlan(c.shaped, cost, bo));
    if (!sweep.empty() && plan.rank_budget_s == sweep.back().budget_s) continue;
    const SimResult s = Simulate(plan, c.shaped, cost, quick);
    sweep.push_back({plan.rank_budget_s, s.compute_cv, s.epoch_time_s, s.lower_bound_s, s.num_steps,
                     s.mean_samples_per_step, s.tokens_per_s_per_gpu});
    bar.Update(i + 1);
  }
  return sweep;
}

// load -> budget -> read -> policies -> warnings -> sweep -> outputs.
void RunPlan(const PlanArgs& a) {
  const auto t_start = std::chrono::steady_clock::now();
  if (!a.cost_file.empty() && !a.bench_file.empty()) {
    throw Error("give at most one of --cost and --bench");
  }
  const Policy main_policy = Unwrap(ParsePolicy(a.policy));
  const TailPolicy tail = Unwrap(ParseTailPolicy(a.tail));
  const bool progress = !a.quiet && Progress::DefaultEnabled();
  const Models m = LoadModels(a);
  const int64_t m_mem = MemoryBudgetTokens(a, m.memory);
  const Corpus c = ReadCorpus(a, m.model);
  if (a.sp_degrees == "1") CheckMemoryBudget(c, m_mem);  // else: fitting degrees (planner_sp.cc)
  const Runs runs = RunPolicies(a, c, m, m_mem, main_policy, tail, progress);
  WarnAboutPlans(a, runs, tail);
  std::vector<BudgetSweepRow> sweep;
  if (a.budget_sweep) sweep = BudgetSweep(c, m.cost, runs, progress);

  const PolicyRun& main_run = runs.runs[runs.main_idx];
  if (!a.emit_batches.empty()) EmitBatches(a.emit_batches, main_run.plan, main_run.sim);
  const PlanOutcome o{a, m, c, runs, sweep, m_mem, tail};
  const nlohmann::json j = SummaryJson(o, t_start);
  if (!a.out.empty()) WritePlanSummary(o, j["cost"]);
  if (!a.report.empty()) WriteReport(o);
  if (a.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  PrintText(o, t_start);
}

}  // namespace
}  // namespace plan

void RegisterPlanCommand(CLI::App& app) {
  using namespace plan;  // NOLINT
  auto a = std::make_shared<PlanArgs>();
  CLI::App* sub = app.add_subcommand(
      "plan", "Plan what every data-parallel rank trains on at every step, and simulate it");
  sub->add_option("--manifest", a->manifest, "Manifest (CSV, JSONL or Parquet: .parquet, .pq)")
      ->required();
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
  AddNumber(sub, "--noise", &a->noise, 0.0, kMaxNoiseSigma,
            "Lognormal sigma of simulated per-micro-batch noise (mean-preserving; above 1 an "
            "epoch's sum no longer shows its mean: simulate.h)");
  sub->add_flag("--overhead-per-micro-batch", a->overhead_per_mb,
                "Charge the whole fixed overhead per micro-batch: a_mb := a + a_mb, a := 0 "
                "(conservative; a fitted a_mb is the accurate way)");
  sub->add_flag("--compare", a->compare,
                "Run the three policies side by side (with --sp-degrees: also balanced at each "
                "fixed degree 1, 2, 4, 8)");
  sub->add_option("--sp-degrees", a->sp_degrees,
                  "Sequence-parallel degrees a balanced micro-batch may use, e.g. 1,2,4,8 "
                  "(powers of two <= 8 dividing --world-size; 1: every micro-batch on one rank)")
      ->capture_default_str();
  sub->add_option("--sp-topology", a->sp_topology,
                  "Node topology of the sequence-parallel communication: an sp preset or JSON "
                  "file (ditscale sp)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print one JSON object");
  sub->add_option("--out", a->out, "Write the plan summary JSON");
  sub->add_option("--emit-batches", a->emit_batches, "Write one JSON line per (step, rank)");
  sub->add_option("--report", a->report, "Write a self-contained HTML report");
  sub->add_flag("--skip-bad-rows", a->skip_bad_rows, "Skip and count bad manifest rows");
  sub->add_flag("--quiet", a->quiet, "No progress output");
  sub->callback([a] { RunPlan(*a); });
}

}  // namespace ditscale::cli
