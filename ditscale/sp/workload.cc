#include "ditscale/sp/workload.h"

#include <cmath>
#include <optional>
#include <sstream>

#include "ditscale/core/range.h"

namespace ditscale::sp {
namespace {

struct ModelSpec {
  const char* name;
  bool video;
  int heads, head_dim, hidden, layers, text_tokens;
  double fps;
  int default_h, default_w;
  double default_duration_s;  // 0 for images
  int default_frames;         // overrides default_duration_s when > 0
  double linear_flops_per_token;
};

double DenseLinear(double h) { return 24.0 * h * h; }

const std::vector<ModelSpec>& Specs() {
  static const std::vector<ModelSpec> specs = {
      {"flux", false, 24, 128, 3072, 57, 512, 0, 1024, 1024, 0, 0, DenseLinear(3072)},
      {"cogvideox-5b", true, 48, 64, 3072, 42, 226, 8, 480, 720, 6, 0, DenseLinear(3072)},
      {"cogvideox-2b", true, 30, 64, 1920, 30, 226, 8, 480, 720, 6, 0, DenseLinear(1920)},
      {"wan2.1-14b", true, 40, 128, 5120, 40, 0, 16, 720, 1280, 5, 0,
       2.0 * (6.0 * 5120 * 5120 + 2.0 * 5120 * 13824) + 4.0 * 512 * 5120},
      {"hunyuanvideo", true, 24, 128, 3072, 60, 256, 24, 720, 1280, 0, 129, DenseLinear(3072)},
  };
  return specs;
}

Failure Bad(const std::string& field, const std::string& msg) {
  return Failure::InvalidArgument(msg, field);
}

}  // namespace

double Workload::AttentionFlops() const {
  double n = static_cast<double>(tokens + text_tokens);
  return 4.0 * batch * heads * head_dim * n * n;
}

double Workload::LinearFlops() const {
  return static_cast<double>(batch) * static_cast<double>(tokens + text_tokens) *
         linear_flops_per_token_per_layer;
}

double Workload::QkvoBytes() const {
  return static_cast<double>(batch) * static_cast<double>(tokens + text_tokens) * heads * head_dim *
         dtype_bytes;
}

std::string Workload::Describe() const {
  std::ostringstream os;
  os << model << ": S=" << tokens;
  if (text_tokens > 0) os << " +" << text_tokens << " text";
  os << ", " << heads << "x" << head_dim << " heads";
  if (kv_heads != heads) os << " (" << kv_heads << " kv)";
  os << ", " << layers << " layers, batch " << batch;
  return os.str();
}

namespace {

// "v is out of range [lo, hi]" for field `name`, or nullopt.
std::optional<Failure> RangeReal(const char* name, double v, double lo, double hi) {
  auto e = RangeError(name, v, lo, hi);
  if (!e) return std::nullopt;
  return Bad(name, e->substr(std::string(name).size() + 2));
}

std::optional<Failure> Range(const char* name, long long v, long long lo, long long hi) {
  auto e = RangeError(name, v, lo, hi);
  if (!e) return std::nullopt;
  return Bad(name, e->substr(std::string(name).size() + 2));
}

}  // namespace

Result<bool> Workload::Validate() const {
  if (auto f = Range("batch", batch, 1, kMaxBatch)) return *f;
  if (auto f = Range("tokens", tokens, 1, kMaxTokens)) return *f;
  if (auto f = Range("text_tokens", text_tokens, 0, kMaxTokens)) return *f;
  if (auto f = Range("heads", heads, 1, kMaxHeads)) return *f;
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    return Bad("kv_heads", "must be >= 1 and divide heads (" + std::to_string(heads) + "), got " +
                               std::to_string(kv_heads));
  }
  if (auto f = Range("head_dim", head_dim, 1, kMaxHeadDim)) return *f;
  if (auto f = Range("dtype_bytes", dtype_bytes, 1, 8)) return *f;
  if (auto f = Range("layers", layers, 1, kMaxLayers)) return *f;
  if (auto f = RangeReal("linear_flops_per_token_per_layer", linear_flops_per_token_per_layer, 0,
                         1e18)) {
    return *f;
  }
  return true;
}

std::vector<std::string> WorkloadPresetNames() {
  std::vector<std::string> names;
  for (const auto& s : Specs()) names.push_back(s.name);
  return names;
}

