// `ditscale plan --sp-degrees`: the runs with sequence-parallel degrees per micro-batch, their
// JSON fields and their text table (docs/balance.md, "Sequence parallelism per micro-batch").
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/cli_plan.h"

namespace ditscale::cli::plan {
namespace {

std::string JoinDegrees(const std::vector<int>& degrees) {
  std::string s;
  for (int d : degrees) s += (s.empty() ? "" : ",") + std::to_string(d);
  return s;
}

}  // namespace

std::string RunName(const Runs& runs, size_t i) {
  std::string name = PolicyName(runs.policies[i]);
  if (i < runs.sp_degrees.size() && !runs.sp_degrees[i].empty()) {
    name += " sp=" + JoinDegrees(runs.sp_degrees[i]);
  }
  return name;
}

int AddSpRuns(const PlanArgs& a, const ModelPreset& model, const Corpus& c, Runs& runs) {
  const std::vector<int> degrees = Unwrap(ParseSpDegrees(a.sp_degrees, a.world_size));
  if (degrees == std::vector<int>{1}) return -1;
  if (a.policy != "balanced") {
    throw Error("--sp-degrees " + a.sp_degrees + " needs --policy balanced (got '" + a.policy +
                "'): only the balanced policy plans sequence-parallel groups");
  }
  std::vector<std::vector<int>> added = {degrees};
  if (a.compare) {
    for (int d = 1; d <= kMaxSpDegree; d *= 2) {
      if (d <= a.world_size && a.world_size % d == 0 && degrees != std::vector<int>{d}) {
        added.push_back({d});
      }
    }
  }
  std::vector<int> all;
  for (const auto& list : added) all.insert(all.end(), list.begin(), list.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  runs.po.sp_comm_per_sample_s =
      Unwrap(UlyssesCommPerSample(model, c.shaped.shapes, all, a.sp_topology));
  const int main = static_cast<int>(runs.policies.size());
  for (const auto& list : added) {
    runs.policies.push_back(Policy::kBalanced);
    runs.sp_degrees.push_back(list);
  }
  return main;
}

void AddSpJson(const Runs& runs, size_t i, nlohmann::json* j) {
  if (i >= runs.sp_degrees.size() || runs.sp_degrees[i].empty()) return;
  const SimResult& s = runs.runs[i].sim;
  const Plan& p = runs.runs[i].plan;
  (*j)["sp_degrees"] = runs.sp_degrees[i];
  (*j)["comm_fraction"] = s.comm_fraction;
  (*j)["samples_unfit"] = p.samples_unfit;
  nlohmann::json per;
  for (int slot = 0; slot < kSpDegreeSlots; ++slot) {
    if (s.sp_micro_batches[slot] == 0) continue;
    per[std::to_string(1 << slot)] = {{"micro_batches", s.sp_micro_batches[slot]},
                                      {"tokens", s.sp_tokens[slot]}};
  }
  (*j)["per_degree"] = per;
}

void PrintSpTable(const Runs& runs) {
  bool any = false;
  for (const auto& d : runs.sp_degrees) any = any || !d.empty();
  if (!any) return;
  std::printf("\nsequence parallelism (micro-batches / share of tokens per degree)\n");
  std::printf("%-22s %12s %9s %9s %9s %-44s\n", "run", "tok/s/GPU", "bubble", "comm", "unfit",
              "d=1 | d=2 | d=4 | d=8");
  for (size_t i = 0; i < runs.runs.size(); ++i) {
    if (runs.sp_degrees[i].empty()) continue;
    const SimResult& s = runs.runs[i].sim;
    std::string per;
    for (int slot = 0; slot < kSpDegreeSlots; ++slot) {
      char cell[48];
      const double share = s.tokens > 0 ? 100.0 * static_cast<double>(s.sp_tokens[slot]) /
                                              static_cast<double>(s.tokens)
                                        : 0;
      std::snprintf(cell, sizeof(cell), "%s%lld (%.0f%%)", slot ? " | " : "",
                    static_cast<long long>(s.sp_micro_batches[slot]), share);
      per += cell;
    }
    std::printf("%-22s %12.1f %8.2f%% %8.2f%% %9lld %s\n", RunName(runs, i).c_str(),
                s.tokens_per_s_per_gpu, 100 * s.bubble_fraction, 100 * s.comm_fraction,
                static_cast<long long>(runs.runs[i].plan.samples_unfit), per.c_str());
  }
}

}  // namespace ditscale::cli::plan
