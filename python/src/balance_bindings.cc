// Bindings of ditscale/balance: manifests, training shapes and the distributed sampler.
// The Python-facing sampler (iteration modes, state dicts) is python/ditscale/sampler.py; this
// file only converts types, releases the GIL around planning and turns failures into
// ditscale._core.Error.
//
// Numeric arguments: one rule, that of ditscale/core/range.h and python/ditscale/_checks.py.
// Every numeric argument is taken as a Python object and converted here, so that a value out of
// its documented range (or beyond 64 bits, where pybind's own casters would answer
// "incompatible function arguments") raises ValueError("<name>: <value> is out of range
// [lo, hi]"), a non-number (or a bool, or 1.5 for an integer) TypeError("<name>: expected an
// integer, got float 1.5"). The ranges are those of ditscale/balance/sampler.h.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ditscale/balance/internal/parquet_manifest.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/sampler.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
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

// ---- numeric arguments (see the file comment) ----

// Shape arguments of seq_len / train_shape: the manifest's field ranges (manifest.h), except
// that fps 0 (no resampling) is allowed for a video too.
constexpr long long kMaxShapeArg = balance::kMaxDimension;
constexpr double kMaxFps = balance::kMaxFps;

std::string Repr(py::handle v) { return py::repr(v).cast<std::string>(); }

[[noreturn]] void TypeMismatch(std::string_view name, py::handle v, const char* expected) {
  throw py::type_error(std::string(name) + ": expected " + expected + ", got " +
                       std::string(py::str(py::type::handle_of(v).attr("__name__"))) + " " +
                       Repr(v));
}

template <typename T>
[[noreturn]] void OutOfRange(std::string_view name, const std::string& value, T lo, T hi) {
  throw py::value_error(std::string(name) + ": " + value + " is out of range [" + FormatNumber(lo) +
                        ", " + FormatNumber(hi) + "]");
}

// The Python integer v (int, numpy integer: anything with __index__ but bool) as an exact
// Python int.
py::int_ ExactInt(py::handle v, std::string_view name) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) TypeMismatch(name, v, "an integer");
  PyObject* i = PyNumber_Index(v.ptr());
  if (i == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::int_>(i);
}

long long IntArg(py::handle v, std::string_view name, long long lo, long long hi) {
  py::int_ i = ExactInt(v, name);
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow == 0 && x == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0) OutOfRange(name, std::string(py::str(i)), lo, hi);
  if (auto e = RangeError(name, x, lo, hi)) throw py::value_error(*e);
  return x;
}

unsigned long long UIntArg(py::handle v, std::string_view name, unsigned long long lo,
                           unsigned long long hi) {
  py::int_ i = ExactInt(v, name);
  if (PyObject_RichCompareBool(i.ptr(), py::int_(0).ptr(), Py_LT) == 1) {
    OutOfRange(name, std::string(py::str(i)), lo, hi);
  }
  const unsigned long long x = PyLong_AsUnsignedLongLong(i.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // beyond 64 bits
    OutOfRange(name, std::string(py::str(i)), lo, hi);
  }
  if (auto e = RangeError(name, x, lo, hi)) throw py::value_error(*e);
  return x;
}

double RealArg(py::handle v, std::string_view name, double lo, double hi) {
  static const py::object real = py::module_::import("numbers").attr("Real");
  if (PyBool_Check(v.ptr()) || !py::isinstance(v, real)) TypeMismatch(name, v, "a number");
  const double x = PyFloat_AsDouble(v.ptr());
  if (x == -1.0 && PyErr_Occurred()) {  // an int beyond double
    PyErr_Clear();
    OutOfRange(name, std::string(py::str(v)), lo, hi);
  }
  if (auto e = RangeError(name, x, lo, hi)) throw py::value_error(*e);
  return x;
}

