// Bindings of the sequence-parallel planner and simulator (ditscale/sp): `_core.sp_plan` and
// `_core.sp_predict`, called by ditscale.sp.plan / predict (and strategy="auto"). Planning needs
// neither torch nor CUDA. Keyword-only arguments; results are Python dicts (the JSON records of
// sp::PlanCandidateJson converted value by value). Failures raise ditscale._core.Error naming
// the argument or field.
//
// The layer: batch [1, 65536], seq [1, 2^40], text [0, 2^40], heads [1, 65536], kv_heads
// [0, 65536] (0 = heads), head_dim [1, 4096], dtype_bytes [1, 8]; the mesh: machines and
// gpus_per_machine [1, 65536]. The configuration fields: ditscale/torch/sp_args.h.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/sp/planner.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/sp/topology.h"
#include "ditscale/sp/workload.h"
#include "ditscale/torch/sp_args.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace ditscale::python {
namespace {

constexpr long long kMaxTokens = 1LL << 40;

// A JSON value as the equivalent Python object (dicts keep the JSON's key order).
py::object ToPython(const nlohmann::json& j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: {
      py::dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d[py::str(it.key())] = ToPython(it.value());
      return std::move(d);
    }
    case nlohmann::json::value_t::array: {
      py::list l;
      for (const auto& v : j) l.append(ToPython(v));
      return std::move(l);
    }
    case nlohmann::json::value_t::string:
      return py::str(j.get<std::string>());
    case nlohmann::json::value_t::boolean:
      return py::bool_(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return py::int_(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      return py::int_(j.get<uint64_t>());
    case nlohmann::json::value_t::number_float:
      return py::float_(j.get<double>());
    default:
      return py::none();
  }
}

struct Layer {
  int64_t batch, seq, text, heads, kv_heads, head_dim, dtype_bytes;
};

// One attention layer alone (no linear FLOPs), the sizes range-checked.
sp::Workload AttentionWorkload(const Layer& l) {
  CheckRange("batch", static_cast<long long>(l.batch), 1, 65536);
  CheckRange("seq", static_cast<long long>(l.seq), 1, kMaxTokens);
  CheckRange("text", static_cast<long long>(l.text), 0, kMaxTokens);
  CheckRange("heads", static_cast<long long>(l.heads), 1, 65536);
  CheckRange("kv_heads", static_cast<long long>(l.kv_heads), 0, 65536);
  CheckRange("head_dim", static_cast<long long>(l.head_dim), 1, 4096);
  CheckRange("dtype_bytes", static_cast<long long>(l.dtype_bytes), 1, 8);
  sp::Workload w;
  w.model = "attention";
  w.batch = static_cast<int>(l.batch);
  w.tokens = l.seq;
  w.text_tokens = l.text;
  w.heads = static_cast<int>(l.heads);
  w.kv_heads = static_cast<int>(l.kv_heads > 0 ? l.kv_heads : l.heads);
  w.head_dim = static_cast<int>(l.head_dim);
  w.dtype_bytes = static_cast<int>(l.dtype_bytes);
  w.hidden = static_cast<int>(l.heads * l.head_dim);
  w.layers = 1;
  w.linear_flops_per_token_per_layer = 0;
  return w;
}

sp::Topology LoadTopo(const std::string& topology, int64_t machines, int64_t gpus) {
  CheckRange("machines", static_cast<long long>(machines), 1, 65536);
  CheckRange("gpus_per_machine", static_cast<long long>(gpus), 1, 65536);
  auto t = sp::LoadTopology(topology, static_cast<int>(machines), static_cast<int>(gpus));
  if (!t.ok()) throw Error("topology '" + topology + "': " + t.failure().ToString());
  return std::move(t).value();
}

// {"ranked": [candidate, ...] fastest first, "skipped": [reason, ...], "explanation": str}.
py::dict SpPlan(int64_t machines, int64_t gpus, const Layer& layer, const std::string& topology,
                const std::vector<std::string>& strategies, bool one_sided, bool one_sided_intra,
                bool sm_partitions) {
  sp::PlanOptions po;
  for (const std::string& s : strategies) po.strategies.push_back(torch_ext::StrategyOf(s));
  const sp::Topology topo = LoadTopo(topology, machines, gpus);
  const sp::Workload w = AttentionWorkload(layer);
  po.sm_partitions = sm_partitions;
  po.one_sided = one_sided;
  // The intra-only variant ("nvshmem-intra") is a one-sided transport too: off with one_sided.
  po.one_sided_intra_only = one_sided && one_sided_intra;
  nlohmann::json j;
  {
    py::gil_scoped_release unlocked;
    auto r = sp::Plan(topo, w, po);
    if (!r.ok()) throw Error("planning failed: " + r.failure().ToString());
    j["ranked"] = nlohmann::json::array();
    for (const sp::PlanCandidate& c : r.value().ranked) {
      j["ranked"].push_back(sp::PlanCandidateJson(c));
    }
    j["skipped"] = r.value().skipped;
    j["explanation"] = r.value().explanation;
  }
  return ToPython(j).cast<py::dict>();
}

// The simulated candidate of one configuration (its "predicted_layer_s" is the layer time).
py::dict SpPredict(int64_t machines, int64_t gpus, const Layer& layer, const std::string& topology,
                   const torch_ext::SpFields& fields) {
  const sp::SpConfig cfg = torch_ext::SpConfigOf(fields);
  const sp::Topology topo = LoadTopo(topology, machines, gpus);
  const sp::Workload w = AttentionWorkload(layer);
  nlohmann::json j;
  {
    py::gil_scoped_release unlocked;
    auto c = sp::EvaluateConfig(topo, w, cfg);
    if (!c.ok()) throw Error(c.failure().ToString());
    j = sp::PlanCandidateJson(c.value());
  }
  return ToPython(j).cast<py::dict>();
}

}  // namespace

void BindSp(py::module_& m) {
  using py::arg;
  m.def(
      "sp_strategies", [] { return sp::StrategyNames(); },
      "The sequence-parallel strategies (ditscale/sp/strategies.h).");
  m.def(
      "sp_plan",
      [](int64_t machines, int64_t gpus_per_machine, int64_t batch, int64_t seq, int64_t text,
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes,
         const std::string& topology, const std::vector<std::string>& strategies, bool one_sided,
         bool one_sided_intra, bool sm_partitions) {
        return SpPlan(machines, gpus_per_machine,
                      {batch, seq, text, heads, kv_heads, head_dim, dtype_bytes}, topology,
                      strategies, one_sided, one_sided_intra, sm_partitions);
      },
      py::kw_only(), arg("machines"), arg("gpus_per_machine"), arg("batch"), arg("seq"),
      arg("text"), arg("heads"), arg("kv_heads") = 0, arg("head_dim"), arg("dtype_bytes") = 2,
      arg("topology"), arg("strategies") = std::vector<std::string>{}, arg("one_sided"),
      arg("one_sided_intra") = true, arg("sm_partitions") = true,
      "The planner's ranking of every configuration for one attention layer on a topology.");
  m.def(
      "sp_predict",
      [](int64_t machines, int64_t gpus_per_machine, int64_t batch, int64_t seq, int64_t text,
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes,
         const std::string& topology, const std::string& strategy, const std::string& transport,
         int64_t ulysses_degree, int64_t ring_degree, int64_t chunks, int64_t ulysses_chunks,
         int64_t comm_sms) {
        return SpPredict(
            machines, gpus_per_machine, {batch, seq, text, heads, kv_heads, head_dim, dtype_bytes},
            topology,
            {strategy, transport, ulysses_degree, ring_degree, chunks, ulysses_chunks, comm_sms});
      },
      py::kw_only(), arg("machines"), arg("gpus_per_machine"), arg("batch"), arg("seq"),
      arg("text"), arg("heads"), arg("kv_heads") = 0, arg("head_dim"), arg("dtype_bytes") = 2,
      arg("topology"), arg("strategy"), arg("transport") = "nccl", arg("ulysses_degree") = 0,
      arg("ring_degree") = 0, arg("chunks") = 1, arg("ulysses_chunks") = 1, arg("comm_sms") = 0,
      "The simulator's candidate record of one configuration for one attention layer.");
}

}  // namespace ditscale::python
