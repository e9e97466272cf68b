// Strategy names, config resolution and the BuildSchedule entry point.
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "ditscale/core/checked_math.h"
#include "ditscale/core/range.h"
#include "ditscale/sp/internal/hybrid.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::sp {
namespace {

Failure Bad(const std::string& column, const std::string& message) {
  return Failure::InvalidArgument(message, column);
}

}  // namespace

const std::vector<std::string>& StrategyNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (Strategy s : kAllStrategies) v.emplace_back(StrategyName(s));
    return v;
  }();
  return names;
}

std::vector<int64_t> EvenSplit(int64_t n, int parts) {
  DS_CHECK(parts >= 1 && n >= 0, "EvenSplit(", n, ", ", parts, ")");
  std::vector<int64_t> out(parts, n / parts);
  for (int64_t p = 0; p < n % parts; ++p) ++out[p];
  return out;
}

RankCoords CoordsOfRank(const SpConfig& c, int rank) {
  if (c.placement == Placement::kUlyssesOuter) {
    return RankCoords{rank / c.ring_degree, rank % c.ring_degree};
  }
  return RankCoords{rank % c.ulysses_degree, rank / c.ulysses_degree};
}

int RankOfCoords(const SpConfig& c, int u, int i) {
  if (c.placement == Placement::kUlyssesOuter) return u * c.ring_degree + i;
  return i * c.ulysses_degree + u;
}

namespace {

// The degrees: 0 = the strategy's default; their product is the mesh's ranks.
std::optional<Failure> ResolveDegrees(const SpMesh& mesh, const std::string& name, SpConfig& c) {
  const Strategy st = c.strategy;
  const int n = mesh.ranks();
  if (c.ulysses_degree < 0) return Bad("ulysses_degree", "must be >= 0 (0 = default)");
  if (c.ring_degree < 0) return Bad("ring_degree", "must be >= 0 (0 = default)");
  if (st == Strategy::kUlysses || st == Strategy::kUlyssesOverlap) {
    if (c.ring_degree > 1) {
      return Bad("ring_degree", "strategy " + name + " has ring_degree 1");
    }
    c.ulysses_degree = c.ulysses_degree ? c.ulysses_degree : n;
    c.ring_degree = 1;
  } else if (st == Strategy::kRing) {
    if (c.ulysses_degree > 1) return Bad("ulysses_degree", "strategy ring has ulysses_degree 1");
    c.ring_degree = c.ring_degree ? c.ring_degree : n;
    c.ulysses_degree = 1;
  } else {
    const int def_u = st == Strategy::kUsp ? mesh.gpus_per_machine : mesh.machines;
    if (c.ulysses_degree == 0 && c.ring_degree == 0) c.ulysses_degree = def_u;
    if (c.ulysses_degree == 0) c.ulysses_degree = c.ring_degree > 0 ? n / c.ring_degree : def_u;
    if (c.ring_degree == 0) c.ring_degree = n / std::max(1, c.ulysses_degree);
  }
  if (c.ulysses_degree * c.ring_degree != n) {
    return Bad("ulysses_degree", "ulysses_degree " + std::to_string(c.ulysses_degree) +
                                     " x ring_degree " + std::to_string(c.ring_degree) +
                                     " != " + std::to_string(n) + " ranks of the mesh");
  }
  return std::nullopt;
}

// The chunk counts and the other SpConfig fields.
std::optional<Failure> CheckChunksAndFields(const std::string& name, const SpConfig& c) {
  const Strategy st = c.strategy;
  if (auto e =
          RangeError("torus_chunks", static_cast<long long>(c.torus_chunks), 1, kMaxTorusChunks)) {
    return Bad("torus_chunks", e->substr(std::string("torus_chunks: ").size()));
  }
  if (auto e = RangeError("ulysses_chunks", static_cast<long long>(c.ulysses_chunks), 1,
                          kMaxUlyssesChunks)) {
    return Bad("ulysses_chunks", e->substr(std::string("ulysses_chunks: ").size()));
  }
  if (c.torus_chunks > 1 && st != Strategy::kTorus) {
    return Bad("torus_chunks", std::to_string(c.torus_chunks) +
                                   " token chunks: only torus cuts its all-to-all into token "
                                   "chunks, not " +
                                   name);
  }
  if (c.ulysses_chunks > 1 && st != Strategy::kUlysses) {
    return Bad("ulysses_chunks", std::to_string(c.ulysses_chunks) +
                                     " head chunks: only ulysses cuts its head group into "
                                     "chunks, not " +
                                     name);
  }
  if (c.attention_slots < 0) return Bad("attention_slots", "must be >= 0 (0 = no alignment)");
  if (c.attention_tile_tokens < 1) return Bad("attention_tile_tokens", "must be >= 1");
  if (c.comm_sms < 0) return Bad("comm_sms", "must be >= 0 (0 = the whole GPU for compute)");
  if (c.ulysses_chunks > 1 && c.ulysses_degree < 2) {
    return Bad("ulysses_chunks",
               "head chunks need ulysses_degree >= 2 (one rank has no all-to-all)");
  }
  return std::nullopt;
}

// The attention shape against the resolved configuration, and the schedule's size.
std::optional<Failure> CheckShape(const SpMesh& mesh, const std::string& name, const SpConfig& c,
                                  const AttentionShape& shape) {
  const int n = mesh.ranks();
  if (shape.batch < 1) return Bad("batch", "must be >= 1");
  if (shape.seq_tokens < n) {
    return Bad("seq_tokens", "needs at least one image token per rank (" + std::to_string(n) +
                                 " ranks, " + std::to_string(shape.seq_tokens) + " tokens)");
  }
  if (shape.text_tokens < 0) return Bad("text_tokens", "must be >= 0");
  if (shape.heads < 1) return Bad("heads", "must be >= 1");
  if (shape.kv_heads < 0) return Bad("kv_heads", "must be >= 0 (0 = heads)");
  const int64_t kvh = shape.kv_heads_or_heads();
  if (shape.heads % kvh != 0) return Bad("kv_heads", "must divide heads");
  if (kvh < c.ulysses_degree) {
    return Bad("ulysses_degree", "ulysses_degree " + std::to_string(c.ulysses_degree) +
                                     " exceeds the " + std::to_string(kvh) +
                                     " kv heads (each Ulysses rank needs at least one)");
  }
  if (c.ulysses_chunks > kvh / c.ulysses_degree) {
    return Bad("ulysses_chunks", "ulysses in " + std::to_string(c.ulysses_chunks) +
                                     " head chunks needs >= " + std::to_string(c.ulysses_chunks) +
                                     " kv heads per Ulysses rank; the smallest group has " +
                                     std::to_string(kvh / c.ulysses_degree));
  }
  if (shape.head_dim < 1) return Bad("head_dim", "must be >= 1");
  if (shape.dtype_bytes < 1) return Bad("dtype_bytes", "must be >= 1");
  int64_t rank_tokens = 0;
  if (!MulFits(n, shape.seq_tokens + shape.text_tokens, &rank_tokens) ||
      rank_tokens > kMaxRankTokens) {
    return Bad("seq_tokens", std::to_string(shape.seq_tokens + shape.text_tokens) + " tokens on " +
                                 std::to_string(n) + " ranks exceed the schedule limit of " +
                                 std::to_string(kMaxRankTokens) + " rank-tokens");
  }
  const int64_t ops = ScheduleOpsEstimate(c, shape);
  if (ops > kMaxScheduleOps) {
    return Bad("schedule", "about " + std::to_string(ops) + " ops (" + name +
                               " U=" + std::to_string(c.ulysses_degree) +
                               " R=" + std::to_string(c.ring_degree) + " chunks=" +
                               std::to_string(std::max(c.torus_chunks, c.ulysses_chunks)) +
                               ") exceed the limit of " + std::to_string(kMaxScheduleOps) +
                               " ops of one schedule: use fewer ranks, a smaller ring degree or "
                               "fewer chunks");
  }
  return std::nullopt;
}

}  // namespace

