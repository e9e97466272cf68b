// `ditscale fit BENCH.csv`: fits the step-time models (power, quadratic) and the memory model to
// a shape benchmark, picks the better step-time model and derives M_mem.
#include <fmt/format.h>

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "ditscale/balance/fit.h"
#include "ditscale/core/error.h"
#include "tools/cli.h"
#include "tools/cli_options.h"
#include "tools/write_file.h"

namespace ditscale::cli {
namespace {

using balance::CostModel;

struct FitOptions {
  std::string bench;
  double gpu_mem_gib = 140;
  double mem_safety = 0.1;
  std::string out;
  bool json = false;
  bool accept_poor_fit = false;
};

nlohmann::ordered_json QualityJson(const balance::FitQuality& q) {
  return {{"r2", q.r2},
          {"adj_r2", q.adj_r2},
          {"r2_rel", q.r2_rel},
          {"rmse_s", q.rmse_s},
          {"max_rel_residual", q.max_rel_residual},
          {"residuals_s", q.residuals_s}};
}

nlohmann::ordered_json FitJson(const balance::ModelFit& f) {
  nlohmann::ordered_json j;
  if (f.model.kind == CostModel::Kind::kPower) {
    j = {{"a", f.model.a}, {"a_mb", f.model.a_mb}, {"b", f.model.b}, {"p", f.model.p}};
  } else {
    j = {{"a", f.model.a}, {"a_mb", f.model.a_mb}, {"c1", f.model.c1}, {"c2", f.model.c2}};
  }
  j["quality"] = QualityJson(f.quality);
  return j;
}

std::string QualityLine(const balance::FitQuality& q) {
  return fmt::format("R^2={:.5f}  adj.R^2(rel)={:.5f}  RMSE={:.4g} s  max|residual|={:.2f}%", q.r2,
                     q.adj_r2, q.rmse_s, 100 * q.max_rel_residual);
}

// What one `fit` command computed, for its outputs.
struct FitOutcome {
  balance::BenchTable table;
  balance::FitResult fit;
  int64_t m_mem = -1;       // M_mem from the memory fit; -1 without one
  int64_t accum_rows = 0;   // rows timed with gradient accumulation (k >= 2 micro-batches)
  const char* chosen = "";  // the chosen step-time model
};

// M_mem the memory fit leaves on the GPU (-1 without a memory fit); an error when it is none.
int64_t MemoryBudgetTokens(const FitOptions& o, const balance::FitResult& fit) {
  if (!fit.memory) return -1;
  const double gpu_bytes = o.gpu_mem_gib * double(1ull << 30);
  const int64_t m_mem = fit.memory->model.MaxTokens(gpu_bytes, o.mem_safety);
  if (m_mem < 1) {
    throw Error(fmt::format(
        "{}: the memory fit (m0 = {:.4g} GiB) leaves no room for activations on a {:g} GiB GPU "
        "with safety {:g}",
        o.bench, fit.memory->model.m0 / double(1ull << 30), o.gpu_mem_gib, o.mem_safety));
  }
  return m_mem;
}

void PrintJson(const FitOptions& o, const FitOutcome& r) {
  nlohmann::ordered_json j;
  j["source"] = r.table.source;
  j["rows"] = r.table.rows.size();
  j["accumulation_rows"] = r.accum_rows;
  j["a_mb_fitted"] = r.accum_rows > 0;
  j["power"] = FitJson(r.fit.power);
  j["quadratic"] = FitJson(r.fit.quadratic);
  j["chosen"] = r.chosen;
  j["choice_reason"] = r.fit.choice_reason;
  if (r.fit.memory) {
    const auto& m = *r.fit.memory;
    j["memory"] = {{"m0", m.model.m0},
                   {"m1", m.model.m1},
                   {"r2", m.r2},
                   {"rmse_bytes", m.rmse_bytes},
                   {"max_rel_residual", m.max_rel_residual},
                   {"rows", m.rows}};
    j["gpu_mem_gib"] = o.gpu_mem_gib;
    j["mem_safety"] = o.mem_safety;
    j["m_mem_tokens"] = r.m_mem;
  } else {
    j["memory"] = nullptr;
    j["m_mem_tokens"] = nullptr;
  }
  if (!o.out.empty()) j["out"] = o.out;
  fmt::print("{}\n", j.dump(2));
}

// The two step-time models, with a_mb where it was fitted (k >= 2 rows).
void PrintModels(const FitOutcome& r) {
  const auto& pw = r.fit.power;
  const auto& qd = r.fit.quadratic;
  if (r.accum_rows > 0) {
    // k micro-batches per timed step: the per-pass overhead a_mb is fitted apart from a.
    fmt::print("{} rows with k >= 2 micro-batches: t = a + k*(a_mb + B*Work(S))\n", r.accum_rows);
    fmt::print(
        "power      Work = b*S^p             a={:.4g} s  a_mb={:.4g} s  b={:.4g}  p={:.4f}\n",
        pw.model.a, pw.model.a_mb, pw.model.b, pw.model.p);
    fmt::print("           {}\n", QualityLine(pw.quality));
    fmt::print(
        "quadratic  Work = c1*S + c2*S^2     a={:.4g} s  a_mb={:.4g} s  c1={:.4g}  c2={:.4g}\n",
        qd.model.a, qd.model.a_mb, qd.model.c1, qd.model.c2);
  } else {
    fmt::print("power      t = a + b*B*S^p          a={:.4g} s  b={:.4g}  p={:.4f}\n", pw.model.a,
               pw.model.b, pw.model.p);
    fmt::print("           {}\n", QualityLine(pw.quality));
    fmt::print("quadratic  t = a + B*(c1*S + c2*S^2) a={:.4g} s  c1={:.4g}  c2={:.4g}\n",
               qd.model.a, qd.model.c1, qd.model.c2);
  }
  fmt::print("           {}\n", QualityLine(qd.quality));
}

void PrintText(const FitOptions& o, const FitOutcome& r) {
  fmt::print("benchmark: {} ({} rows, peak memory {})\n", r.table.source, r.table.rows.size(),
             r.fit.memory ? "measured" : "not measured");
  PrintModels(r);
  fmt::print("chosen: {} ({})\n", r.chosen, r.fit.choice_reason);
  if (r.accum_rows == 0) {
    fmt::print(
        "a_mb: 0 (no row with micro_batches >= 2; a is the whole fixed cost of a one-pass step)\n");
  }
  if (r.fit.memory) {
    const auto& m = *r.fit.memory;
    fmt::print(
        "memory     peak = m0 + m1*B*S        m0={:.3f} GiB  m1={:.1f} KiB/token  "
        "R^2={:.5f}  max|residual|={:.2f}%\n",
        m.model.m0 / double(1ull << 30), m.model.m1 / 1024, m.r2, 100 * m.max_rel_residual);
    fmt::print("M_mem: {} tokens per batch (GPU {:g} GiB, safety {:g})\n", r.m_mem, o.gpu_mem_gib,
               o.mem_safety);
  } else {
    fmt::print("M_mem: unknown (the benchmark has no peak_mem_bytes column)\n");
  }
  if (!o.out.empty()) fmt::print("wrote {}\n", o.out);
}

// read -> fit -> check -> M_mem -> write -> report.
void RunFit(const FitOptions& o) {
  FitOutcome r;
  r.table = balance::ReadBenchCsv(o.bench).ValueOrThrow();
  r.fit = balance::FitBench(r.table).ValueOrThrow();
  // A fit that does not explain the data is not written and not exit 0.
  if (auto why = balance::FitProblem(r.fit)) {
    if (!o.accept_poor_fit) throw Error(o.bench + ": unusable fit: " + *why);
    fmt::print(stderr, "warning: {}: unusable fit accepted (--accept-poor-fit): {}\n", o.bench,
               *why);
  }
  r.m_mem = MemoryBudgetTokens(o, r.fit);
  const CostModel& best = r.fit.best().model;
  r.chosen = best.kind == CostModel::Kind::kPower ? "power" : "quadratic";
  for (const auto& row : r.table.rows) r.accum_rows += row.micro_batches >= 2 ? 1 : 0;
  if (!o.out.empty()) {
    WriteFileChecked(
        o.out,
        balance::CostModelToJson(best, r.fit.memory ? &r.fit.memory->model : nullptr) + "\n");
  }
  if (o.json) {
    PrintJson(o, r);
  } else {
    PrintText(o, r);
  }
}

}  // namespace

void RegisterFitCommand(CLI::App& app) {
  auto opts = std::make_shared<FitOptions>();
  CLI::App* sub = app.add_subcommand(
      "fit",
      "Fit the step-time (power and quadratic) and memory models to a shape benchmark CSV "
      "(batch_size,seq_len,step_time_s[,peak_mem_bytes][,micro_batches])");
  sub->add_option("bench", opts->bench, "benchmark CSV")->required();
  AddNumber(sub, "--gpu-mem-gib", &opts->gpu_mem_gib, 0.001, 1048576.0,
            "GPU memory for M_mem, GiB (default 140)");
  AddNumber(sub, "--mem-safety", &opts->mem_safety, 0.0, 0.99,
            "fraction of GPU memory kept free when deriving M_mem (default 0.1)");
  sub->add_option("--out", opts->out, "write the chosen model (+ memory) as cost-model JSON");
  sub->add_flag("--json", opts->json, "print one JSON object instead of text");
  sub->add_flag("--accept-poor-fit", opts->accept_poor_fit,
                "report a fit that does not explain the data (b <= 0, p at its bound, R^2 below "
                "0.9, memory slope <= 0) as a warning instead of failing (exploratory sweeps)");
  sub->callback([opts] { RunFit(*opts); });
}

}  // namespace ditscale::cli