// sp_degrees: None (off) or a sequence of integers, each in [1, kMaxSpDegree], then the rules of
// SpDegreesError (powers of two, dividing world_size, distinct) and policy balanced: ValueError.
std::vector<int> SpDegreesArg(py::handle v, int world_size, balance::Policy policy) {
  if (v.is_none()) return {};
  if (py::isinstance<py::str>(v) || py::isinstance<py::bytes>(v) ||
      !py::isinstance<py::sequence>(v)) {
    TypeMismatch("sp_degrees", v, "None or a list of integers such as [1, 2, 4]");
  }
  std::vector<int> out;
  for (py::handle d : v.cast<py::sequence>()) {
    out.push_back(static_cast<int>(IntArg(d, "sp_degrees", 1, balance::kMaxSpDegree)));
  }
  if (out.empty()) {
    throw py::value_error("sp_degrees: the list is empty (None: no sequence parallelism)");
  }
  if (auto e = balance::SpDegreesError(out, world_size, "sp_degrees")) throw py::value_error(*e);
  if (policy != balance::Policy::kBalanced) {
    throw py::value_error(std::string("sp_degrees: needs policy 'balanced' (got '") +
                          balance::PolicyName(policy) + "')");
  }
  return out;
}

int WorldSizeArg(py::handle v, std::string_view name = "world_size") {
  return static_cast<int>(IntArg(v, name, 1, balance::kMaxWorldSize));
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

py::dict StateToDict(const balance::SamplerState& s) {
  py::dict d;
  d["epoch"] = s.epoch;
  d["step"] = s.step;
  d["micro_batch"] = s.micro_batch;
  d["seed"] = s.seed;
  d["world_size"] = s.world_size;
  d["rank"] = s.rank;
  d["plan_fingerprint"] = s.plan_fingerprint;
  return d;
}

// Every field is required and range-checked here (python/ditscale/sampler.py checks the same
// first, with the same words); the plan-dependent checks are LoadState's.
balance::SamplerState StateFromDict(const py::dict& d) {
  auto get = [&](const char* key) -> py::object {
    if (!d.contains(key)) {
      throw py::value_error(std::string("state dict: missing field '") + key + "'");
    }
    return d[key];
  };
  balance::SamplerState s;
  s.epoch = IntArg(get("epoch"), "state.epoch", 0, balance::kMaxEpoch);
  s.step = IntArg(get("step"), "state.step", 0, std::numeric_limits<int64_t>::max());
  s.micro_batch =
      IntArg(get("micro_batch"), "state.micro_batch", 0, std::numeric_limits<int64_t>::max());
  s.seed = UIntArg(get("seed"), "state.seed", 0, std::numeric_limits<uint64_t>::max());
  s.world_size = WorldSizeArg(get("world_size"), "state.world_size");
  s.rank = static_cast<int>(IntArg(get("rank"), "state.rank", 0, s.world_size - 1));
  s.plan_fingerprint = UIntArg(get("plan_fingerprint"), "state.plan_fingerprint", 1,
                               std::numeric_limits<uint64_t>::max());
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
  d["sp_degrees"] = plan.sp_degrees;
  d["samples_unfit"] = plan.samples_unfit;
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
    py::handle manifest, py::handle rank, py::handle world_size, const std::string& model,
    const std::string& policy, py::handle seed, py::handle epoch,
    const std::optional<std::string>& cost, const std::optional<std::string>& bench,
    py::handle m_mem_tokens, py::handle gpu_mem_gib, py::handle mem_safety, py::handle m_comp,
    py::handle rank_budget_s, const std::string& tail, bool skip_bad_rows,
    const std::string& format, py::handle sp_degrees) {
  using namespace balance;  // NOLINT: the k* limits
  const int world = WorldSizeArg(world_size);
  const int r = static_cast<int>(IntArg(rank, "rank", 0, world - 1));
  SamplerConfig config;
  // A path, or a Manifest already read (python/ditscale/sampler.py: pyarrow.Table, datasets).
  if (py::isinstance<balance::Manifest>(manifest)) {
    config.manifest = std::make_shared<const balance::Manifest>(manifest.cast<balance::Manifest>());
  } else {
    config.manifest_path = manifest.cast<std::string>();
  }
  config.manifest_options.skip_bad_rows = skip_bad_rows;
  config.manifest_options.format = format;
  config.model = model;
  config.cost_path = cost.value_or("");
  config.bench_path = bench.value_or("");
  config.gpu_mem_gib = RealArg(gpu_mem_gib, "gpu_mem_gib", kMinGpuMemGib, kMaxGpuMemGib);
  config.mem_safety = RealArg(mem_safety, "mem_safety", 0, kMaxMemSafety);
  config.plan.policy = OrThrow(ParsePolicy(policy));
  config.plan.seed = UIntArg(seed, "seed", 0, std::numeric_limits<uint64_t>::max());
  config.plan.epoch = IntArg(epoch, "epoch", 0, kMaxEpoch);
  config.plan.tail = OrThrow(ParseTailPolicy(tail));
  // None: from the memory model / chosen by the planner / the planner's default.
  if (!m_mem_tokens.is_none()) {
    config.plan.m_mem_tokens = IntArg(m_mem_tokens, "m_mem_tokens", 1, kMaxMMemTokens);
  }
  if (!m_comp.is_none()) config.plan.m_comp = RealArg(m_comp, "m_comp", 0, kMaxMComp);
  if (!rank_budget_s.is_none()) {
    config.plan.rank_budget_s = RealArg(rank_budget_s, "rank_budget_s", 0, kMaxRankBudgetS);
  }
  config.plan.sp_degrees = SpDegreesArg(sp_degrees, world, config.plan.policy);
  std::optional<Result<BalancedBatchSampler>> s;
  {
    py::gil_scoped_release release;
    s.emplace(BalancedBatchSampler::FromConfig(config, r, world));
  }
  return std::make_unique<BalancedBatchSampler>(OrThrow(std::move(*s)));
}

py::dict Limits() {
  using namespace balance;  // NOLINT
  py::dict d;
  d["max_world_size"] = kMaxWorldSize;
  d["max_epoch"] = kMaxEpoch;
  d["max_m_mem_tokens"] = kMaxMMemTokens;
  d["min_gpu_mem_gib"] = kMinGpuMemGib;
  d["max_gpu_mem_gib"] = kMaxGpuMemGib;
  d["max_mem_safety"] = kMaxMemSafety;
  d["max_m_comp"] = kMaxMComp;
  d["max_rank_budget_s"] = kMaxRankBudgetS;
  d["dropped_warn_fraction"] = kDroppedWarnFraction;
  d["max_sp_degree"] = kMaxSpDegree;
  return d;
}

// The Arrow C stream of `source` (its __arrow_c_stream__() capsule, or the capsule itself) read
// by the Parquet reader's stream entry, GIL released (pyarrow's producers take it themselves).
balance::Manifest ReadArrowManifest(py::object source, const std::string& name,
                                    bool skip_bad_rows) {
  constexpr const char* kCapsule = "arrow_array_stream";
  py::object capsule = source;
  if (py::hasattr(source, "__arrow_c_stream__")) capsule = source.attr("__arrow_c_stream__")();
  if (!PyCapsule_IsValid(capsule.ptr(), kCapsule)) {
    TypeMismatch("source", source,
                 "an object with __arrow_c_stream__ (pyarrow.Table, RecordBatchReader) or an "
                 "'arrow_array_stream' capsule");
  }
  auto* stream = static_cast<ArrowArrayStream*>(PyCapsule_GetPointer(capsule.ptr(), kCapsule));
  balance::ManifestOptions o;
  o.skip_bad_rows = skip_bad_rows;
  std::optional<Result<balance::Manifest>> r;
  {
    py::gil_scoped_release release;
    r.emplace(balance::internal::ReadArrowStreamManifest(stream, name, o));
  }
  return OrThrow(std::move(*r));
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
      "Reads an Open-Sora-style CSV, JSONL or Parquet manifest. A bad row raises Error naming "
      "file, line (Parquet: row) and column unless skip_bad_rows, which skips and counts it "
      "(rows_skipped).");

  m.def("_parquet_supported", &balance::internal::ParquetSupported,
        "Whether this build reads Parquet manifests and Arrow streams (Arrow C++ was found).");
  m.def("_read_arrow_manifest", &ReadArrowManifest, py::arg("source"), py::arg("name"),
        py::arg("skip_bad_rows") = false,
        "Reads the manifest rows of an Arrow C stream: an object with __arrow_c_stream__ "
        "(pyarrow.Table, pyarrow.RecordBatchReader) or an 'arrow_array_stream' capsule. The "
        "columns, types and rules of a Parquet manifest; errors name `name` and the 1-based row.");
}

