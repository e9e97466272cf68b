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

#include "ditscale/core/checked_math.h"
#include "ditscale/core/json_text.h"
#include "ditscale/core/range.h"

namespace ditscale::balance {
namespace {

constexpr double kAspectTolerance = 0.05;
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

int32_t Align(int32_t v, int32_t unit) { return std::max(unit, v / unit * unit); }

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

// The bucket rule with the buckets' logs computed once (ShapeManifest maps millions of samples).
class BucketChooser {
 public:
  explicit BucketChooser(const ModelPreset& model) : model_(model) {
    for (const auto& b : model.buckets) {
      log_ar_.push_back(std::log(static_cast<double>(b.height) / b.width));
      log_area_.push_back(std::log(static_cast<double>(b.height) * b.width));
    }
  }
  Resolution Choose(int32_t h, int32_t w) const {
    const auto& buckets = model_.buckets;
    if (buckets.empty()) {
      return {Align(h, model_.vae_stride_hw * model_.patch_h),
              Align(w, model_.vae_stride_hw * model_.patch_w)};
    }
    const double lar = std::log(static_cast<double>(h) / w);
    const double larea = std::log(static_cast<double>(h) * w);
    double best_dar = std::numeric_limits<double>::infinity();
    for (double l : log_ar_) best_dar = std::min(best_dar, std::abs(lar - l));
    size_t best = buckets.size();
    double best_darea = 0;
    for (size_t i = 0; i < buckets.size(); ++i) {
      if (std::abs(lar - log_ar_[i]) > best_dar + kAspectTolerance) continue;
      const double darea = std::abs(larea - log_area_[i]);
      if (best == buckets.size() || darea < best_darea - 1e-12 ||
          (darea <= best_darea + 1e-12 &&
           int64_t{buckets[i].height} * buckets[i].width <
               int64_t{buckets[best].height} * buckets[best].width)) {
        best = i;
        best_darea = darea;
      }
    }
    return buckets[best];
  }

 private:
  const ModelPreset& model_;
  std::vector<double> log_ar_, log_area_;
};

int32_t TrainFrames(const RawSample& s, const ModelPreset& model) {
  if (model.images_only || s.num_frames <= 1) return 1;
  int64_t f = s.num_frames;
  if (model.target_fps > 0 && s.fps > model.target_fps) {
    f = static_cast<int64_t>(std::floor((f - 1) * model.target_fps / s.fps + 1e-9)) + 1;
  }
  f = std::min<int64_t>(f, std::max(1, model.max_frames));
  const int64_t st = std::max(1, model.vae_stride_t);
  return static_cast<int32_t>((f - 1) / st * st + 1);
}

}  // namespace

namespace {

std::string RawText(const RawSample& s) {
  return ditscale::internal::StrCat("(num_frames ", s.num_frames, ", height ", s.height, ", width ",
                                    s.width, ", fps ", FormatNumber(static_cast<double>(s.fps)),
                                    ")");
}

// The rules MapSample checks first: a raw sample's sizes and fps, the model's strides.
void CheckSample(const RawSample& s, const ModelPreset& model) {
  if (s.num_frames < 1 || s.height < 1 || s.width < 1 || !(s.fps >= 0) || !std::isfinite(s.fps))
      [[unlikely]] {
    throw Error("sample " + RawText(s) +
                ": num_frames, height and width must be >= 1 and fps finite and >= 0");
  }
  if (model.vae_stride_t < 1 || model.vae_stride_hw < 1 || model.patch_t < 1 || model.patch_h < 1 ||
      model.patch_w < 1) [[unlikely]] {
    throw Error("model " + model.name + ": VAE strides and patch sizes must be >= 1");
  }
}

// S = tokens_t * tokens_h * tokens_w (+ joint text tokens) in checked int64 arithmetic whose
// error text names the sample and the model: only reached when the unchecked fast path of
// SeqLen finds an overflow or a value out of [1, kMaxSeqLen], so it always throws.
[[gnu::cold, gnu::noinline]] int64_t SeqLenOrThrow(int64_t tokens_t, int64_t tokens_h,
                                                   int64_t tokens_w, const RawSample& s,
                                                   const ModelPreset& model) {
  const std::string what = "tokens of sample " + RawText(s) + " for model " + model.name;
  int64_t seq = CheckedMul(CheckedMul(tokens_t, tokens_h, what), tokens_w, what);
  seq = CheckedAdd(seq, model.joint_text ? model.text_tokens : 0, what);
  if (seq < 1 || seq > kMaxSeqLen) {
    throw Error(
        ditscale::internal::StrCat(what, ": ", seq, " is out of range [1, ", kMaxSeqLen, "]"));
  }
  return seq;
}

// Tokens S of a training shape (shapes.h), without building any text unless it is an error.
int64_t SeqLen(const TrainShape& t, const RawSample& s, const ModelPreset& model) {
  const int64_t latent_frames = 1 + (t.frames - 1) / model.vae_stride_t;
  const int64_t pt = model.patch_t;
  const int64_t tokens_t = (latent_frames + pt - 1) / pt;  // padded to a whole temporal patch
  const int64_t tokens_h =
      t.height / CheckedMul(model.vae_stride_hw, model.patch_h, "vae_stride_hw * patch_h");
  const int64_t tokens_w =
      t.width / CheckedMul(model.vae_stride_hw, model.patch_w, "vae_stride_hw * patch_w");
  int64_t seq = 0;
  if (MulFits(tokens_t, tokens_h, &seq) && MulFits(seq, tokens_w, &seq) &&
      AddFits(seq, model.joint_text ? model.text_tokens : 0, &seq) && seq >= 1 && seq <= kMaxSeqLen)
      [[likely]] {
    return seq;
  }
  return SeqLenOrThrow(tokens_t, tokens_h, tokens_w, s, model);
}

TrainShape MapSample(const RawSample& s, const ModelPreset& model, const BucketChooser& chooser) {
  CheckSample(s, model);
  TrainShape t;
  t.frames = TrainFrames(s, model);
  const Resolution r = chooser.Choose(s.height, s.width);
  t.height = r.height;
  t.width = r.width;
  t.seq_len = SeqLen(t, s, model);
  return t;
}

// Open-addressing map TrainShape -> dense index (distinct shapes are few: tens to thousands).
class ShapeTable {
 public:
  ShapeTable() : slots_(64, -1) {}
  // Returns the index of t, adding it to *shapes when new.
  int32_t Find(const TrainShape& t, std::vector<TrainShape>* shapes) {
    size_t i = Hash(t) & (slots_.size() - 1);
    while (slots_[i] >= 0) {
      if ((*shapes)[slots_[i]] == t) return slots_[i];
      i = (i + 1) & (slots_.size() - 1);
    }
    const int32_t id = static_cast<int32_t>(shapes->size());
    shapes->push_back(t);
    slots_[i] = id;
    if (shapes->size() * 2 > slots_.size()) Rehash(*shapes);
    return id;
  }

