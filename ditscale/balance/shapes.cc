// Model presets, the raw-sample -> training-shape mapping and grouping by shape.
//
// Bucket choice (when the preset has buckets), for a sample of H x W pixels:
//   ar_s = H / W, area_s = H * W; for every bucket b: dar(b) = |log(ar_s / ar_b)|,
//   darea(b) = |log(area_s / area_b)|.
//   1. Aspect ratio first: the candidates are the buckets with dar(b) <= min_b dar(b) + 0.05
//      (a 5% aspect-ratio tolerance, so that 480x832 (0.577) and 720x1280 (0.5625) count as the
//      same shape family and the area decides between them).
//   2. Then area: among the candidates the smallest darea(b) wins; remaining ties go to the
//      smaller bucket area, then to the earlier bucket in the list.
//   A sample larger than every bucket is therefore downscaled to the largest bucket of its aspect
//   ratio: nothing is upscaled beyond the largest bucket. A sample smaller than every bucket goes
//   to the smallest one.
// Without buckets: H and W are rounded down to multiples of vae_stride_hw * patch (at least one).
//
// Frames: for a video (F > 1) at fps above target_fps > 0,
//   F' = floor((F - 1) * target_fps / fps) + 1, else F' = F;
//   then F'' = min(F', max_frames) rounded down to k * vae_stride_t + 1.
#include "ditscale/balance/shapes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>
#include <tuple>
#include <utility>