void BindShapes(py::module_& m) {
  m.def("model_presets", &balance::ModelPresetNames, "Names of the built-in model presets.");
  auto shape = [](py::handle num_frames, py::handle height, py::handle width, py::handle fps,
                  const std::string& model) {
    balance::RawSample raw;
    raw.num_frames = static_cast<int32_t>(IntArg(num_frames, "num_frames", 1, kMaxShapeArg));
    raw.height = static_cast<int32_t>(IntArg(height, "height", 1, kMaxShapeArg));
    raw.width = static_cast<int32_t>(IntArg(width, "width", 1, kMaxShapeArg));
    raw.fps = static_cast<float>(RealArg(fps, "fps", 0, kMaxFps));
    balance::ModelPreset preset = OrThrow(balance::ResolveModel(model));
    return balance::ToTrainShape(raw, preset);
  };
  const char* ranges =
      " num_frames, height and width are integers in [1, 2147483647], fps a number in [0, 1e6] "
      "(0: no resampling); out of range: ValueError naming the argument.";
  m.def(
      "train_shape",
      [shape](py::handle num_frames, py::handle height, py::handle width, py::handle fps,
              const std::string& model) {
        balance::TrainShape t = shape(num_frames, height, width, fps, model);
        py::dict d;
        d["frames"] = t.frames;
        d["height"] = t.height;
        d["width"] = t.width;
        d["seq_len"] = t.seq_len;
        return d;
      },
      py::arg("num_frames"), py::arg("height"), py::arg("width"), py::arg("fps") = 0.0,
      py::arg("model") = "wan2.1-1.3b",
      (std::string("Training shape of one raw sample for a model (preset name or JSON model "
                   "file): dict of frames, height, width (after resampling and bucketing) and "
                   "seq_len (tokens).") +
       ranges)
          .c_str());
  m.def(
      "seq_len",
      [shape](py::handle num_frames, py::handle height, py::handle width, py::handle fps,
              const std::string& model) {
        return shape(num_frames, height, width, fps, model).seq_len;
      },
      py::arg("num_frames"), py::arg("height"), py::arg("width"), py::arg("fps") = 0.0,
      py::arg("model") = "wan2.1-1.3b",
      (std::string("Tokens S the transformer sees for one raw sample.") + ranges).c_str());
}

