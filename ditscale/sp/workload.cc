#include "ditscale/sp/workload.h"

#include <cmath>
#include <sstream>

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

Failure Bad(const std::string& field, const std::string& msg) { return Failure{msg, "", 0, field}; }

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

Result<bool> Workload::Validate() const {
  if (batch <= 0) return Bad("batch", "must be >= 1");
  if (tokens <= 0) return Bad("tokens", "must be >= 1");
  if (text_tokens < 0) return Bad("text_tokens", "must be >= 0");
  if (heads <= 0) return Bad("heads", "must be >= 1");
  if (kv_heads <= 0 || heads % kv_heads != 0) {
    return Bad("kv_heads", "must be >= 1 and divide heads (" + std::to_string(heads) + ")");
  }
  if (head_dim <= 0) return Bad("head_dim", "must be >= 1");
  if (dtype_bytes <= 0) return Bad("dtype_bytes", "must be >= 1");
  if (layers <= 0) return Bad("layers", "must be >= 1");
  if (!(linear_flops_per_token_per_layer >= 0)) {
    return Bad("linear_flops_per_token_per_layer", "must be >= 0");
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
  int h = o.height > 0 ? o.height : spec->default_h;
  int w = o.width > 0 ? o.width : spec->default_w;
  if (o.height < 0 || h % 16 != 0) return Bad("height", "must be a positive multiple of 16");
  if (o.width < 0 || w % 16 != 0) return Bad("width", "must be a positive multiple of 16");
  if (o.batch <= 0) return Bad("batch", "must be >= 1");
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
    if (o.duration_s < 0 || !std::isfinite(o.duration_s)) return Bad("duration_s", "must be > 0");
    if (o.frames < 0) return Bad("frames", "must be >= 1");
    int64_t frames = 0;
    if (o.frames > 0) {
      frames = o.frames;
    } else if (o.duration_s > 0) {
      frames = std::llround(o.duration_s * spec->fps) + 1;
    } else if (spec->default_frames > 0) {
      frames = spec->default_frames;
    } else {
      frames = std::llround(spec->default_duration_s * spec->fps) + 1;
    }
    wl.tokens = LatentFrames(frames) * per_frame;
  }
  return wl;
}

}  // namespace ditscale::sp