#include "ditscale/balance/internal/shape_mapper.h"
#include "ditscale/core/json_text.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {
namespace {

constexpr double kMaxStride = 64;  // vae strides and patch sizes (shapes.h)

std::vector<Resolution> WanBuckets() {
  // ~256^2 tier (image pre-training), 480p tier, 720p tier; 9:16, 3:4, 1:1, 4:3, 16:9.
  return {{256, 256},  {192, 336},  {336, 192},  {224, 288},  {288, 224},
          {480, 832},  {832, 480},  {544, 704},  {704, 544},  {624, 624},
          {720, 1280}, {1280, 720}, {832, 1104}, {1104, 832}, {960, 960}};
}

std::vector<ModelPreset> BuiltinPresets() {
  std::vector<ModelPreset> v;
  ModelPreset wan;
  wan.name = "wan2.1-1.3b";
  wan.hidden = 1536;
  wan.layers = 30;
  wan.heads = 12;
  wan.ffn_hidden = 8960;
  wan.text_tokens = 512;
  wan.joint_text = false;
  wan.params_b = 1.3;
  wan.vae_stride_t = 4;
  wan.vae_stride_hw = 8;
  wan.patch_t = 1;
  wan.patch_h = wan.patch_w = 2;
  wan.target_fps = 16;
  wan.max_frames = 81;
  wan.buckets = WanBuckets();
  v.push_back(wan);

  ModelPreset wan14 = wan;
  wan14.name = "wan2.1-14b";
  wan14.hidden = 5120;
  wan14.layers = 40;
  wan14.heads = 40;
  wan14.ffn_hidden = 13824;
  wan14.params_b = 14;
  v.push_back(wan14);

  ModelPreset hy = wan;
  hy.name = "hunyuanvideo";
  hy.hidden = 3072;
  hy.layers = 60;  // 20 double-stream + 40 single-stream blocks
  hy.heads = 24;
  hy.ffn_hidden = 12288;
  hy.text_tokens = 256;
  hy.joint_text = true;
  hy.params_b = 13;
  hy.target_fps = 24;
  hy.max_frames = 129;
  hy.buckets = {{544, 960},  {960, 544},  {624, 832},  {832, 624},  {720, 720},
                {720, 1280}, {1280, 720}, {832, 1104}, {1104, 832}, {960, 960}};
  v.push_back(hy);

  ModelPreset cog = wan;
  cog.name = "cogvideox-5b";
  cog.hidden = 3072;
  cog.layers = 42;
  cog.heads = 48;
  cog.ffn_hidden = 12288;
  cog.text_tokens = 226;
  cog.joint_text = true;
  cog.params_b = 5;
  cog.target_fps = 8;
  cog.max_frames = 49;
  cog.buckets = {{480, 720}, {720, 480}};
  v.push_back(cog);

  ModelPreset flux = wan;
  flux.name = "flux";
  flux.hidden = 3072;
  flux.layers = 57;  // 19 double-stream + 38 single-stream blocks
  flux.heads = 24;
  flux.ffn_hidden = 12288;
  flux.text_tokens = 512;
  flux.joint_text = true;
  flux.params_b = 12;
  flux.target_fps = 0;
  flux.max_frames = 1;
  flux.images_only = true;
  flux.buckets = {{512, 512},  {384, 672},  {672, 384},  {448, 576},  {576, 448},  {1024, 1024},
                  {768, 1344}, {1344, 768}, {896, 1152}, {1152, 896}, {832, 1216}, {1216, 832}};
  v.push_back(flux);
  return v;
}

std::string NamesList() {
  std::string s;
  for (const auto& n : ModelPresetNames()) s += (s.empty() ? "" : ", ") + n;
  return s;
}

Failure FieldFailure(const std::string& file, const std::string& field, std::string msg) {
  return Failure::InFile(file, 0, field, std::move(msg));
}

// A range bound: integers exactly ("1048576", not "1.04858e+06").
std::string BoundText(double v) {
  return v == std::floor(v) && std::abs(v) < 9e15 ? FormatNumber(static_cast<long long>(v))
                                                  : FormatNumber(v);
}

// "<field>: <value> is out of range [lo, hi]", the value as written in the file.
Failure RangeFailure(const std::string& file, const std::string& field, const nlohmann::json& v,
                     double lo, double hi) {
  return FieldFailure(
      file, field,
      field + ": " + v.dump() + " is out of range [" + BoundText(lo) + ", " + BoundText(hi) + "]");
}

// Reads an optional field of type T in [lo, hi]; returns false (with *f set) on a type or range
// error.
template <typename T>
bool ReadField(const nlohmann::json& j, const char* key, T* out, const std::string& file,
               std::optional<Failure>* f, double lo = 0, double hi = 0) {
  auto it = j.find(key);
  if (it == j.end()) return true;
  const bool want_bool = std::is_same_v<T, bool>;
  const bool want_int = std::is_integral_v<T> && !want_bool;
  if (want_bool ? !it->is_boolean() : want_int ? !it->is_number_integer() : !it->is_number()) {
    *f = FieldFailure(file, key,
                      std::string("expected ") +
                          (want_bool  ? "true/false"
                           : want_int ? "an integer"
                                      : "a number") +
                          ", got " + it->dump());
    return false;
  }
  if constexpr (!std::is_same_v<T, bool>) {
    const double v = it->get<double>();
    if (!(v >= lo && v <= hi)) {
      *f = RangeFailure(file, key, *it, lo, hi);
      return false;
    }
  }
  *out = it->get<T>();
  return true;
}

}  // namespace

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const auto& p : BuiltinPresets()) names.push_back(p.name);
  return names;
}

Result<ModelPreset> GetModelPreset(const std::string& name) {
  for (auto& p : BuiltinPresets()) {
    if (p.name == name) return p;
  }
  return Failure::InvalidArgument("unknown model preset '" + name + "' (valid: " + NamesList() +
                                  ")");
}

