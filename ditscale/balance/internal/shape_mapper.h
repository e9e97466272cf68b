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

#include "ditscale/balance/internal/fast_floor.h"
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

// TrainFrames with the model's constants taken once (the same value for every sample): the
// stride division is a shift when vae_stride_t is a power of two.
class FrameRule {
 public:
  explicit FrameRule(const ModelPreset& model)
      : images_only_(model.images_only),
        target_fps_(model.target_fps),
        max_frames_(std::max(1, model.max_frames)),
        stride_(std::max(1, model.vae_stride_t)),
        shift_((stride_ & (stride_ - 1)) == 0 ? __builtin_ctzll(static_cast<uint64_t>(stride_))
                                              : -1) {}
  int32_t operator()(const RawSample& s) const {
    if (images_only_ || s.num_frames <= 1) return 1;
    int64_t f = s.num_frames;
    if (target_fps_ > 0 && s.fps > target_fps_) {
      f = static_cast<int64_t>(FastFloor((f - 1) * target_fps_ / s.fps + 1e-9)) + 1;
    }
    f = std::min<int64_t>(f, max_frames_);
    const int64_t k = shift_ >= 0 ? (f - 1) >> shift_ << shift_ : (f - 1) / stride_ * stride_;
    return static_cast<int32_t>(k + 1);
  }

 private:
  bool images_only_;
  double target_fps_;
  int64_t max_frames_, stride_;
  int shift_;
};

// Local shape indices of one part's samples, in the order the samples come. The training shape
// is a function of (training frames, height, width); the last few triples seen are remembered in
// a small 2-way set-associative cache (kSets sets of two 16-byte entries, 32 KiB: it stays in
// the first-level cache beside the parser's data), the most recent first in its set, so that
// the few triples of most samples hit while a stream of one-off triples (images of random sizes)
// only evicts. A miss runs MapSample and finds the shape in the part's table. The first sample
// MapSample refuses is kept (entry, message) and every later one gets -1.
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
    const Key key{static_cast<uint32_t>(frames_(s)), static_cast<uint32_t>(s.height),
                  static_cast<uint32_t>(s.width)};
    Entry* set = &cache_[2 * (Hash(key) & (kSets - 1))];
    if (set[0].value >= 0 && set[0].key == key) return set[0].value;
    if (set[1].value >= 0 && set[1].key == key) return set[1].value;
    return MapNew(s, entry, key, set);
  }
  // The distinct shapes of the part, in first-seen order (index = local index).
  const std::vector<TrainShape>& shapes() const { return shapes_; }
  // The first refused sample's entry (-1: none) and the reason.
  int64_t error_entry() const { return error_entry_; }
  const std::string& error() const { return error_; }

 private:
  struct Key {
    uint32_t frames = 0, height = 0, width = 0;
    bool operator==(const Key&) const = default;
  };
  struct Entry {
    Key key;
    int32_t value = -1;  // -1: empty
  };
  static constexpr size_t kSets = 1024;
  static constexpr float kFiniteFps = 3.4028234663852886e38f;  // FLT_MAX: rejects inf and NaN
  static size_t Hash(const Key& k) {
    const uint64_t hw = static_cast<uint64_t>(k.height) << 32 | k.width;
    const uint64_t x =
        hw * 0x9E3779B97F4A7C15ull ^ static_cast<uint64_t>(k.frames) * 0xBF58476D1CE4E5B9ull;
    return static_cast<size_t>(x ^ (x >> 29));
  }
  int32_t MapNew(const RawSample& s, int64_t entry, const Key& key, Entry* set);
  int32_t Refuse(const RawSample& s, int64_t entry);

  const BucketChooser& chooser_;
  FrameRule frames_;
  std::vector<Entry> cache_;    // kSets * 2
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
