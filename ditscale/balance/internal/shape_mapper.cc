// The shape rule (bucket choice, token count) and the per-part memo; see shape_mapper.h. The rule
// itself is documented in shapes.cc's header comment.
#include "ditscale/balance/internal/shape_mapper.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ditscale/core/checked_math.h"
#include "ditscale/core/error.h"
#include "ditscale/core/range.h"

namespace ditscale::balance::internal {
namespace {

constexpr double kAspectTolerance = 0.05;

int32_t Align(int32_t v, int32_t unit) { return std::max(unit, v / unit * unit); }

std::string RawText(const RawSample& s) {
  return ditscale::internal::StrCat("(num_frames ", s.num_frames, ", height ", s.height, ", width ",
                                    s.width, ", fps ", FormatNumber(static_cast<double>(s.fps)),
                                    ")");
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

size_t HashShape(const TrainShape& t) {
  uint64_t x = static_cast<uint64_t>(t.seq_len) * 0x9E3779B97F4A7C15ull;
  x ^= (uint64_t(uint32_t(t.frames)) << 40) ^ (uint64_t(uint32_t(t.height)) << 20) ^
       uint64_t(uint32_t(t.width));
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<size_t>(x ^ (x >> 31));
}

// Open-addressing map TrainShape -> dense index into *shapes (distinct shapes are few: tens to
// thousands); `slots` a power of two, at most half full.
int32_t FindOrAdd(const TrainShape& t, std::vector<int32_t>* slots,
                  std::vector<TrainShape>* shapes) {
  size_t mask = slots->size() - 1;
  size_t i = HashShape(t) & mask;
  while ((*slots)[i] >= 0) {
    if ((*shapes)[(*slots)[i]] == t) return (*slots)[i];
    i = (i + 1) & mask;
  }
  const int32_t id = static_cast<int32_t>(shapes->size());
  shapes->push_back(t);
  (*slots)[i] = id;
  if (shapes->size() * 2 > slots->size()) {
    slots->assign(slots->size() * 2, -1);
    mask = slots->size() - 1;
    for (size_t k = 0; k < shapes->size(); ++k) {
      size_t j = HashShape((*shapes)[k]) & mask;
      while ((*slots)[j] >= 0) j = (j + 1) & mask;
      (*slots)[j] = static_cast<int32_t>(k);
    }
  }
  return id;
}

}  // namespace

BucketChooser::BucketChooser(const ModelPreset& model) : model_(model) {
  for (const auto& b : model.buckets) {
    log_ar_.push_back(std::log(static_cast<double>(b.height) / b.width));
    log_area_.push_back(std::log(static_cast<double>(b.height) * b.width));
  }
}

Resolution BucketChooser::Choose(int32_t h, int32_t w) const {
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
        (darea <= best_darea + 1e-12 && int64_t{buckets[i].height} * buckets[i].width <
                                            int64_t{buckets[best].height} * buckets[best].width)) {
      best = i;
      best_darea = darea;
    }
  }
  return buckets[best];
}

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

TrainShape MapSample(const RawSample& s, const BucketChooser& chooser) {
  const ModelPreset& model = chooser.model();
  CheckSample(s, model);
  TrainShape t;
  t.frames = TrainFrames(s, model);
  const Resolution r = chooser.Choose(s.height, s.width);
  t.height = r.height;
  t.width = r.width;
  t.seq_len = SeqLen(t, s, model);
  return t;
}

ShapeMapper::ShapeMapper(const BucketChooser& chooser)
    : chooser_(chooser), frames_(chooser.model()), cache_(2 * kSets), table_(64, -1) {}

int32_t ShapeMapper::MapNew(const RawSample& s, int64_t entry, const Key& key, Entry* set) {
  int32_t v = -1;
  try {
    v = FindOrAdd(MapSample(s, chooser_), &table_, &shapes_);
  } catch (const Error& e) {
    error_entry_ = entry;
    error_ = e.what();
    return -1;
  }
  set[1] = set[0];
  set[0] = Entry{key, v};
  return v;
}

int32_t ShapeMapper::Refuse(const RawSample& s, int64_t entry) {
  try {
    return FindOrAdd(MapSample(s, chooser_), &table_, &shapes_);  // throws for such a sample
  } catch (const Error& e) {
    error_entry_ = entry;
    error_ = e.what();
    return -1;
  }
}

MergedShapes MergeShapes(const std::vector<const std::vector<TrainShape>*>& parts) {
  std::vector<int32_t> slots(64, -1);
  std::vector<TrainShape> shapes;
  std::vector<std::vector<int32_t>> local(parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    for (const TrainShape& t : *parts[p]) local[p].push_back(FindOrAdd(t, &slots, &shapes));
  }
  // A deterministic order: sorted by (seq_len, frames, height, width).
  std::vector<int32_t> order(shapes.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::sort(order.begin(), order.end(), [&](int32_t x, int32_t y) {
    const auto& a = shapes[x];
    const auto& b = shapes[y];
    return std::tie(a.seq_len, a.frames, a.height, a.width) <
           std::tie(b.seq_len, b.frames, b.height, b.width);
  });
  std::vector<int32_t> rank(shapes.size());
  MergedShapes out;
  out.shapes.resize(shapes.size());
  for (size_t r = 0; r < order.size(); ++r) {
    rank[order[r]] = static_cast<int32_t>(r);
    out.shapes[r] = shapes[order[r]];
  }
  for (auto& l : local) {
    for (int32_t& s : l) s = rank[s];
  }
  out.to_global = std::move(local);
  return out;
}

}  // namespace ditscale::balance::internal