namespace {

Result<ModelPreset> ModelFromJson(const nlohmann::json& j, const std::string& path) {
  if (!j.is_object()) return Failure::InFile(path, 1, "", "expected a JSON object");
  static const std::vector<std::string> kKnown = {
      "base",        "name",       "hidden",     "layers",       "heads",         "ffn_hidden",
      "text_tokens", "joint_text", "params_b",   "vae_stride_t", "vae_stride_hw", "patch_t",
      "patch_h",     "patch_w",    "target_fps", "max_frames",   "images_only",   "buckets"};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(kKnown.begin(), kKnown.end(), it.key()) == kKnown.end()) {
      return FieldFailure(path, it.key(), "unknown field");
    }
  }
  ModelPreset m;
  if (auto it = j.find("base"); it != j.end()) {
    if (!it->is_string()) return FieldFailure(path, "base", "expected a preset name string");
    auto base = GetModelPreset(it->get<std::string>());
    if (!base.ok()) return FieldFailure(path, "base", base.failure().message);
    m = *base;
  }
  if (auto it = j.find("name"); it != j.end()) {
    if (!it->is_string()) return FieldFailure(path, "name", "expected a string");
    m.name = it->get<std::string>();
  } else {
    m.name = (m.name.empty() ? std::string("custom") : m.name) + "@" + path;
  }
  std::optional<Failure> f;  // set by the ReadField that fails
  constexpr double k20 = 1 << 20;
  bool ok = ReadField(j, "hidden", &m.hidden, path, &f, 1, 65536) &&
            ReadField(j, "layers", &m.layers, path, &f, 1, 1024) &&
            ReadField(j, "heads", &m.heads, path, &f, 1, 65536) &&
            ReadField(j, "ffn_hidden", &m.ffn_hidden, path, &f, 1, k20) &&
            ReadField(j, "text_tokens", &m.text_tokens, path, &f, 0, k20) &&
            ReadField(j, "joint_text", &m.joint_text, path, &f) &&
            ReadField(j, "params_b", &m.params_b, path, &f, 0, 1e5) &&
            ReadField(j, "vae_stride_t", &m.vae_stride_t, path, &f, 1, kMaxStride) &&
            ReadField(j, "vae_stride_hw", &m.vae_stride_hw, path, &f, 1, kMaxStride) &&
            ReadField(j, "patch_t", &m.patch_t, path, &f, 1, kMaxStride) &&
            ReadField(j, "patch_h", &m.patch_h, path, &f, 1, kMaxStride) &&
            ReadField(j, "patch_w", &m.patch_w, path, &f, 1, kMaxStride) &&
            ReadField(j, "target_fps", &m.target_fps, path, &f, 0, 1000) &&
            ReadField(j, "max_frames", &m.max_frames, path, &f, 1, k20) &&
            ReadField(j, "images_only", &m.images_only, path, &f);
  if (!ok) return *f;
  if (auto it = j.find("buckets"); it != j.end()) {
    if (!it->is_array()) return FieldFailure(path, "buckets", "expected [[height, width], ...]");
    m.buckets.clear();
    for (size_t i = 0; i < it->size(); ++i) {
      const auto& b = (*it)[i];
      const std::string field = "buckets[" + std::to_string(i) + "]";
      if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() ||
          !b[1].is_number_integer()) {
        return FieldFailure(path, field, "expected [height, width] in pixels, got " + b.dump());
      }
      for (int k = 0; k < 2; ++k) {
        const double v = b[k].get<double>();
        if (!(v >= 1 && v <= k20)) return RangeFailure(path, field, b, 1, k20);
      }
      m.buckets.push_back({b[0].get<int32_t>(), b[1].get<int32_t>()});
    }
  }
  if (m.hidden <= 0 || m.layers <= 0) {
    return FieldFailure(path, m.hidden <= 0 ? "hidden" : "layers",
                        "required (give it, or a \"base\" preset)");
  }
  const int32_t uh = m.vae_stride_hw * m.patch_h, uw = m.vae_stride_hw * m.patch_w;
  for (size_t i = 0; i < m.buckets.size(); ++i) {
    if (m.buckets[i].height % uh != 0 || m.buckets[i].width % uw != 0) {
      return FieldFailure(path, "buckets[" + std::to_string(i) + "]",
                          "height must be a multiple of " + std::to_string(uh) + " and width of " +
                              std::to_string(uw) + " (vae_stride_hw * patch)");
    }
  }
  return m;
}

}  // namespace

Result<ModelPreset> ParseModelFile(std::string_view text, const std::string& file) {
  auto j = ParseJson(text, file);
  if (!j.ok()) return j.failure();
  return ModelFromJson(*j, file);
}

Result<ModelPreset> LoadModelFile(const std::string& path) {
  auto j = ReadJsonFile(path);
  if (!j.ok()) return j.failure();
  return ModelFromJson(*j, path);
}

Result<ModelPreset> ResolveModel(const std::string& name_or_path) {
  auto preset = GetModelPreset(name_or_path);
  if (preset.ok()) return preset;
  std::error_code ec;
  if (std::filesystem::exists(name_or_path, ec)) return LoadModelFile(name_or_path);
  return Failure::InvalidArgument("'" + name_or_path + "' is neither a model preset (" +
                                  NamesList() + ") nor a readable JSON model file");
}

