// `ditscale plan` (tools/cli_plan.cc: load -> budget -> read -> policies -> sweep), and what it
// computed, for its outputs (tools/cli_plan_output.cc: --json, --out, --emit-batches, --report and
// the text). Internal to the CLI.
#pragma once

#include <chrono>
#include <cstdint>
#include <ctime>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/report.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/error.h"
#include "ditscale/core/result.h"

namespace ditscale::cli::plan {

using namespace ditscale::balance;  // NOLINT

// The options of `ditscale plan` (ranges: RegisterPlanCommand, docs/configuration.md).
struct PlanArgs {
  std::string manifest, model, cost_file, bench_file, policy = "balanced", tail = "drop";
  std::string out, emit_batches, report;
  int world_size = 1;
  double gpu_mem_gib = 141, mem_safety = 0.1, m_comp = 0, budget = 0, noise = 0;
  int64_t m_mem = 0, epoch = 0;
  uint64_t seed = 0;
  bool compare = false, json = false, skip_bad_rows = false, budget_sweep = false;
  bool overhead_per_mb = false, quiet = false;
  std::string sp_degrees = "1";  // "1": every micro-batch on one rank (the plan of before)
  std::string sp_topology = kDefaultSpTopology;
};

// One policy planned and simulated, with the times taken.
struct PolicyRun {
  Plan plan;
  SimResult sim;
  double plan_s = 0, sim_s = 0, plan_cpu_s = 0;
};

// The cost and memory models: from --cost, fitted from --bench, or the preset's analytical ones;
// --overhead-per-micro-batch applied.
struct Models {
  ModelPreset model;
  CostModel cost;
  MemoryModel memory;
  nlohmann::json fit_json;  // --bench: the fit's choice, R^2 and reason
};

// The manifest, read and shaped in one step (shaped_reader.h): "parse" times both, "shape" is 0.
struct Corpus {
  Manifest manifest;  // the counts only: a CSV file's rows are mapped to shapes while parsed
  ShapedManifest shaped;
  int64_t num_samples = 0;
  double parse_s = 0, parse_cpu_s = 0, shape_s = 0, shape_cpu_s = 0;
};

// The policies planned and simulated, and the options they share.
struct Runs {
  std::vector<Policy> policies;
  // Per run: its sequence-parallel degrees (PlanOptions::sp_degrees; empty: none).
  std::vector<std::vector<int>> sp_degrees;
  std::vector<PolicyRun> runs;
  PlanOptions po;
  SimOptions so;
  double mcomp_s = 0;   // time of the M_comp search
  size_t main_idx = 0;  // the run of --policy
};

// Everything one `plan` command computed, for its outputs.
struct PlanOutcome {
  const PlanArgs& a;
  const Models& m;
  const Corpus& c;
  const Runs& runs;
  const std::vector<BudgetSweepRow>& sweep;
  int64_t m_mem;
  TailPolicy tail;
};

// Process CPU seconds (all threads): robust to a loaded machine.
inline double CpuSeconds() { return static_cast<double>(std::clock()) / CLOCKS_PER_SEC; }

inline double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
T Unwrap(Result<T> r) {
  if (!r.ok()) throw Error(r.failure().ToString());
  return std::move(r).value();
}

// Run i's name: the policy's, with its degrees when it has some ("balanced sp=1,2,4,8").
std::string RunName(const Runs& runs, size_t i);
// --sp-degrees: the runs to make beside the policies (cli_plan_sp.cc): none for "1"; else the
// balanced policy with the degrees, and under --compare also one fixed degree each (1, 2, 4, 8
// where the world size allows). Sets runs.po.sp_comm_per_sample_s from the sp simulator.
// Returns the index of the run with the given degrees (the main run) or -1 for "1".
int AddSpRuns(const PlanArgs& a, const ModelPreset& model, const Corpus& c, Runs& runs);
// The degrees' JSON fields of a run with degrees (micro-batches and tokens per degree,
// communication share, samples dropped as fitting at no degree).
void AddSpJson(const Runs& runs, size_t i, nlohmann::json* j);
// The text table of the runs with degrees.
void PrintSpTable(const Runs& runs);

// Dropped samples / samples of the epoch (trained + dropped).
double DroppedFraction(const SimResult& s);
// One JSON line per (step, rank), written through a large buffer.
void EmitBatches(const std::string& path, const Plan& plan, const SimResult& sim);
// The --json object; its "total" time is taken now.
nlohmann::json SummaryJson(const PlanOutcome& o, std::chrono::steady_clock::time_point t_start);
// --out: the plan summary of --policy with its buckets.
void WritePlanSummary(const PlanOutcome& o, const nlohmann::json& cost_json);
// --report: the HTML page.
void WriteReport(const PlanOutcome& o);
// The text output (stdout).
void PrintText(const PlanOutcome& o, std::chrono::steady_clock::time_point t_start);

}  // namespace ditscale::cli::plan
