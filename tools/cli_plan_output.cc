// `ditscale plan`'s outputs: --json, --out, --emit-batches, --report and the text table.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tools/cli_plan.h"
#include "tools/write_file.h"

namespace ditscale::cli::plan {
namespace {

// Mean micro-batches (forward/backward passes) per rank and step: each costs a_mb.
double MicroBatchesPerRankStep(const SimResult& s) {
  const double cells = static_cast<double>(s.num_steps) * s.world_size;
  return cells > 0 ? static_cast<double>(s.micro_batches) / cells : 0;
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

void PrintTable(const Runs& all) {
  const std::vector<PolicyRun>& runs = all.runs;
  bool sp = false;
  for (const auto& d : all.sp_degrees) sp = sp || !d.empty();
  const int width = sp ? 22 : 12;
  std::printf("%-*s %12s %10s %12s %12s %8s %10s %8s %9s %8s\n", width, "policy", "tok/s/GPU", "CV",
              "epoch (s)", "lower bd (s)", "ep/lb", "bubble", "steps", "dropped", "mb/rank");
  for (size_t i = 0; i < runs.size(); ++i) {
    const SimResult& s = runs[i].sim;
    std::printf("%-*s %12.1f %9.2f%% %12.1f %12.1f %8.4f %9.2f%% %8lld %9lld %8.2f\n", width,
                RunName(all, i).c_str(), s.tokens_per_s_per_gpu, 100 * s.compute_cv, s.epoch_time_s,
                s.lower_bound_s, s.lower_bound_s > 0 ? s.epoch_time_s / s.lower_bound_s : 0,
                100 * s.bubble_fraction, static_cast<long long>(s.num_steps),
                static_cast<long long>(s.dropped_samples), MicroBatchesPerRankStep(s));
  }
}

// `"],"sp_degree":[d,..],"sp_group":[g,..` of (step k, rank r)'s micro-batches: the group of
// degree d is ranks g*d .. g*d+d-1 (the closing "]" follows).
void WriteSpFields(std::FILE* f, const Plan& plan, int64_t k, int64_t r) {
  const int64_t w = plan.world_size;
  const int64_t b = plan.rank_offsets[k * w + r], e = plan.rank_offsets[k * w + r + 1];
  std::fputs("],\"sp_degree\":[", f);
  for (int64_t i = b; i < e; ++i) {
    std::fprintf(f, i == b ? "%d" : ",%d", plan.micro_batches[plan.work[i]].sp_degree);
  }
  std::fputs("],\"sp_group\":[", f);
  for (int64_t i = b; i < e; ++i) {
    std::fprintf(f, i == b ? "%lld" : ",%lld",
                 static_cast<long long>(r / plan.micro_batches[plan.work[i]].sp_degree));
  }
}

}  // namespace

// Dropped samples / samples of the epoch (trained + dropped).
double DroppedFraction(const SimResult& s) {
  const double all = static_cast<double>(s.samples + s.dropped_samples);
  return all > 0 ? static_cast<double>(s.dropped_samples) / all : 0;
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
      if (!plan.sp_degrees.empty()) WriteSpFields(f, plan, k, r);
      std::fprintf(f, "],\"predicted_cost_s\":%.9g}\n", sim.rank_cost_s[k * w + r]);
    }
  }
  CloseChecked(f, path);
}

// The --json object.
nlohmann::json SummaryJson(const PlanOutcome& o, std::chrono::steady_clock::time_point t_start) {
  const PlanArgs& a = o.a;
  nlohmann::json j;
  j["manifest"] = a.manifest;
  j["model"] = o.m.model.name;
  j["cost"] = nlohmann::json::parse(CostModelToJson(o.m.cost, &o.m.memory));
  j["cost_source"] = o.m.cost.source;
  if (!o.m.fit_json.is_null()) j["fit"] = o.m.fit_json;
  j["world_size"] = a.world_size;
  j["seed"] = a.seed;
  j["epoch"] = a.epoch;
  j["tail"] = TailPolicyName(o.tail);
  j["overhead_per_micro_batch"] = a.overhead_per_mb;
  j["noise_sigma"] = a.noise;
  j["m_mem_tokens"] = o.m_mem;
  j["m_comp"] = o.runs.po.m_comp;
  j["rows_total"] = o.c.manifest.rows_total;
  j["samples"] = o.c.num_samples;
  j["skipped_rows"] = o.c.manifest.rows_skipped;
  j["distinct_shapes"] = static_cast<int64_t>(o.c.shaped.shapes.size());
  for (size_t i = 0; i < o.runs.policies.size(); ++i) {
    nlohmann::json pj = PolicyJson(o.runs.runs[i]);
    AddSpJson(o.runs, i, &pj);
    j["policies"][RunName(o.runs, i)] = pj;
  }
  for (const auto& r : o.sweep) {
    j["budget_sweep"].push_back({{"rank_budget_s", r.budget_s},
                                 {"compute_cv", r.compute_cv},
                                 {"epoch_time_s", r.epoch_time_s},
                                 {"lower_bound_s", r.lower_bound_s},
                                 {"num_steps", r.num_steps},
                                 {"mean_samples_per_step", r.mean_samples_per_step},
                                 {"tokens_per_s_per_gpu", r.tokens_per_s_per_gpu}});
  }
  j["timing_cpu_s"] = {
      {"parse", o.c.parse_cpu_s}, {"shape", o.c.shape_cpu_s}, {"total", CpuSeconds()}};
  j["timing_s"] = {{"parse", o.c.parse_s},
                   {"shape", o.c.shape_s},
                   {"m_comp_search", o.runs.mcomp_s},
                   {"total", Seconds(t_start)}};
  return j;
}

