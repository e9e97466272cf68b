// Model presets and the mapping of a raw sample to its training shape and token count.
//
// For a video of F frames at H x W pixels the VAE compresses time by vae_stride_t and space by
// vae_stride_hw, then the transformer patchifies by (patch_t, patch_h, patch_w):
//   latent_frames = 1 + (F - 1) / vae_stride_t         (F obeys the k*vae_stride_t + 1 rule)
//   S = (latent_frames / patch_t) * (H / (vae_stride_hw * patch_h)) * (W / (vae_stride_hw *
//   patch_w))
// Wan 2.1: strides (4, 8, 8), patch (1, 2, 2): S = (1 + (F-1)/4) * (H/16) * (W/16).
// Text tokens (text_tokens) are added when the model attends jointly over text (MMDiT:
// Flux, HunyuanVideo, CogVideoX); cross-attention models (Wan) keep them out of S.
//
// Model-file fields and their ranges (LoadModelFile refuses anything outside, naming the field,
// the value and the range; the bounds keep every product of the shape arithmetic far inside
// int64, and the arithmetic is overflow-checked all the same):
//   hidden [1, 65536]      layers [1, 1024]         heads [1, 65536]      ffn_hidden [1, 2^20]
//   text_tokens [0, 2^20]  params_b [0, 1e5]        target_fps [0, 1000]  max_frames [1, 2^20]
//   vae_stride_t, vae_stride_hw, patch_t, patch_h, patch_w [1, 64]
//   buckets[i] = [height, width], each in [1, 2^20] pixels, multiples of vae_stride_hw * patch
// A training shape's token count S is at most kMaxSeqLen; a sample that would map to more (or
// a raw sample with a non-positive size) is an error (ditscale::Error naming the sample), never
// a wrapped count.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

// Largest token count S of one training sample: 2^30 (a thousand times today's longest DiT
// sequences), so that sums of tokens over a manifest stay within int64.
inline constexpr int64_t kMaxSeqLen = int64_t{1} << 30;

// A training resolution bucket (pixels).
struct Resolution {
  int32_t height = 0;
  int32_t width = 0;
};

struct ModelPreset {
  std::string name;  // "wan2.1-1.3b", "wan2.1-14b", "hunyuanvideo", "cogvideox-5b", "flux"
  // Architecture, used by the analytical cost model (cost_model.h).
  int64_t hidden = 0;       // model width d
  int64_t layers = 0;       // transformer blocks
  int64_t heads = 0;        // attention heads
  int64_t ffn_hidden = 0;   // MLP inner width
  int64_t text_tokens = 0;  // text sequence length (joint attention or cross-attention keys)
  bool joint_text = false;  // true: text tokens join the self-attention sequence (MMDiT)
  double params_b = 0;      // parameter count, billions (memory model default)
  // Shape mapping.
  int32_t vae_stride_t = 4;
  int32_t vae_stride_hw = 8;
  int32_t patch_t = 1;
  int32_t patch_h = 2;
  int32_t patch_w = 2;
  double target_fps = 16;           // videos are resampled to this frame rate (0: keep)
  int32_t max_frames = 81;          // pixel frames after resampling, obeying the 4k+1 rule
  bool images_only = false;         // flux: every sample is treated as an image
  std::vector<Resolution> buckets;  // training resolutions; empty: keep (rounded to 16 px)
};

// The built-in presets, by name; Failure lists the valid names.
Result<ModelPreset> GetModelPreset(const std::string& name);
std::vector<std::string> ModelPresetNames();
// A preset named by "base" (or a built-in name) with any field overridden by a JSON file:
// {"base": "wan2.1-14b", "max_frames": 121, "buckets": [[480, 832], [720, 1280]], ...}.
// Failures name the file and the field.
// Files are read through ReadJsonFile (ditscale/core/json_text.h): syntax errors carry the
// line, duplicate keys and numbers beyond double are refused.
Result<ModelPreset> LoadModelFile(const std::string& path);
// The same from text already in memory; `file` names it in Failures.
Result<ModelPreset> ParseModelFile(std::string_view text, const std::string& file);
// Resolves --model: a preset name, or a path to a JSON model file.
Result<ModelPreset> ResolveModel(const std::string& name_or_path);

// A sample's training shape.
struct TrainShape {
  int32_t frames = 0;  // pixel frames after fps resampling and the max-frames / 4k+1 rule
  int32_t height = 0;  // bucket resolution (pixels)
  int32_t width = 0;
  int64_t seq_len = 0;  // tokens S the transformer sees (incl. joint text tokens)
  bool operator==(const TrainShape&) const = default;
};

// Maps one raw sample to its training shape for a model.
//   frames: images (and every sample of an images_only model) -> 1. A video of F frames at fps
//     above target_fps > 0 is resampled: F' = floor((F - 1) * target_fps / fps) + 1 (else F' = F),
//     then clamped to max_frames and rounded DOWN to k * vae_stride_t + 1.
//   resolution: with buckets, the aspect ratio first, then the area: candidates are the buckets
//     with |log(ar_s / ar_b)| <= min_b |log(ar_s / ar_b)| + 0.05 (ar = H / W); among them the
//     smallest |log(area_s / area_b)| wins (ties: smaller area, then list order). A sample
//     larger than every bucket goes to the largest bucket of its aspect ratio (never upscaled
//     beyond it). Without buckets: H, W rounded down to multiples of vae_stride_hw * patch.
//   seq_len: ceil(latent_frames / patch_t) * (H / (vae_stride_hw * patch_h)) *
//     (W / (vae_stride_hw * patch_w)) + (joint_text ? text_tokens : 0), in overflow-checked
//     int64 arithmetic.
// Throws ditscale::Error when the sample has num_frames, height or width < 1, or a negative or
// non-finite fps, or when S would exceed kMaxSeqLen (or int64).
TrainShape ToTrainShape(const RawSample& s, const ModelPreset& model);

// The manifest grouped by training shape: samples of one shape can share a batch.
struct ShapedManifest {
  std::vector<TrainShape> shapes;  // distinct shapes, sorted by (seq_len, frames, height, width)
  std::vector<int32_t> shape_of;   // per Manifest entry: index into shapes
  std::vector<int64_t> ids;        // per entry: sample id (copied from Manifest::ids)
  std::vector<int64_t> count;      // per shape: number of samples
  // True: entry i has sample id i and `ids` is empty (ReadShapedManifest of a CSV file in which
  // no row was skipped: 80 MB for 10M rows neither written nor read). ShapeManifest never sets it.
  bool ids_dense = false;
  // The sample id of entry i, either way.
  int64_t id(size_t i) const { return ids_dense ? static_cast<int64_t>(i) : ids[i]; }
};
// Throws ditscale::Error as ToTrainShape does, naming the sample id.
// Cost: one small memo lookup per sample keyed by (training frames, height, width); the shape
// rule runs on a miss (a triple not among the last ones seen, internal/shape_mapper.h).
// ReadShapedManifest (shaped_reader.h) does the same while parsing a CSV file. From 2^17 samples
// on, two threads map one half each; the result, and the error (the first bad sample in row order),
// are those of one pass.
ShapedManifest ShapeManifest(const Manifest& manifest, const ModelPreset& model);
// The same, moving manifest.ids into the result instead of copying them (80 MB for 10M rows):
// manifest.ids is left empty, everything else in it untouched.
ShapedManifest ShapeManifest(Manifest&& manifest, const ModelPreset& model);

}  // namespace ditscale::balance
