// One attention layer of a DiT, and the per-layer linear work, for sequence-parallel planning.
//
// Token counts (all models use a VAE with 8x spatial down-sampling and a 2x2 patch, so one
// latent frame of an H x W video has (H/16) * (W/16) tokens; video VAEs compress time 4x):
//   flux:          tokens = (H/16) * (W/16)                 3072^2 -> 36864, 4096^2 -> 65536
//   cogvideox-*:   frames F = 8 * duration_s + 1 (8 fps), latent frames 1 + (F-1)/4,
//                  tokens = latent_frames * (H/16) * (W/16); 480x720 -> 1350 per latent frame;
//                  6 s -> 49 frames -> 13 latent -> 17550; 20 s -> 41 latent -> 55350;
//                  40 s -> 81 latent -> 109350
//   wan2.1-14b:    16 fps, same formula; 720x1280, 5 s -> 81 frames -> 21 latent -> 75600
//   hunyuanvideo:  24 fps, same formula; 720x1280 (3600 tokens per latent frame)
// When duration_s * fps is not an integer the frame count is rounded to the nearest; when F-1
// is not a multiple of 4 it is rounded UP to the next 4k+1 (what the pipelines pad to).
//
// Model constants (from the models' public configs):
//   flux         24 heads x 128, hidden 3072, 19 double + 38 single blocks = 57 attention
//                layers, 512 joint (MMDiT) text tokens; linear 24 * hidden^2 FLOPs per token
//                per layer (QKV 3h^2 + out h^2 + MLP 8h^2 multiply-adds; single blocks' fused
//                QKV+MLP-in (7h^2) + out (5h^2) is the same 12h^2).
//   cogvideox-5b 48 heads x 64, hidden 3072, 42 layers, 226 joint text tokens, MLP ratio 4.
//   cogvideox-2b 30 heads x 64, hidden 1920, 30 layers, 226 joint text tokens (30 heads: the
//                uneven-head case on 4 or 8 Ulysses ranks).
//   wan2.1-14b   40 heads x 128, hidden 5120, FFN 13824, 40 layers, text enters through
//                cross-attention (text_tokens = 0 in self-attention); linear = 2*(6 h^2 +
//                2 h * 13824) + cross-attention 4 * 512 * h FLOPs per token.
//   hunyuanvideo 24 heads x 128, hidden 3072, 20 double + 40 single = 60 layers, 256 joint text
//                tokens, 24 fps, MLP ratio 4.
// All dtype_bytes = 2 (bf16).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::sp {

struct Workload {
  std::string model;
  int batch = 1;
  int64_t tokens = 0;       // image/video tokens S, split across ranks by sequence parallelism
  int64_t text_tokens = 0;  // joint text tokens (MMDiT): every rank attends to all of them
  int heads = 0;            // query heads H
  int kv_heads = 0;         // key/value heads (== heads unless GQA)
  int head_dim = 0;
  int dtype_bytes = 2;
  int hidden = 0;
  int layers = 0;  // attention layers per forward pass (one denoising step)
  double linear_flops_per_token_per_layer = 0;

  // Self-attention FLOPs of one layer, forward: 4 * batch * heads * head_dim * (S+T)^2
  // (QK^T and PV, 2 FLOPs per multiply-add), T = text_tokens.
  double AttentionFlops() const;
  // Linear FLOPs of one layer: batch * (S + T) * linear_flops_per_token_per_layer.
  double LinearFlops() const;
  // Bytes of one of Q, K, V or O for the full sequence: batch * (S+T) * heads * head_dim * e.
  double QkvoBytes() const;
  // One line, e.g. "flux 4096x4096: S=65536 +512 text, 24x128 heads, 57 layers, b=1".
  std::string Describe() const;
  // Sizes in their ranges (the limits below: batch, tokens, text_tokens, heads, kv_heads dividing
  // heads, head_dim, dtype_bytes in [1, 8], layers, a finite linear FLOP count >= 0); the
  // failure names the field, the value and the range.
  Result<bool> Validate() const;
};

// Size limits (MakeWorkload and Workload::Validate check them before anything is sized by them;
// a value out of range fails naming the field, the value and the range):
inline constexpr int kMaxImageSide = 16384;    // height, width: pixels, multiples of 16
inline constexpr int kMaxFrames = 16384;       // video frames (after rounding to 4k + 1)
inline constexpr double kMaxDurationS = 3600;  // video seconds
inline constexpr int kMaxBatch = 1024;
inline constexpr int64_t kMaxTokens = 1 << 24;  // image/video tokens S (and text tokens T)
inline constexpr int kMaxHeads = 1024;          // heads, kv_heads
inline constexpr int kMaxHeadDim = 1024;
inline constexpr int kMaxLayers = 10000;

// Options for a preset. Zero means the model's default (flux 1024x1024; cogvideox 480x720, 6 s;
// wan2.1 720x1280, 5 s; hunyuanvideo 720x1280, 129 frames); a given value must lie in its range:
struct WorkloadOptions {
  int height = 0;         // 0 or a multiple of 16 in [16, kMaxImageSide]
  int width = 0;          // 0 or a multiple of 16 in [16, kMaxImageSide]
  double duration_s = 0;  // video models only: 0 or (0, kMaxDurationS]
  int frames = 0;         // video models only; overrides duration_s: 0 or [1, kMaxFrames]
  int batch = 1;          // [1, kMaxBatch]
};

// {"flux", "cogvideox-5b", "cogvideox-2b", "wan2.1-14b", "hunyuanvideo"}.
std::vector<std::string> WorkloadPresetNames();

// Builds a preset's workload. Failures (unknown model, height not a multiple of 16, ...) name
// the option: "column 'height': must be a positive multiple of 16".
Result<Workload> MakeWorkload(const std::string& model, const WorkloadOptions& options);

// The attention layer of `w` as the schedule builders take it (batch, S, T, heads, kv heads,
// head dim, dtype bytes).
AttentionShape ToAttentionShape(const Workload& w);

// Video latent frames for `frames` pixel frames: 1 + ceil((frames-1)/4).
int64_t LatentFrames(int64_t frames);

}  // namespace ditscale::sp
