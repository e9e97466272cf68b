// Bindings of ditscale/balance: manifests, training shapes and the distributed sampler.
// The Python-facing sampler (iteration modes, state dicts) is python/ditscale/sampler.py; this
// file only converts types, releases the GIL around planning and turns failures into
// ditscale._core.Error.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/sampler.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/core/error.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace ditscale::python {
namespace {

using balance::BalancedBatchSampler;
using balance::MicroBatchRef;

template <typename T>
T OrThrow(Result<T> r) {
  return std::move(r).ValueOrThrow();
}

template <typename T, typename F>
py::array_t<T> Column(const balance::Manifest& m, F field) {
  py::array_t<T> out(static_cast<py::ssize_t>(m.samples.size()));
  T* p = out.mutable_data();
  for (size_t i = 0; i < m.samples.size(); ++i) p[i] = field(m.samples[i]);
  return out;
}

py::list IdsToList(std::span<const int64_t> ids) {
  py::list out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) out[i] = py::int_(ids[i]);
  return out;
}

py::dict StateToDict(const balance::SamplerState& s, int rank) {
  py::dict d;
  d["epoch"] = s.epoch;
  d["step"] = s.step;
  d["micro_batch"] = s.micro_batch;
  d["seed"] = s.seed;
  d["world_size"] = s.world_size;
  d["rank"] = rank;
  d["plan_fingerprint"] = s.plan_fingerprint;
  return d;
}

balance::SamplerState StateFromDict(const py::dict& d) {
  auto get = [&](const char* key) -> py::object {
    if (!d.contains(key)) throw Error(std::string("state dict misses the key '") + key + "'");
    return d[key];
  };
  balance::SamplerState s;
  s.epoch = get("epoch").cast<int64_t>();
  s.step = get("step").cast<int64_t>();
  s.micro_batch = d.contains("micro_batch") ? d["micro_batch"].cast<int64_t>() : 0;
  s.seed = get("seed").cast<uint64_t>();
  s.world_size = get("world_size").cast<int>();
  s.plan_fingerprint = d.contains("plan_fingerprint") ? d["plan_fingerprint"].cast<uint64_t>() : 0;
  return s;
}

py::dict Summary(const BalancedBatchSampler& s) {
  const balance::Plan& plan = s.plan();
  py::dict d;
  d["policy"] = balance::PolicyName(plan.policy);
  d["world_size"] = plan.world_size;
  d["seed"] = plan.seed;
  d["epoch"] = plan.epoch;
  d["num_steps"] = plan.num_steps();
  d["num_micro_batches"] = static_cast<int64_t>(plan.work.size());
  d["num_planned_samples"] = static_cast<int64_t>(plan.ids.size());
  d["dropped_samples"] = plan.dropped_samples;
  d["padded_micro_batches"] = plan.padded_micro_batches;
  d["m_mem_tokens"] = plan.m_mem_tokens;
  d["m_comp"] = plan.m_comp;
  d["p"] = plan.p;
  d["rank_budget_s"] = plan.rank_budget_s;
  d["samples_over_m_mem"] = plan.samples_over_m_mem;
  if (s.shaped() && s.cost()) {
    balance::SimOptions o;
    o.overhead_per_micro_batch = plan.overhead_per_micro_batch;
    o.keep_rank_costs = false;
    balance::SimResult sim;
    {
      py::gil_scoped_release release;
      sim = balance::Simulate(plan, *s.shaped(), *s.cost(), o);
    }
    d["compute_cv"] = sim.compute_cv;
    d["step_time_cv"] = sim.step_time_cv;
    d["bubble_fraction"] = sim.bubble_fraction;
    d["tokens_per_s_per_gpu"] = sim.tokens_per_s_per_gpu;
    d["epoch_time_s"] = sim.epoch_time_s;
    d["lower_bound_s"] = sim.lower_bound_s;
    d["tokens"] = sim.tokens;
    d["mean_samples_per_step"] = sim.mean_samples_per_step;
  }
  d["plan_fingerprint"] = s.State().plan_fingerprint;
  if (const auto& in = s.inputs()) {
    d["manifest"] = in->manifest_source;
    d["rows_total"] = in->rows_total;
    d["rows_skipped"] = in->rows_skipped;
    d["skipped_examples"] = in->skipped_examples;
    d["num_samples"] = in->num_samples;
    d["num_shapes"] = in->num_shapes;
    d["model"] = in->model;
    d["cost_source"] = in->cost.source;
  }
  return d;
}