Result<SpConfig> ResolveConfig(const SpMesh& mesh, const SpConfig& config,
                               const AttentionShape& shape) {
  SpConfig c = config;
  if (std::find(kAllStrategies.begin(), kAllStrategies.end(), c.strategy) == kAllStrategies.end()) {
    return Bad("strategy", "no strategy numbered " + std::to_string(static_cast<int>(c.strategy)) +
                               " (" + StrategyNameList() + ")");
  }
  const Strategy st = c.strategy;
  const std::string name(StrategyName(st));
  if (mesh.machines < 1) return Bad("machines", "must be >= 1");
  if (mesh.gpus_per_machine < 1) return Bad("gpus_per_machine", "must be >= 1");
  if (auto f = ResolveDegrees(mesh, name, c)) return *f;
  // The scope of one-sided transfers means nothing for two-sided transport: one canonical form.
  if (!c.one_sided) c.one_sided_inter = true;
  if (auto f = CheckChunksAndFields(name, c)) return *f;
  if (c.placement == Placement::kStrategyDefault) {
    c.placement = (st == Strategy::kSwiftFusionTas || st == Strategy::kTorus)
                      ? Placement::kUlyssesOuter
                      : Placement::kUlyssesInner;
  }
  if (auto f = CheckShape(mesh, name, c, shape)) return *f;
  return c;
}

int64_t ScheduleOpsEstimate(const SpConfig& c, const AttentionShape& shape) {
  const int64_t n = int64_t{c.ulysses_degree} * c.ring_degree;
  const int64_t u = c.ulysses_degree, r = c.ring_degree;
  const bool torus = c.strategy == Strategy::kTorus, ulysses = c.strategy == Strategy::kUlysses;
  const int64_t ch = torus ? c.torus_chunks : ulysses ? c.ulysses_chunks : 1;
  const bool chunked = ch > 1 && u > 1;
  const int64_t cu = chunked ? ch : 1;
  const int64_t cr = chunked && torus ? ch + 1 : 1;
  // Every term is bounded by the argument checks above (ranks <= 2^31, chunks <= 64), but the
  // estimate is computed in doubles and saturated anyway.
  double ops =
      double(n) * (12.0 * double(u - 1) * double(cu) + 6.0 * double(r - 1) * double(cr) + 8);
  if (shape.text_tokens > 0) ops += 2.0 * double(n) * double(n - 1);
  if (!(ops < 9.2e18)) return INT64_MAX;
  return static_cast<int64_t>(ops);
}

Result<Schedule> BuildSchedule(const SpMesh& mesh, const SpConfig& config,
                               const AttentionShape& shape) {
  Result<SpConfig> resolved = ResolveConfig(mesh, config, shape);
  if (!resolved.ok()) return resolved.failure();
  try {
    return internal::HybridBuilder(mesh, *resolved, shape).Build();
  } catch (const internal::ScheduleTooLarge& e) {
    return Bad("schedule", e.what());
  }
}

}  // namespace ditscale::sp
