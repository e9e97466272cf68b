// Bindings of the sequence-parallel planner and simulator (ditscale/sp): `_core.sp_plan`,
// `_core.sp_predict`, `_core.sp_config_fields`, `_core.sp_parse_config`, called by
// ditscale.sp.plan / predict / Config (and strategy="auto"). Planning needs
// neither torch nor CUDA. Keyword-only arguments; results are Python dicts (the JSON records of
// sp::PlanCandidateJson converted value by value). Failures raise ditscale._core.Error naming
// the argument or field.
//
// The layer: batch [1, 65536], seq [1, 2^40], text [0, 2^40], heads [1, 65536], kv_heads
// [0, 65536] (0 = heads), head_dim [1, 4096], dtype_bytes [1, 8]; the mesh: machines and
// gpus_per_machine [1, 65536]. The configuration: one text (its encoding, fields and ranges:
// ditscale/torch/sp_args.h), whose ranges `_core.sp_config_fields` exports to ditscale.sp.Config.
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

// The simulated candidate of one configuration (its "predicted_layer_s" is the layer time):
// `config` in the text encoding of sp_args.h, with its topology.
py::dict SpPredict(int64_t machines, int64_t gpus, const Layer& layer, const std::string& config) {
  const torch_ext::SpFields fields = torch_ext::SpFieldsOfText(config);
  const sp::SpConfig cfg = torch_ext::SpConfigOf(fields);
  if (fields.topology.empty()) throw Error("config: the key 'topology' is missing");
  const sp::Topology topo = LoadTopo(fields.topology, machines, gpus);
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

// What ditscale.sp.Config takes from C++ instead of copying it: {"strategies": [...],
// "transports": [...], "ranges": {field: (lo, hi)}} (sp_args.h).
py::dict SpConfigFields() {
  py::dict ranges;
  for (const torch_ext::SpIntField& f : torch_ext::kSpIntFields) {
    ranges[py::str(f.name)] = py::make_tuple(f.lo, f.hi);
  }
  py::list transports;
  for (const char* name : torch_ext::kTransportNames) transports.append(py::str(name));
  py::dict d;
  d["strategies"] = sp::StrategyNames();
  d["transports"] = transports;
  d["ranges"] = ranges;
  return d;
}

// The text encoding parsed and checked as the runtime does: {field: value} (topology "" when
// absent). For tests of the encoding that ditscale.sp writes.
py::dict SpParseConfig(const std::string& config) {
  const torch_ext::SpFields f = torch_ext::SpFieldsOfText(config);
  torch_ext::SpConfigOf(f);
  py::dict d;
  d["strategy"] = f.strategy;
  d["transport"] = f.transport;
  for (const torch_ext::SpIntField& field : torch_ext::kSpIntFields) {
    d[py::str(field.name)] = f.*field.member;
  }
  d["topology"] = f.topology;
  return d;
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
         const std::string& config) {
        return SpPredict(machines, gpus_per_machine,
                         {batch, seq, text, heads, kv_heads, head_dim, dtype_bytes}, config);
      },
      py::kw_only(), arg("machines"), arg("gpus_per_machine"), arg("batch"), arg("seq"),
      arg("text"), arg("heads"), arg("kv_heads") = 0, arg("head_dim"), arg("dtype_bytes") = 2,
      arg("config"),
      "The simulator's candidate record of one configuration (text, with its topology) for one "
      "attention layer.");
  m.def(
      "sp_config_fields", &SpConfigFields,
      "The configuration's strategies, transports and integer ranges (ditscale/torch/sp_args.h).");
  m.def("sp_parse_config", &SpParseConfig, arg("config"),
        "The configuration text parsed and checked as the runtime does: {field: value}.");
}

}  // namespace ditscale::python
