// The raw sample -> training shape rule of shapes.h (ToTrainShape) and its per-part form: a
// ShapeMapper gives the samples of one contiguous part of a manifest dense local shape indices
// (first-seen order) through a small memo; MergeShapes joins the parts' shapes into the sorted
// shape list of ShapedManifest. Used by ShapeManifest (shapes.cc) and by the CSV reader when it
// maps rows while parsing them (shaped_reader.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/balance/manifest.h"
#include "ditscale/balance/shapes.h"

namespace ditscale::balance::internal {

// The bucket rule of shapes.h with the buckets' logs computed once.
class BucketChooser {
 public:
  explicit BucketChooser(const ModelPreset& model);
  // The training resolution of a raw sample of h x w pixels (h, w >= 1).
  Resolution Choose(int32_t h, int32_t w) const;
  const ModelPreset& model() const { return model_; }

 private:
  const ModelPreset& model_;
  std::vector<double> log_ar_, log_area_;
};

// Training frames of a raw sample (shapes.h): fps resampling, max_frames, the k * vae_stride_t + 1
// rule. The sample must pass CheckSample.
inline int32_t TrainFrames(const RawSample& s, const ModelPreset& model);

// Throws ditscale::Error naming the sample when its sizes are < 1 or its fps negative or not
// finite, or the model's strides < 1.
void CheckSample(const RawSample& s, const ModelPreset& model);

// ToTrainShape with a chooser built once (throws as ToTrainShape does).
TrainShape MapSample(const RawSample& s, const BucketChooser& chooser);

// Local shape indices of one part's samples, in the order the samples come. The shape of a new
// (training frames, height, width) triple is computed by MapSample and remembered in a fixed
// 8192-slot table (at most half full, 128 KiB: it stays in cache); once full, a new triple is
// mapped without being kept. The first sample MapSample refuses is kept (entry, message) and
// every later one gets -1.
class ShapeMapper {
 public:
  explicit ShapeMapper(const BucketChooser& chooser);
  // The local index of s, the `entry`-th sample of the part; -1 once a sample was refused.
  int32_t Map(const RawSample& s, int64_t entry) {
    if (error_entry_ >= 0) [[unlikely]] {
      return -1;
    }
    if (!(s.num_frames >= 1 && s.height >= 1 && s.width >= 1 && s.fps >= 0 && s.fps <= kFiniteFps))
        [[unlikely]] {
      return Refuse(s, entry);
    }
    const auto frames = static_cast<uint32_t>(TrainFrames(s, chooser_.model()));
    const auto h = static_cast<uint32_t>(s.height), w = static_cast<uint32_t>(s.width);
    for (size_t i = Hash(frames, h, w) & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
      const Slot& x = slots_[i];
      if (x.value < 0) return MapNew(s, entry, frames, h, w, i);
      if (x.frames == frames && x.height == h && x.width == w) return x.value;
    }
  }
  // The distinct shapes of the part, in first-seen order (index = local index).
  const std::vector<TrainShape>& shapes() const { return shapes_; }
  // The first refused sample's entry (-1: none) and the reason.
  int64_t error_entry() const { return error_entry_; }
  const std::string& error() const { return error_; }

 private:
  struct Slot {
    uint32_t frames = 0, height = 0, width = 0;
    int32_t value = -1;  // -1: empty
  };
  static constexpr size_t kSlots = 8192;
  static constexpr float kFiniteFps = 3.4028234663852886e38f;  // FLT_MAX: rejects inf and NaN
  static size_t Hash(uint32_t f, uint32_t h, uint32_t w) {
    const uint64_t hw = static_cast<uint64_t>(h) << 32 | w;
    const uint64_t x =
        hw * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(f) * 0xBF58476D1CE4E5B9ull;
    return static_cast<size_t>(x ^ (x >> 29));
  }
  int32_t MapNew(const RawSample& s, int64_t entry, uint32_t frames, uint32_t h, uint32_t w,
                 size_t slot);
  int32_t Refuse(const RawSample& s, int64_t entry);
  int32_t FindShape(const TrainShape& t);

  const BucketChooser& chooser_;
  std::vector<Slot> slots_;
  size_t memo_size_ = 0;
  std::vector<int32_t> table_;  // open addressing TrainShape -> local index (power of two)
  std::vector<TrainShape> shapes_;
  int64_t error_entry_ = -1;
  std::string error_;
};

// The parts' shapes joined: `shapes` sorted by (seq_len, frames, height, width), and for each
// part its local index -> index into `shapes`.
struct MergedShapes {
  std::vector<TrainShape> shapes;
  std::vector<std::vector<int32_t>> to_global;
};
MergedShapes MergeShapes(const std::vector<const std::vector<TrainShape>*>& parts);

inline int32_t TrainFrames(const RawSample& s, const ModelPreset& model) {
  if (model.images_only || s.num_frames <= 1) return 1;
  int64_t f = s.num_frames;
  if (model.target_fps > 0 && s.fps > model.target_fps) {
    f = static_cast<int64_t>(std::floor((f - 1) * model.target_fps / s.fps + 1e-9)) + 1;
  }
  f = std::min<int64_t>(f, std::max(1, model.max_frames));
  const int64_t st = std::max(1, model.vae_stride_t);
  return static_cast<int32_t>((f - 1) / st * st + 1);
}

}  // namespace ditscale::balance::internal