namespace {

using internal::BucketChooser;
using internal::ShapeMapper;

// Manifests from this many samples on are shaped in two parts on two threads.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

// Runs fn(p) for p in [0, parts): part 0 here, the others on threads of their own.
template <typename Fn>
void RunParts(int parts, Fn&& fn) {
  std::vector<std::jthread> workers;
  for (int p = 1; p < parts; ++p) workers.emplace_back([&fn, p] { fn(p); });
  fn(0);
}

// Maps samples [begin, end) to the mapper's local indices in shape_of; stops at the first
// refused sample. An exception other than a refusal (out of memory) is kept in *exception.
void MapRows(const RawSample* samples, int64_t begin, int64_t end, ShapeMapper* mapper,
             int32_t* shape_of, std::exception_ptr* exception) {
  try {
    for (int64_t i = begin; i < end && mapper->error_entry() < 0; ++i) {
      shape_of[i] = mapper->Map(samples[i], i);
    }
  } catch (...) {
    *exception = std::current_exception();
  }
}

}  // namespace

TrainShape ToTrainShape(const RawSample& s, const ModelPreset& model) {
  return internal::MapSample(s, BucketChooser(model));
}

namespace {

// ShapeManifest with the ids (manifest.ids, copied or moved) given apart.
ShapedManifest ShapeRows(const Manifest& manifest, std::vector<int64_t> ids,
                         const ModelPreset& model) {
  const BucketChooser chooser(model);
  const int64_t n = static_cast<int64_t>(manifest.samples.size());
  ShapedManifest out;
  out.shape_of.resize(n);
  out.ids = std::move(ids);
  // The rows are independent: each part maps its range with shape indices of its own, which
  // are merged below; the result (and the first failing row) is that of one pass in row order.
  const int parts = n >= kParallelSamples && std::thread::hardware_concurrency() >= 2 ? 2 : 1;
  auto bound = [&](int p) { return n * p / parts; };
  std::vector<ShapeMapper> mapper(parts, ShapeMapper(chooser));
  std::vector<std::exception_ptr> exception(parts);
  RunParts(parts, [&](int p) {
    MapRows(manifest.samples.data(), bound(p), bound(p + 1), &mapper[p], out.shape_of.data(),
            &exception[p]);
  });
  for (int p = 0; p < parts; ++p) {
    if (exception[p]) std::rethrow_exception(exception[p]);
    if (mapper[p].error_entry() >= 0) {
      const size_t i = static_cast<size_t>(mapper[p].error_entry());
      const std::string id = i < out.ids.size() ? std::to_string(out.ids[i]) : "?";
      throw Error(manifest.source + ": sample id " + id + ": " + mapper[p].error());
    }
  }
  std::vector<const std::vector<TrainShape>*> lists;
  for (const ShapeMapper& m : mapper) lists.push_back(&m.shapes());
  internal::MergedShapes merged = internal::MergeShapes(lists);
  // Local -> sorted index, and the counts, part by part.
  const size_t num_shapes = merged.shapes.size();
  std::vector<std::vector<int64_t>> counts(parts, std::vector<int64_t>(num_shapes, 0));
  RunParts(parts, [&](int p) {
    const int32_t* to = merged.to_global[p].data();
    int64_t* count = counts[p].data();
    int32_t* shape_of = out.shape_of.data();
    for (int64_t i = bound(p); i < bound(p + 1); ++i) {
      const int32_t s = to[shape_of[i]];
      shape_of[i] = s;
      ++count[s];
    }
  });
  out.shapes = std::move(merged.shapes);
  out.count.assign(num_shapes, 0);
  for (const auto& c : counts) {
    for (size_t s = 0; s < c.size(); ++s) out.count[s] += c[s];
  }
  return out;
}

}  // namespace

ShapedManifest ShapeManifest(const Manifest& manifest, const ModelPreset& model) {
  return ShapeRows(manifest, manifest.ids, model);
}

ShapedManifest ShapeManifest(Manifest&& manifest, const ModelPreset& model) {
  std::vector<int64_t> ids = std::move(manifest.ids);
  manifest.ids.clear();
  return ShapeRows(manifest, std::move(ids), model);
}

}  // namespace ditscale::balance