// --out: the plan summary of --policy with its buckets.
void WritePlanSummary(const PlanOutcome& o, const nlohmann::json& cost_json) {
  const PolicyRun& run = o.runs.runs[o.runs.main_idx];
  const Plan& p = run.plan;
  nlohmann::json s = PolicyJson(run);
  AddSpJson(o.runs, o.runs.main_idx, &s);
  s["policy"] = PolicyName(p.policy);
  s["world_size"] = o.a.world_size;
  s["seed"] = o.a.seed;
  s["epoch"] = o.a.epoch;
  s["manifest"] = o.a.manifest;
  s["model"] = o.m.model.name;
  s["cost"] = cost_json;
  const ShapedManifest& shaped = o.c.shaped;
  for (size_t sh = 0; sh < shaped.shapes.size(); ++sh) {
    const TrainShape& t = shaped.shapes[sh];
    s["buckets"].push_back({{"frames", t.frames},
                            {"height", t.height},
                            {"width", t.width},
                            {"seq_len", t.seq_len},
                            {"count", sh < shaped.count.size() ? shaped.count[sh] : 0},
                            {"batch_size", p.batch_size_of_shape[sh]}});
  }
  WriteFileChecked(o.a.out, s.dump(2) + "\n");
}

// --report: the HTML page.
void WriteReport(const PlanOutcome& o) {
  const PlanArgs& a = o.a;
  ReportInput in;
  in.title = "ditscale plan: " + a.manifest;
  in.settings = {{"manifest", a.manifest},
                 {"model", o.m.model.name},
                 {"cost model", o.m.cost.source},
                 {"world size", std::to_string(a.world_size)},
                 {"M_mem (tokens)", std::to_string(o.m_mem)},
                 {"M_comp", std::to_string(o.runs.po.m_comp)},
                 {"samples", std::to_string(o.c.num_samples)},
                 {"skipped rows", std::to_string(o.c.manifest.rows_skipped)},
                 {"seed / epoch", std::to_string(a.seed) + " / " + std::to_string(a.epoch)}};
  for (const auto& t : o.c.shaped.shapes) in.seq_len_of_shape.push_back(t.seq_len);
  in.count_of_shape = o.c.shaped.count;
  for (size_t i = 0; i < o.runs.policies.size(); ++i) {
    const Plan& p = o.runs.runs[i].plan;
    in.policies.push_back({RunName(o.runs, i), o.runs.runs[i].sim, p.batch_size_of_shape, p.m_comp,
                           p.p, p.rank_budget_s});
  }
  in.budget_sweep = o.sweep;
  Unwrap(WriteReportHtml(a.report, in));
}

// The text output.
void PrintText(const PlanOutcome& o, std::chrono::steady_clock::time_point t_start) {
  const PlanArgs& a = o.a;
  const Corpus& c = o.c;
  std::printf("manifest %s: %lld samples (%lld rows, %lld skipped), %zu shapes; model %s\n",
              a.manifest.c_str(), static_cast<long long>(c.num_samples),
              static_cast<long long>(c.manifest.rows_total),
              static_cast<long long>(c.manifest.rows_skipped), c.shaped.shapes.size(),
              o.m.model.name.c_str());
  std::printf("cost %s; M_mem %lld tokens; M_comp %.6g (p = %.3f); %d ranks; tail %s\n",
              o.m.cost.source.c_str(), static_cast<long long>(o.m_mem), o.runs.po.m_comp,
              o.runs.runs[0].plan.p, a.world_size, TailPolicyName(o.tail));
  std::printf("fixed overheads: a %.4g s per step and rank, a_mb %.4g s per micro-batch\n",
              o.m.cost.a, o.m.cost.a_mb);
  for (size_t i = 0; i < o.runs.policies.size(); ++i) {
    if (o.runs.policies[i] == Policy::kBalanced) {
      std::printf("%s per-rank budget %.4g s\n", RunName(o.runs, i).c_str(),
                  o.runs.runs[i].plan.rank_budget_s);
    }
  }
  PrintTable(o.runs);
  PrintSpTable(o.runs);
  if (!o.sweep.empty()) {
    std::printf("\nbalanced budget sweep\n%12s %9s %12s %8s %8s %12s\n", "budget (s)", "CV",
                "epoch (s)", "ep/lb", "steps", "samples/step");
    for (const auto& r : o.sweep) {
      std::printf("%12.4g %8.2f%% %12.1f %8.4f %8lld %12.1f\n", r.budget_s, 100 * r.compute_cv,
                  r.epoch_time_s, r.lower_bound_s > 0 ? r.epoch_time_s / r.lower_bound_s : 0,
                  static_cast<long long>(r.num_steps), r.mean_samples_per_step);
    }
  }
  std::printf("time: parse %.3f s, shape %.3f s, total %.3f s\n", c.parse_s, c.shape_s,
              Seconds(t_start));
}

}  // namespace ditscale::cli::plan