using SamplerClass = py::class_<BalancedBatchSampler>;

// The sampler's read-only properties.
void BindSamplerProperties(SamplerClass& c) {
  c.def_property_readonly("rank", &BalancedBatchSampler::rank)
      .def_property_readonly("world_size", &BalancedBatchSampler::world_size)
      .def_property_readonly("epoch", &BalancedBatchSampler::epoch)
      .def_property_readonly("num_steps", &BalancedBatchSampler::NumSteps)
      .def_property_readonly("num_micro_batches", &BalancedBatchSampler::NumMicroBatches)
      .def_property_readonly("remaining_micro_batches",
                             &BalancedBatchSampler::RemainingMicroBatches)
      .def_property_readonly("remaining_steps", &BalancedBatchSampler::RemainingSteps)
      .def_property_readonly("dropped_samples", &BalancedBatchSampler::DroppedSamples)
      .def_property_readonly("padded_micro_batches", &BalancedBatchSampler::PaddedMicroBatches)
      .def_property_readonly(
          "sp_degrees", [](const BalancedBatchSampler& s) { return s.plan().sp_degrees; },
          "The plan's allowed sequence-parallel degrees (empty: none).")
      .def_property_readonly("num_planned_samples", [](const BalancedBatchSampler& s) {
        return static_cast<int64_t>(s.plan().ids.size());
      });
}

