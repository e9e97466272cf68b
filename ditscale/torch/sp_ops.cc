// Sequence-parallel planning ops (no GPU needed): the SwiftFusion planner and simulator of
// ditscale/sp behind `torch.ops.ditscale.sp_plan` / `sp_predict`, used by ditscale.sp for
// strategy="auto" and by the benchmarks for predicted times. Candidates carry "transport"
// ("nccl", "nvshmem", "nvshmem-intra") and "one_sided_inter".
#include <torch/library.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "ditscale/sp/planner.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/sp/topology.h"
#include "ditscale/sp/workload.h"
#include "ditscale/torch/sp_args.h"

namespace ditscale::torch_ext {
namespace {

sp::Workload AttentionWorkload(int64_t batch, int64_t seq, int64_t text, int64_t heads,
                               int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes) {
  sp::Workload w;
  w.model = "attention";
  w.batch = static_cast<int>(batch);
  w.tokens = seq;
  w.text_tokens = text;
  w.heads = static_cast<int>(heads);
  w.kv_heads = static_cast<int>(kv_heads > 0 ? kv_heads : heads);
  w.head_dim = static_cast<int>(head_dim);
  w.dtype_bytes = static_cast<int>(dtype_bytes);
  w.hidden = static_cast<int>(heads * head_dim);
  w.layers = 1;
  w.linear_flops_per_token_per_layer = 0;  // one attention layer alone
  return w;
}

sp::Topology LoadTopo(const std::string& topology, int64_t machines, int64_t gpus) {
  auto t = sp::LoadTopology(topology, static_cast<int>(machines), static_cast<int>(gpus));
  TORCH_CHECK(t.ok(), "ditscale.sp: topology '", topology, "': ", t.failure().ToString());
  return std::move(t).value();
}

// Ranked configurations for one attention layer (JSON text: {"ranked": [...], "explanation"}).
std::string sp_plan(int64_t machines, int64_t gpus, int64_t batch, int64_t seq, int64_t text,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes,
                    std::string topology, std::vector<std::string> strategies, bool one_sided,
                    bool one_sided_intra, bool sm_partitions) {
  const sp::Topology topo = LoadTopo(topology, machines, gpus);
  sp::PlanOptions po;
  po.strategies = strategies;
  po.sm_partitions = sm_partitions;
  po.one_sided = one_sided;
  // The intra-only variant ("nvshmem-intra") is a one-sided transport too: off with one_sided.
  po.one_sided_intra_only = one_sided && one_sided_intra;
  auto r = sp::Plan(
      topo, AttentionWorkload(batch, seq, text, heads, kv_heads, head_dim, dtype_bytes), po);
  TORCH_CHECK(r.ok(), "ditscale.sp: planning failed: ", r.failure().ToString());
  nlohmann::json j;
  j["ranked"] = nlohmann::json::array();
  for (const sp::PlanCandidate& c : r.value().ranked)
    j["ranked"].push_back(sp::PlanCandidateJson(c));
  j["skipped"] = r.value().skipped;
  j["explanation"] = r.value().explanation;
  return j.dump();
}

// The simulator's time of one configuration (JSON text of the candidate).
std::string sp_predict(int64_t machines, int64_t gpus, int64_t batch, int64_t seq, int64_t text,
                       int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes,
                       std::string topology, std::string strategy, int64_t ulysses, int64_t ring,
                       int64_t chunks, bool one_sided, bool one_sided_inter, int64_t comm_sms) {
  const sp::Topology topo = LoadTopo(topology, machines, gpus);
  const sp::SpConfig cfg =
      SpConfigOf(strategy, ulysses, ring, chunks, one_sided, one_sided_inter, comm_sms);
  auto c = sp::EvaluateConfig(
      topo, AttentionWorkload(batch, seq, text, heads, kv_heads, head_dim, dtype_bytes), cfg);
  TORCH_CHECK(c.ok(), "ditscale.sp: ", c.failure().ToString());
  return sp::PlanCandidateJson(c.value()).dump();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ditscale, m) {
  // The trailing transport-scope and SM-partition arguments default so that calls written before
  // they existed keep their meaning (one-sided = puts on every link, plus the intra-only variant
  // in plans; plans list the partitioned candidates, a prediction is for the whole GPU).
  m.def(
      "sp_plan(int machines, int gpus, int batch, int seq, int text, int heads, int kv_heads, "
      "int head_dim, int dtype_bytes, str topology, str[] strategies, bool one_sided, "
      "bool one_sided_intra=True, bool sm_partitions=True) -> str",
      &sp_plan);
  m.def(
      "sp_predict(int machines, int gpus, int batch, int seq, int text, int heads, int kv_heads, "
      "int head_dim, int dtype_bytes, str topology, str strategy, int ulysses, int ring, "
      "int chunks, bool one_sided, bool one_sided_inter=True, int comm_sms=0) -> str",
      &sp_predict);
}

}  // namespace ditscale::torch_ext