std::unique_ptr<BalancedBatchSampler> MakeSampler(
    const std::string& manifest, int rank, int world_size, const std::string& model,
    const std::string& policy, uint64_t seed, int64_t epoch, const std::optional<std::string>& cost,
    const std::optional<std::string>& bench, std::optional<int64_t> m_mem_tokens,
    double gpu_mem_gib, double mem_safety, std::optional<double> m_comp,
    std::optional<double> rank_budget_s, const std::string& tail, bool skip_bad_rows,
    const std::string& format) {
  if (world_size < 1) throw Error("world_size must be >= 1, got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size) {
    throw Error("rank must be in [0, " + std::to_string(world_size) + "), got " +
                std::to_string(rank));
  }
  if (epoch < 0) throw Error("epoch must be >= 0, got " + std::to_string(epoch));
  balance::SamplerConfig config;
  config.manifest_path = manifest;
  config.manifest_options.skip_bad_rows = skip_bad_rows;
  config.manifest_options.format = format;
  config.model = model;
  config.cost_path = cost.value_or("");
  config.bench_path = bench.value_or("");
  config.gpu_mem_gib = gpu_mem_gib;
  config.mem_safety = mem_safety;
  config.plan.policy = OrThrow(balance::ParsePolicy(policy));
  config.plan.seed = seed;
  config.plan.epoch = epoch;
  config.plan.tail = OrThrow(balance::ParseTailPolicy(tail));
  if (m_mem_tokens) {
    if (*m_mem_tokens <= 0)
      throw Error("m_mem_tokens must be > 0, got " + std::to_string(*m_mem_tokens));
    config.plan.m_mem_tokens = *m_mem_tokens;
  }
  if (m_comp) {
    if (!(*m_comp > 0)) throw Error("m_comp must be > 0, got " + std::to_string(*m_comp));
    config.plan.m_comp = *m_comp;
  }
  if (rank_budget_s) {
    if (!(*rank_budget_s > 0)) {
      throw Error("rank_budget_s must be > 0, got " + std::to_string(*rank_budget_s));
    }
    config.plan.rank_budget_s = *rank_budget_s;
  }
  std::optional<Result<BalancedBatchSampler>> r;
  {
    py::gil_scoped_release release;
    r.emplace(BalancedBatchSampler::FromConfig(config, rank, world_size));
  }
  return std::make_unique<BalancedBatchSampler>(OrThrow(std::move(*r)));
}