AttentionShape ToAttentionShape(const Workload& w) {
  AttentionShape a;
  a.batch = w.batch;
  a.seq_tokens = w.tokens;
  a.text_tokens = w.text_tokens;
  a.heads = w.heads;
  a.kv_heads = w.kv_heads;
  a.head_dim = w.head_dim;
  a.dtype_bytes = w.dtype_bytes;
  return a;
}

int64_t LatentFrames(int64_t frames) {
  DS_CHECK(frames >= 1, "frames must be >= 1, got ", frames);
  return 1 + (frames - 1 + 3) / 4;
}

namespace {

// A given size must lie in its range; 0 = the model's default (never a silent fallback for a
// negative value).
std::optional<Failure> CheckSide(const char* name, int v) {
  if (v == 0) return std::nullopt;
  if (auto f = Range(name, v, 16, kMaxImageSide)) {
    f->message += " (0 = the model's default)";
    return f;
  }
  if (v % 16 != 0) return Bad(name, std::to_string(v) + " is not a multiple of 16");
  return std::nullopt;
}

// A video model's frames: --frames, else --duration-s at the model's fps, else its default.
Result<int64_t> VideoFrames(const ModelSpec& spec, const WorkloadOptions& o) {
  if (o.duration_s != 0) {
    if (auto f = RangeReal("duration_s", o.duration_s, 1e-3, kMaxDurationS)) {
      f->message += " (0 = the model's default)";
      return *f;
    }
  }
  if (o.frames != 0) {
    if (auto f = Range("frames", o.frames, 1, kMaxFrames)) {
      f->message += " (0 = the model's default)";
      return *f;
    }
  }
  if (o.frames > 0) return static_cast<int64_t>(o.frames);
  if (o.duration_s > 0) {
    const int64_t frames = std::llround(o.duration_s * spec.fps) + 1;
    if (frames > kMaxFrames) {
      return Bad("duration_s", FormatNumber(o.duration_s) + " s at " + FormatNumber(spec.fps) +
                                   " fps is " + std::to_string(frames) +
                                   " frames, over the limit of " + std::to_string(kMaxFrames));
    }
    return frames;
  }
  if (spec.default_frames > 0) return static_cast<int64_t>(spec.default_frames);
  return static_cast<int64_t>(std::llround(spec.default_duration_s * spec.fps) + 1);
}

}  // namespace

Result<Workload> MakeWorkload(const std::string& model, const WorkloadOptions& o) {
  const ModelSpec* spec = nullptr;
  for (const auto& s : Specs()) {
    if (model == s.name) spec = &s;
  }
  if (spec == nullptr) {
    std::string known;
    for (const auto& n : WorkloadPresetNames()) known += (known.empty() ? "" : ", ") + n;
    return Bad("model", "unknown model '" + model + "' (known: " + known + ")");
  }
  if (auto f = CheckSide("height", o.height)) return *f;
  if (auto f = CheckSide("width", o.width)) return *f;
  if (auto f = Range("batch", o.batch, 1, kMaxBatch)) return *f;
  const int h = o.height > 0 ? o.height : spec->default_h;
  const int w = o.width > 0 ? o.width : spec->default_w;
  int64_t per_frame = static_cast<int64_t>(h / 16) * (w / 16);

  Workload wl;
  wl.model = spec->name;
  wl.batch = o.batch;
  wl.heads = wl.kv_heads = spec->heads;
  wl.head_dim = spec->head_dim;
  wl.hidden = spec->hidden;
  wl.layers = spec->layers;
  wl.text_tokens = spec->text_tokens;
  wl.dtype_bytes = 2;
  wl.linear_flops_per_token_per_layer = spec->linear_flops_per_token;
  if (!spec->video) {
    if (o.duration_s != 0)
      return Bad("duration_s", "is for video models; " + model + " is an image model");
    if (o.frames != 0) return Bad("frames", "is for video models; " + model + " is an image model");
    wl.tokens = per_frame;
  } else {
    Result<int64_t> frames = VideoFrames(*spec, o);
    if (!frames.ok()) return frames.failure();
    wl.tokens = LatentFrames(*frames) * per_frame;
  }
  if (wl.tokens > kMaxTokens) {
    return Bad(spec->video ? "frames" : "height",
               std::to_string(wl.tokens) + " tokens (" + std::to_string(h) + "x" +
                   std::to_string(w) +
                   (spec->video ? ", " + std::to_string(wl.tokens / per_frame) + " latent frames"
                                : std::string()) +
                   ") exceed the limit of " + std::to_string(kMaxTokens) + " tokens");
  }
  return wl;
}

}  // namespace ditscale::sp
