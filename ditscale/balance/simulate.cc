#include "ditscale/balance/simulate.h"

#include <algorithm>
#include <cmath>

#include "ditscale/balance/internal/buckets.h"
#include "ditscale/balance/internal/prng.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/checked_math.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {

namespace {

// The cost of rank r in step k (simulate.h); counts the micro-batches, samples and tokens of
// its first uses into *out (seen: micro-batches already counted).
double RankCost(const Plan& plan, const ShapedManifest& shaped, const CostModel& cost,
                const SimOptions& options, const std::vector<double>& work_of_shape, int64_t k,
                int64_t r, std::vector<uint8_t>& seen, SimResult* out) {
  const int64_t w = plan.world_size;
  const int64_t num_shapes = static_cast<int64_t>(shaped.shapes.size());
  const double sigma = options.noise_sigma;
  const int64_t b = plan.rank_offsets[k * w + r], e = plan.rank_offsets[k * w + r + 1];
  double cost_r = 0;
  for (int64_t i = b; i < e; ++i) {
    const int64_t m = plan.work[i];
    const MicroBatch& mb = plan.micro_batches[m];
    DS_CHECK(mb.shape >= 0 && mb.shape < num_shapes, "micro-batch ", m, " has shape ", mb.shape,
             " but the manifest has ", num_shapes, " shapes");
    const int64_t n = mb.end - mb.begin;
    double term = cost.a_mb + static_cast<double>(n) * work_of_shape[mb.shape];
    int slot = 0;
    if (mb.sp_degree != 1) {
      slot = SpSlot(mb.sp_degree);
      const size_t at = static_cast<size_t>(mb.shape) * kSpDegreeSlots + slot;
      DS_CHECK(
          mb.sp_degree > 1 && mb.sp_degree <= kMaxSpDegree && at < plan.sp_comm_per_sample_s.size(),
          "micro-batch ", m, " has sequence-parallel degree ", mb.sp_degree,
          " without a communication table in the plan");
      const double comm = static_cast<double>(n) * plan.sp_comm_per_sample_s[at];
      term = cost.SpMicroBatchTime(n, shaped.shapes[mb.shape].seq_len, mb.sp_degree, 0) + comm;
      out->comm_s += comm;
    }
    if (sigma > 0) {
      internal::SplitMix64 rng(internal::StreamKey(options.noise_seed, plan.epoch,
                                                   internal::kSimNoise, static_cast<uint64_t>(i)));
      term *= std::exp(sigma * rng.Normal() - 0.5 * sigma * sigma);
    }
    cost_r += term;
    ++out->micro_batches;
    if (!seen[m]) {
      seen[m] = 1;
      out->samples += n;
      const int64_t tokens =
          CheckedMul(n, shaped.shapes[mb.shape].seq_len, "tokens of a micro-batch");
      out->tokens = CheckedAdd(out->tokens, tokens, "tokens of the plan");
      ++out->sp_micro_batches[slot];
      out->sp_tokens[slot] += tokens;
    }
  }
  if (e > b) cost_r += cost.a;
  return cost_r;
}

// The epoch's metrics from the per-step sums (simulate.h).
void Finish(double total, double cv_sum, int64_t cv_steps, SimResult* out) {
  const double w = static_cast<double>(out->world_size);
  out->lower_bound_s = total / w;
  out->compute_cv = cv_steps > 0 ? cv_sum / static_cast<double>(cv_steps) : 0;
  if (out->epoch_time_s > 0) {
    out->bubble_fraction = 1 - total / (w * out->epoch_time_s);
    out->tokens_per_s_per_gpu = static_cast<double>(out->tokens) / out->epoch_time_s / w;
    out->comm_fraction = out->comm_s / (w * out->epoch_time_s);
  }
  if (out->num_steps > 0) {
    const double mean = out->epoch_time_s / static_cast<double>(out->num_steps);
    double var = 0;
    for (double t : out->step_time_s) var += (t - mean) * (t - mean);
    out->step_time_cv = mean > 0 ? std::sqrt(var / static_cast<double>(out->num_steps)) / mean : 0;
    out->mean_samples_per_step =
        static_cast<double>(out->samples) / static_cast<double>(out->num_steps);
  }
}

}  // namespace

SimResult Simulate(const Plan& plan, const ShapedManifest& shaped, const CostModel& cost_in,
                   const SimOptions& options) {
  const CostModel cost =
      options.overhead_per_micro_batch ? OverheadPerMicroBatch(cost_in) : cost_in;
  const int64_t w = plan.world_size;
  DS_CHECK(w >= 1, "plan world_size ", w);
  DS_CHECK(options.noise_sigma >= 0 && options.noise_sigma <= kMaxNoiseSigma, "noise sigma ",
           options.noise_sigma, " is out of range [0, ", kMaxNoiseSigma, "]");
  SimResult out;
  out.world_size = plan.world_size;
  out.num_steps = plan.num_steps();
  out.dropped_samples = plan.dropped_samples;
  out.padded_micro_batches = plan.padded_micro_batches;
  const int64_t num_shapes = static_cast<int64_t>(shaped.shapes.size());
  std::vector<double> work_of_shape(num_shapes);
  for (int64_t s = 0; s < num_shapes; ++s) work_of_shape[s] = cost.Work(shaped.shapes[s].seq_len);

  // A micro-batch index that occurs more than once is a padded repeat after its first use.
  std::vector<uint8_t> seen(plan.micro_batches.size(), 0);
  if (options.keep_rank_costs) out.rank_cost_s.resize(out.num_steps * w);
  out.step_time_s.resize(out.num_steps);
  double total = 0, cv_sum = 0;
  int64_t cv_steps = 0;
  std::vector<double> c(w);
  for (int64_t k = 0; k < out.num_steps; ++k) {
    for (int64_t r = 0; r < w; ++r) {
      c[r] = RankCost(plan, shaped, cost, options, work_of_shape, k, r, seen, &out);
      if (options.keep_rank_costs) out.rank_cost_s[k * w + r] = c[r];
    }
    double sum = 0, mx = 0;
    for (double x : c) sum += x, mx = std::max(mx, x);
    const double mean = sum / static_cast<double>(w);
    if (mean > 0) {
      double var = 0;
      for (double x : c) var += (x - mean) * (x - mean);
      cv_sum += std::sqrt(var / static_cast<double>(w)) / mean;
      ++cv_steps;
    }
    out.step_time_s[k] = mx;
    out.epoch_time_s += mx;
    total += sum;
  }
  Finish(total, cv_sum, cv_steps, &out);
  return out;
}

}  // namespace ditscale::balance