// The cells of the plan: micro-batches, degrees and counts of (step, rank), cursor unchanged.
void BindSamplerCells(SamplerClass& c) {
  c.def(
       "cell",
       [](const BalancedBatchSampler& s, py::handle step_arg, py::handle rank_arg) {
         const int64_t step = IntArg(step_arg, "step", 0, s.NumSteps() - 1);
         const int rank = static_cast<int>(IntArg(rank_arg, "rank", 0, s.world_size() - 1));
         py::list out;
         for (const MicroBatchRef& mb : s.Cell(step, rank)) out.append(IdsToList(mb.ids));
         return out;
       },
       py::arg("step"), py::arg("rank"), "Micro-batches of (step, rank), cursor unchanged.")
      .def(
          "cell_degrees",
          [](const BalancedBatchSampler& s, py::handle step_arg, py::handle rank_arg) {
            const int64_t step = IntArg(step_arg, "step", 0, s.NumSteps() - 1);
            const int rank = static_cast<int>(IntArg(rank_arg, "rank", 0, s.world_size() - 1));
            std::vector<int> out;
            for (const MicroBatchRef& mb : s.Cell(step, rank)) out.push_back(mb.sp_degree);
            return out;
          },
          py::arg("step"), py::arg("rank"),
          "The sequence-parallel degree of each micro-batch of (step, rank), in cell order.")
      .def(
          "micro_batches_per_step",
          [](const BalancedBatchSampler& s) {
            std::vector<int64_t> out(static_cast<size_t>(s.NumSteps()));
            for (int64_t k = 0; k < s.NumSteps(); ++k) out[k] = s.MicroBatchesInCell(k, s.rank());
            return out;
          },
          "c(k, rank) for every step k of the epoch.");
}

void BindSampler(py::module_& m) {
  SamplerClass c(
      m, "_BalancedBatchSampler",
      "The C++ sampler; use ditscale.BalancedBatchSampler (python/ditscale/sampler.py).");
  c.def(py::init(&MakeSampler), py::arg("manifest"), py::arg("rank"), py::arg("world_size"),
        py::kw_only(), py::arg("model") = "wan2.1-1.3b", py::arg("policy") = "balanced",
        py::arg("seed") = 0, py::arg("epoch") = 0, py::arg("cost") = py::none(),
        py::arg("bench") = py::none(), py::arg("m_mem_tokens") = py::none(),
        py::arg("gpu_mem_gib") = 141.0, py::arg("mem_safety") = 0.1, py::arg("m_comp") = py::none(),
        py::arg("rank_budget_s") = py::none(), py::arg("tail") = "drop",
        py::arg("skip_bad_rows") = false, py::arg("format") = "",
        py::arg("sp_degrees") = py::none());
  BindSamplerProperties(c);
  c.def("set_epoch",
        [](BalancedBatchSampler& s, py::handle epoch) {
          const int64_t e = IntArg(epoch, "epoch", 0, balance::kMaxEpoch);
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
          "The rest of the current step (list of micro-batches), or None at the end.");
  BindSamplerCells(c);
  c.def("state", [](const BalancedBatchSampler& s) { return StateToDict(s.State()); })
      .def("load_state",
           [](BalancedBatchSampler& s, const py::dict& d) {
             balance::SamplerState st = StateFromDict(d);
             py::gil_scoped_release release;
             s.LoadState(st);
           })
      .def("summary", &Summary);
  m.def("_sampler_limits", &Limits,
        "The ranges of the sampler's numeric arguments (ditscale/balance/sampler.h).");
  m.def(
      "_sp_degrees_error",
      [](py::handle degrees, py::handle world_size) -> std::optional<std::string> {
        std::vector<int> out;
        for (py::handle d : degrees.cast<py::sequence>()) {
          out.push_back(static_cast<int>(IntArg(d, "sp_degrees", 1, balance::kMaxSpDegree)));
        }
        return balance::SpDegreesError(out, WorldSizeArg(world_size), "sp_degrees");
      },
      py::arg("degrees"), py::arg("world_size"),
      "The first broken rule of a list of sequence-parallel degrees (sp_cost.h SpDegreesError: "
      "powers of two in [1, 8], at most world_size and dividing it, distinct, not empty), or "
      "None.");
}

}  // namespace

void BindBalance(py::module_& m) {
  BindManifest(m);
  BindShapes(m);
  BindSampler(m);
}

}  // namespace ditscale::python
