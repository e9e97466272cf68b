// Sequence-parallel degrees and their communication term (formulas: sp_cost.h).
#include "ditscale/balance/sp_cost.h"

#include <algorithm>
#include <map>
#include <sstream>

#include "ditscale/sp/planner.h"
#include "ditscale/sp/workload.h"

namespace ditscale::balance {

int SpSlot(int degree) {
  int slot = 0;
  while ((1 << slot) < degree) ++slot;
  return slot;
}

std::optional<std::string> SpDegreesError(const std::vector<int>& degrees, int world_size,
                                          const std::string& name) {
  std::vector<int> seen;
  for (int d : degrees) {
    if (d < 1 || d > kMaxSpDegree || (d & (d - 1)) != 0) {
      return name + ": " + std::to_string(d) + " is not a power of two in [1, " +
             std::to_string(kMaxSpDegree) + "]";
    }
    if (d > world_size || world_size % d != 0) {
      return name + ": " + std::to_string(d) + " must be at most the world size " +
             std::to_string(world_size) + " and divide it";
    }
    if (std::find(seen.begin(), seen.end(), d) != seen.end()) {
      return name + ": " + std::to_string(d) + " is given twice";
    }
    seen.push_back(d);
  }
  if (degrees.empty()) return name + ": the list is empty (give at least one degree, e.g. 1,2)";
  return std::nullopt;
}

Result<std::vector<int>> ParseSpDegrees(const std::string& text, int world_size) {
  const std::string field = "--sp-degrees";
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    int d = 0;
    size_t used = 0;
    try {
      d = std::stoi(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used == 0 || used != item.size()) {
      return Failure::InvalidArgument(field + ": '" + item +
                                          "' is not an integer (expected a list "
                                          "such as 1,2,4,8)",
                                      field);
    }
    out.push_back(d);
    // Item by item, so that the first bad entry is the one named.
    if (auto e = SpDegreesError(out, world_size, field)) return Failure::InvalidArgument(*e, field);
  }
  if (out.empty() || text.empty() || text.back() == ',') {
    return Failure::InvalidArgument(field + ": '" + text + "' is not a list such as 1,2,4,8",
                                    field);
  }
  std::sort(out.begin(), out.end());
  return out;
}

int MinSpDegree(int64_t seq_len, int64_t m_mem_tokens, const std::vector<int>& degrees) {
  for (int d : degrees) {
    if (seq_len <= static_cast<int64_t>(d) * m_mem_tokens) return d;
  }
  return 0;
}

namespace {

// exposed(d, S) * 3 * L for one sample (sp_cost.h).
Result<double> CommOfOneSample(const ModelPreset& model, const sp::Topology& node, int degree,
                               int64_t seq_len) {
  sp::Workload w;
  w.model = model.name;
  w.batch = 1;
  w.tokens = seq_len;
  w.heads = static_cast<int>(model.heads);
  w.kv_heads = w.heads;
  w.head_dim = model.heads > 0 ? static_cast<int>(model.hidden / model.heads) : 0;
  w.hidden = static_cast<int>(model.hidden);
  w.layers = static_cast<int>(model.layers);
  sp::SpConfig config;
  config.strategy = sp::Strategy::kUlysses;
  config.ulysses_degree = degree;
  config.ring_degree = 1;
  Result<sp::PlanCandidate> c = sp::EvaluateConfig(node, w, config);
  if (!c.ok()) {
    return Failure::InvalidArgument(
        "sequence-parallel degree " + std::to_string(degree) + " for model " + model.name +
        " at S = " + std::to_string(seq_len) + ": " + c.failure().ToString());
  }
  return 3.0 * static_cast<double>(model.layers) * c->sim.mean_exposed_comm_s();
}

}  // namespace

Result<std::vector<double>> UlyssesCommPerSample(const ModelPreset& model,
                                                 const std::vector<TrainShape>& shapes,
                                                 const std::vector<int>& degrees,
                                                 const std::string& topology_name) {
  std::vector<double> out(shapes.size() * kSpDegreeSlots, 0.0);
  for (int d : degrees) {
    if (d == 1) continue;
    Result<sp::Topology> node = sp::LoadTopology(topology_name, 1, d);
    if (!node.ok()) return node.failure();
    std::map<int64_t, double> by_len;  // one simulation per distinct S
    for (size_t s = 0; s < shapes.size(); ++s) {
      const int64_t len = std::max<int64_t>(shapes[s].seq_len, d);
      auto it = by_len.find(len);
      if (it == by_len.end()) {
        Result<double> c = CommOfOneSample(model, *node, d, len);
        if (!c.ok()) return c.failure();
        it = by_len.emplace(len, *c).first;
      }
      out[s * kSpDegreeSlots + SpSlot(d)] = it->second;
    }
  }
  return out;
}

}  // namespace ditscale::balance