 private:
  static size_t Hash(const TrainShape& t) {
    uint64_t x = static_cast<uint64_t>(t.seq_len) * 0x9E3779B97F4A7C15ull;
    x ^= (uint64_t(uint32_t(t.frames)) << 40) ^ (uint64_t(uint32_t(t.height)) << 20) ^
         uint64_t(uint32_t(t.width));
    x *= 0xBF58476D1CE4E5B9ull;
    return static_cast<size_t>(x ^ (x >> 31));
  }
  void Rehash(const std::vector<TrainShape>& shapes) {
    slots_.assign(slots_.size() * 2, -1);
    for (size_t id = 0; id < shapes.size(); ++id) {
      size_t i = Hash(shapes[id]) & (slots_.size() - 1);
      while (slots_[i] >= 0) i = (i + 1) & (slots_.size() - 1);
      slots_[i] = static_cast<int32_t>(id);
    }
  }
  std::vector<int32_t> slots_;
};

// Memo of (training frames, raw height, raw width) -> shape index: the training shape is a
// function of these three (the frames already fold in num_frames, fps and the model's frame
// rules), and a corpus has few distinct triples but for images of random sizes. The table is
// small and fixed (kSlots, at most half full) so that it stays in cache: once full, a new
// triple is mapped without being remembered.
class ShapeMemo {
 public:
  ShapeMemo() : slots_(kSlots) {}
  // The index for the triple, computed with make() when not remembered.
  template <typename Make>
  int32_t Get(uint32_t frames, uint32_t height, uint32_t width, Make&& make) {
    size_t i = Hash(frames, height, width) & (kSlots - 1);
    while (slots_[i].value >= 0) {
      const Slot& x = slots_[i];
      if (x.frames == frames && x.height == height && x.width == width) return x.value;
      i = (i + 1) & (kSlots - 1);
    }
    const int32_t v = make();
    if (size_ < kSlots / 2) {
      slots_[i] = Slot{frames, height, width, v};
      ++size_;
    }
    return v;
  }