void BindManifest(py::module_& m) {
  py::class_<balance::Manifest>(m, "Manifest",
                                "A manifest read by read_manifest: the good rows in file order.")
      .def_property_readonly("source", [](const balance::Manifest& s) { return s.source; })
      .def_property_readonly(
          "ids",
          [](const balance::Manifest& s) {
            return py::array_t<int64_t>(static_cast<py::ssize_t>(s.ids.size()), s.ids.data());
          },
          "int64 sample ids (0-based data-row numbers) of the good rows")
      .def_property_readonly("num_frames",
                             [](const balance::Manifest& s) {
                               return Column<int32_t>(
                                   s, [](const balance::RawSample& x) { return x.num_frames; });
                             })
      .def_property_readonly("height",
                             [](const balance::Manifest& s) {
                               return Column<int32_t>(
                                   s, [](const balance::RawSample& x) { return x.height; });
                             })
      .def_property_readonly("width",
                             [](const balance::Manifest& s) {
                               return Column<int32_t>(
                                   s, [](const balance::RawSample& x) { return x.width; });
                             })
      .def_property_readonly("fps",
                             [](const balance::Manifest& s) {
                               return Column<float>(
                                   s, [](const balance::RawSample& x) { return x.fps; });
                             })
      .def_readonly("rows_total", &balance::Manifest::rows_total, "data rows read")
      .def_readonly("rows_skipped", &balance::Manifest::rows_skipped, "bad rows skipped")
      .def_readonly("skipped_examples", &balance::Manifest::skipped_examples,
                    "the first skip reasons, 'file:line: ...'")
      .def("__len__", [](const balance::Manifest& s) { return s.ids.size(); })
      .def("__repr__", [](const balance::Manifest& s) {
        return "<ditscale.Manifest '" + s.source + "': " + std::to_string(s.ids.size()) +
               " samples, " + std::to_string(s.rows_skipped) + " skipped>";
      });

  m.def(
      "read_manifest",
      [](const std::string& path, bool skip_bad_rows, const std::string& format) {
        balance::ManifestOptions o;
        o.skip_bad_rows = skip_bad_rows;
        o.format = format;
        std::optional<Result<balance::Manifest>> r;
        {
          py::gil_scoped_release release;
          r.emplace(balance::ReadManifest(path, o));
        }
        return OrThrow(std::move(*r));
      },
      py::arg("path"), py::arg("skip_bad_rows") = false, py::arg("format") = "",
      "Reads an Open-Sora-style CSV or JSONL manifest. A bad row raises Error naming file, line "
      "and column unless skip_bad_rows, which skips and counts it (rows_skipped).");
}

void BindShapes(py::module_& m) {
  m.def("model_presets", &balance::ModelPresetNames, "Names of the built-in model presets.");
  auto shape = [](int32_t num_frames, int32_t height, int32_t width, float fps,
                  const std::string& model) {
    if (num_frames < 1 || height < 1 || width < 1) {
      throw Error("num_frames, height and width must be >= 1");
    }
    balance::ModelPreset preset = OrThrow(balance::ResolveModel(model));
    return balance::ToTrainShape({num_frames, height, width, fps}, preset);
  };
  m.def(
      "train_shape",
      [shape](int32_t num_frames, int32_t height, int32_t width, float fps,
              const std::string& model) {
        balance::TrainShape t = shape(num_frames, height, width, fps, model);
        py::dict d;
        d["frames"] = t.frames;
        d["height"] = t.height;
        d["width"] = t.width;
        d["seq_len"] = t.seq_len;
        return d;
      },
      py::arg("num_frames"), py::arg("height"), py::arg("width"), py::arg("fps") = 0.0f,
      py::arg("model") = "wan2.1-1.3b",
      "Training shape of one raw sample for a model (preset name or JSON model file): dict of "
      "frames, height, width (after resampling and bucketing) and seq_len (tokens).");
  m.def(
      "seq_len",
      [shape](int32_t num_frames, int32_t height, int32_t width, float fps,
              const std::string& model) {
        return shape(num_frames, height, width, fps, model).seq_len;
      },
      py::arg("num_frames"), py::arg("height"), py::arg("width"), py::arg("fps") = 0.0f,
      py::arg("model") = "wan2.1-1.3b", "Tokens S the transformer sees for one raw sample.");
}

