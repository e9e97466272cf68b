// A self-contained HTML report of planned policies: inline SVG plots, no scripts, no network.
//   1. per-step rank loads of each policy (the first max_steps steps): one dot per rank's
//      predicted cost, the step time (max over ranks) as a line, the balanced budget dashed;
//   2. bucket batch size B by sequence length S (log-log), one series per policy;
//   3. policy comparison bars: tokens/s per GPU, epoch time against its lower bound,
//      compute-load CV and bubble fraction;
//   4. with sequence-parallel degrees (a run with tokens at d > 1): the share of each run's
//      tokens at d = 1, 2, 4, 8 as stacked bars, and its communication share;
//   5. optional tables: the budget sweep of the balanced policy and the run's settings.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "ditscale/balance/planner.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

struct ReportPolicy {
  std::string name;                          // "equal-token", "adaptive", "balanced"
  SimResult sim;                             // needs rank_cost_s for plot 1
  std::vector<int64_t> batch_size_of_shape;  // Plan::batch_size_of_shape
  double m_comp = 0;
  double p = 0;
  double rank_budget_s = 0;  // balanced: budget used (0: none drawn)
};

struct BudgetSweepRow {
  double budget_s = 0;
  double compute_cv = 0;
  double epoch_time_s = 0;
  double lower_bound_s = 0;
  int64_t num_steps = 0;
  double mean_samples_per_step = 0;
  double tokens_per_s_per_gpu = 0;
};

struct ReportInput {
  std::string title = "ditscale plan";
  std::vector<std::pair<std::string, std::string>> settings;  // (key, value) rows shown first
  std::vector<int64_t> seq_len_of_shape;                      // ShapedManifest shapes' S
  std::vector<int64_t> count_of_shape;                        // samples per shape
  std::vector<ReportPolicy> policies;
  std::vector<BudgetSweepRow> budget_sweep;  // optional
  int max_steps = 150;                       // steps drawn in plot 1
};

// The page as a string.
std::string RenderReportHtml(const ReportInput& input);
// Writes the page; Failure "error writing <file>: <strerror>" (or "cannot open for writing")
// when it cannot be written.
Result<bool> WriteReportHtml(const std::string& path, const ReportInput& input);

}  // namespace ditscale::balance