 private:
  struct Slot {
    uint32_t frames = 0, height = 0, width = 0;
    int32_t value = -1;  // -1: empty
  };
  static constexpr size_t kSlots = 8192;  // 128 KiB
  static size_t Hash(uint32_t f, uint32_t h, uint32_t w) {
    const uint64_t hw = static_cast<uint64_t>(h) << 32 | w;
    uint64_t x = hw * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(f) * 0xBF58476D1CE4E5B9ull;
    return static_cast<size_t>(x ^ (x >> 29));
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// What one part of the manifest (a contiguous range of rows) maps to: local shape indices in
// shape_of, the distinct shapes in first-seen order, and the part's first failing row.
struct ShapePart {
  std::vector<TrainShape> shapes;
  int64_t error_row = -1;        // first row of the part that MapSample refused
  std::string error;             // its message
  std::exception_ptr exception;  // any other exception (out of memory)
};

void MapRows(const RawSample* samples, int64_t begin, int64_t end, const ModelPreset& model,
             const BucketChooser& chooser, int32_t* shape_of, ShapePart* part) {
  ShapeTable table;
  ShapeMemo memo;
  int64_t i = begin;
  try {
    for (; i < end; ++i) {
      const RawSample& s = samples[i];
      CheckSample(s, model);
      shape_of[i] = memo.Get(static_cast<uint32_t>(TrainFrames(s, model)),
                             static_cast<uint32_t>(s.height), static_cast<uint32_t>(s.width), [&] {
                               return table.Find(MapSample(s, model, chooser), &part->shapes);
                             });
    }
  } catch (const Error& e) {
    part->error_row = i;
    part->error = e.what();
  } catch (...) {
    part->exception = std::current_exception();
  }
}

// Manifests from this many samples on are shaped in two parts on two threads.
constexpr int64_t kParallelSamples = int64_t{1} << 17;

// Runs fn(p) for p in [0, parts): part 0 here, the others on threads of their own.
template <typename Fn>
void RunParts(int parts, Fn&& fn) {
  std::vector<std::jthread> workers;
  for (int p = 1; p < parts; ++p) workers.emplace_back([&fn, p] { fn(p); });
  fn(0);
}

}  // namespace

TrainShape ToTrainShape(const RawSample& s, const ModelPreset& model) {
  return MapSample(s, model, BucketChooser(model));
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
  std::vector<ShapePart> part(parts);
  RunParts(parts, [&](int p) {
    MapRows(manifest.samples.data(), bound(p), bound(p + 1), model, chooser, out.shape_of.data(),
            &part[p]);
  });
  for (const ShapePart& pt : part) {
    if (pt.exception) std::rethrow_exception(pt.exception);
    if (pt.error_row >= 0) {
      const size_t i = static_cast<size_t>(pt.error_row);
      const std::string id = i < out.ids.size() ? std::to_string(out.ids[i]) : "?";
      throw Error(manifest.source + ": sample id " + id + ": " + pt.error);
    }
  }
  // The parts' shapes in one table, then a deterministic order: sorted by (seq_len, frames,
  // height, width).
  ShapeTable table;
  std::vector<TrainShape> shapes;
  std::vector<std::vector<int32_t>> global(parts);
  for (int p = 0; p < parts; ++p) {
    for (const TrainShape& t : part[p].shapes) global[p].push_back(table.Find(t, &shapes));
  }
  std::vector<int32_t> order(shapes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    const auto& a = shapes[x];
    const auto& b = shapes[y];
    return std::tie(a.seq_len, a.frames, a.height, a.width) <
           std::tie(b.seq_len, b.frames, b.height, b.width);
  });
  std::vector<int32_t> rank(shapes.size());
  out.shapes.resize(shapes.size());
  for (size_t r = 0; r < order.size(); ++r) {
    rank[order[r]] = static_cast<int32_t>(r);
    out.shapes[r] = shapes[order[r]];
  }
  for (auto& g : global) {
    for (int32_t& s : g) s = rank[s];
  }
  // Local -> sorted index, and the counts, part by part.
  std::vector<std::vector<int64_t>> counts(parts, std::vector<int64_t>(shapes.size(), 0));
  RunParts(parts, [&](int p) {
    const int32_t* to = global[p].data();
    int64_t* count = counts[p].data();
    int32_t* shape_of = out.shape_of.data();
    for (int64_t i = bound(p); i < bound(p + 1); ++i) {
      const int32_t s = to[shape_of[i]];
      shape_of[i] = s;
      ++count[s];
    }
  });
  out.count.assign(shapes.size(), 0);
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