void BindSampler(py::module_& m) {
  py::class_<BalancedBatchSampler>(
      m, "_BalancedBatchSampler",
      "The C++ sampler; use ditscale.BalancedBatchSampler (python/ditscale/sampler.py).")
      .def(py::init(&MakeSampler), py::arg("manifest"), py::arg("rank"), py::arg("world_size"),
           py::kw_only(), py::arg("model") = "wan2.1-1.3b", py::arg("policy") = "balanced",
           py::arg("seed") = 0, py::arg("epoch") = 0, py::arg("cost") = py::none(),
           py::arg("bench") = py::none(), py::arg("m_mem_tokens") = py::none(),
           py::arg("gpu_mem_gib") = 141.0, py::arg("mem_safety") = 0.1,
           py::arg("m_comp") = py::none(), py::arg("rank_budget_s") = py::none(),
           py::arg("tail") = "drop", py::arg("skip_bad_rows") = false, py::arg("format") = "")
      .def_property_readonly("rank", &BalancedBatchSampler::rank)
      .def_property_readonly("world_size", &BalancedBatchSampler::world_size)
      .def_property_readonly("epoch", &BalancedBatchSampler::epoch)
      .def_property_readonly("num_steps", &BalancedBatchSampler::NumSteps)
      .def_property_readonly("num_micro_batches", &BalancedBatchSampler::NumMicroBatches)
      .def_property_readonly("remaining_micro_batches",
                             &BalancedBatchSampler::RemainingMicroBatches)
      .def_property_readonly("remaining_steps", &BalancedBatchSampler::RemainingSteps)
      .def_property_readonly("dropped_samples", &BalancedBatchSampler::DroppedSamples)
      .def_property_readonly("padded_micro_batches", &BalancedBatchSampler::PaddedMicroBatches)
      .def("set_epoch",
           [](BalancedBatchSampler& s, int64_t e) {
             if (e < 0) throw Error("epoch must be >= 0, got " + std::to_string(e));
             py::gil_scoped_release release;
             s.SetEpoch(e);
           })
      .def("reset", &BalancedBatchSampler::Reset)
      .def(
          "next_micro_batch",
          [](BalancedBatchSampler& s) -> py::object {
            std::optional<MicroBatchRef> mb = s.NextMicroBatch();
            if (!mb) return py::none();
            return py::make_tuple(IdsToList(mb->ids), mb->last_of_step);
          },
          "(ids, last_of_step) of the next micro-batch of this rank, or None at the end.")
      .def(
          "next_step",
          [](BalancedBatchSampler& s) -> py::object {
            std::vector<MicroBatchRef> mbs;
            if (!s.NextStep(&mbs)) return py::none();
            py::list out(mbs.size());
            for (size_t i = 0; i < mbs.size(); ++i) out[i] = IdsToList(mbs[i].ids);
            return out;
          },
          "The rest of the current step (list of micro-batches), or None at the end.")
      .def(
          "cell",
          [](const BalancedBatchSampler& s, int64_t step, int rank) {
            if (step < 0 || step >= s.NumSteps() || rank < 0 || rank >= s.world_size()) {
              throw py::index_error("cell (" + std::to_string(step) + ", " + std::to_string(rank) +
                                    ") out of range");
            }
            py::list out;
            for (const MicroBatchRef& mb : s.Cell(step, rank)) out.append(IdsToList(mb.ids));
            return out;
          },
          py::arg("step"), py::arg("rank"), "Micro-batches of (step, rank), cursor unchanged.")
      .def(
          "micro_batches_per_step",
          [](const BalancedBatchSampler& s) {
            std::vector<int64_t> out(static_cast<size_t>(s.NumSteps()));
            for (int64_t k = 0; k < s.NumSteps(); ++k) out[k] = s.MicroBatchesInCell(k, s.rank());
            return out;
          },
          "c(k, rank) for every step k of the epoch.")
      .def("state", [](const BalancedBatchSampler& s) { return StateToDict(s.State(), s.rank()); })
      .def("load_state",
           [](BalancedBatchSampler& s, const py::dict& d) {
             balance::SamplerState st = StateFromDict(d);
             py::gil_scoped_release release;
             s.LoadState(st);
           })
      .def("summary", &Summary);
}

}  // namespace

void BindBalance(py::module_& m) {
  BindManifest(m);
  BindShapes(m);
  BindSampler(m);
}

}  // namespace ditscale::python
