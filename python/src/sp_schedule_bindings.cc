// Binding of one rank's sequence-parallel program: `_core.sp_rank_program`, the schedule that
// sp::BuildSchedule makes for (mesh, configuration, shape), cut down to the rank that runs it, as
// Python objects for the CPU executor over torch.distributed (python/ditscale/sp/cpu_executor.py).
// No torch, no CUDA.
//
// Arguments (keyword-only): the mesh (machines, gpus_per_machine [1, 65536]), the layer (batch
// [1, 65536], seq [1, 2^40], text [0, 2^40], heads [1, 65536], kv_heads [0, 65536] (0 = heads),
// head_dim [1, 4096], dtype_bytes [1, 8]), a resolved configuration (strategy named, not "auto";
// config: the text encoding of ditscale/torch/sp_args.h) and rank [0, machines * gpus_per_machine).
//
// Result: {"rank", "ulysses_degree", "ring_degree", "image_token_begin", "image_token_count",
//   "q", "k", "v", "out", "text_q", "text_k", "text_v", "text_out" (buffer indices, -1 = absent),
//   "buffers": [(name, role, init, tokens, heads, width)], role in {"input", "output", "work",
//     "scratch", "staging"}, init in {"undefined", "zero", "neg-inf"}; every buffer is
//     [batch, tokens, heads, width] (width = head_dim, or 1 for a log-sum-exp buffer),
//   "ops": [(kind, stream, group, deps, peer, tag, src, dst, key, value, src_lse, dst_lse,
//     label)], kind as sp::ToString(OpKind) names it ("Send", "Recv", "Put", "Signal", "Wait",
//     "Attention", "Merge", "Pack", "Unpack", "Copy"), stream 0 = compute, 1 = intra,
//     2 = inter, group -1 = none, deps indices of earlier ops, peer / tag -1 = none, each region
//     None or (buffer, token_begin, tokens, head_begin, heads)}.
// Tuples, not dicts, for the ops: a ring over 4 ranks has a few hundred ops per rank and the
// executor reads them once per program. Failures raise ditscale._core.Error naming the field.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <utility>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/strategies.h"
#include "ditscale/torch/sp_args.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace ditscale::python {
namespace {

constexpr long long kMaxTokens = 1LL << 40;

const char* InitName(sp::BufferInit init) {
  switch (init) {
    case sp::BufferInit::kZero:
      return "zero";
    case sp::BufferInit::kNegInf:
      return "neg-inf";
    default:
      return "undefined";
  }
}

py::object RegionTuple(const sp::Region& r) {
  if (!r.valid()) return py::none();
  return py::make_tuple(r.buffer, r.token_begin, r.tokens, r.head_begin, r.heads);
}

py::tuple OpTuple(const sp::Op& op) {
  return py::make_tuple(sp::ToString(op.kind), static_cast<int>(op.stream), op.group, op.deps,
                        op.peer, op.tag, RegionTuple(op.src), RegionTuple(op.dst),
                        RegionTuple(op.key), RegionTuple(op.value), RegionTuple(op.src_lse),
                        RegionTuple(op.dst_lse), op.label);
}

sp::AttentionShape ShapeOf(int64_t batch, int64_t seq, int64_t text, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes) {
  CheckRange("batch", static_cast<long long>(batch), 1, 65536);
  CheckRange("seq", static_cast<long long>(seq), 1, kMaxTokens);
  CheckRange("text", static_cast<long long>(text), 0, kMaxTokens);
  CheckRange("heads", static_cast<long long>(heads), 1, 65536);
  CheckRange("kv_heads", static_cast<long long>(kv_heads), 0, 65536);
  CheckRange("head_dim", static_cast<long long>(head_dim), 1, 4096);
  CheckRange("dtype_bytes", static_cast<long long>(dtype_bytes), 1, 8);
  sp::AttentionShape s;
  s.batch = batch;
  s.seq_tokens = seq;
  s.text_tokens = text;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.dtype_bytes = static_cast<int>(dtype_bytes);
  return s;
}

py::dict ProgramDict(const sp::Schedule& s, int rank) {
  const sp::RankProgram& p = s.ranks[rank];
  py::list buffers;
  for (const sp::BufferDecl& b : p.buffers) {
    buffers.append(
        py::make_tuple(b.name, sp::ToString(b.role), InitName(b.init), b.tokens, b.heads, b.width));
  }
  py::list ops;
  for (const sp::Op& op : p.ops) ops.append(OpTuple(op));
  py::dict d;
  d["rank"] = p.rank;
  d["strategy"] = s.strategy;
  d["ulysses_degree"] = s.config.ulysses_degree;
  d["ring_degree"] = s.config.ring_degree;
  d["image_token_begin"] = p.image_token_begin;
  d["image_token_count"] = p.image_token_count;
  d["q"] = p.q;
  d["k"] = p.k;
  d["v"] = p.v;
  d["out"] = p.out;
  d["text_q"] = p.text_q;
  d["text_k"] = p.text_k;
  d["text_v"] = p.text_v;
  d["text_out"] = p.text_out;
  d["buffers"] = std::move(buffers);
  d["ops"] = std::move(ops);
  return d;
}

py::dict SpRankProgram(int64_t machines, int64_t gpus, const sp::AttentionShape& shape,
                       const std::string& config, int64_t rank) {
  CheckRange("machines", static_cast<long long>(machines), 1, 65536);
  CheckRange("gpus_per_machine", static_cast<long long>(gpus), 1, 65536);
  CheckRange("rank", static_cast<long long>(rank), 0, machines * gpus - 1);
  const sp::SpConfig cfg = torch_ext::SpConfigOf(torch_ext::SpFieldsOfText(config));
  sp::SpMesh mesh;
  mesh.machines = static_cast<int>(machines);
  mesh.gpus_per_machine = static_cast<int>(gpus);
  Result<sp::Schedule> sched = [&] {
    py::gil_scoped_release unlocked;
    return sp::BuildSchedule(mesh, cfg, shape);
  }();
  if (!sched.ok()) throw Error(sched.failure().ToString());
  return ProgramDict(sched.value(), static_cast<int>(rank));
}

}  // namespace

void BindSpSchedule(py::module_& m) {
  using py::arg;
  m.def(
      "sp_rank_program",
      [](int64_t machines, int64_t gpus_per_machine, int64_t batch, int64_t seq, int64_t text,
         int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t dtype_bytes,
         const std::string& config, int64_t rank) {
        return SpRankProgram(machines, gpus_per_machine,
                             ShapeOf(batch, seq, text, heads, kv_heads, head_dim, dtype_bytes),
                             config, rank);
      },
      py::kw_only(), arg("machines"), arg("gpus_per_machine"), arg("batch"), arg("seq"),
      arg("text"), arg("heads"), arg("kv_heads") = 0, arg("head_dim"), arg("dtype_bytes") = 2,
      arg("config"), arg("rank"),
      "One rank's program (buffers and ops) of the schedule of a resolved configuration.");
}

}  // namespace ditscale::python
