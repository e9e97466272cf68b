// Fitting the step-time and memory models (cost_model.h) to a shape benchmark.
//
// The benchmark CSV and its reader: bench_csv.h.
//
// Step time of a row: t = a + k * (a_mb + B * Work(S)) (cost_model.h). When some row has k >= 2,
// a and a_mb are fitted jointly with the other parameters (4 parameters); otherwise they are not
// identifiable apart (only a + a_mb is) and a_mb = 0: the fit is the 3-parameter one below,
// bit-identical to the fit before a_mb existed.
//
// Fits (all parameters >= 0):
//   power:     t = a + k * (a_mb + b * B * S^p). Relative (1/t^2-weighted) least squares: the
//              exponent p is profiled over [0.5, 3.5] (a grid of 301 points, then golden-section
//              search in the best grid cell) with a, [a_mb,] b solved in closed form for each p
//              (non-negative least squares), then polished by Levenberg-Marquardt on
//              (a, log b, p[, a_mb]).
//   quadratic: t = a + k * (a_mb + c1 * B * S + c2 * B * S^2). Relative linear least squares with
//              a, [a_mb,] c1, c2 >= 0 (exact non-negative least squares by enumerating the active
//              sets).
//   memory:    peak = m0 + m1 * B * S, ordinary least squares over the rows with peak_mem_bytes.
// Relative weighting is used because step times span orders of magnitude and bench noise is
// multiplicative.
//
// Choice of model: both have the same number of parameters (3, or 4 with a_mb), so adjusted R^2
// orders them exactly as R^2 does. The model with the higher adjusted R^2 of the relative
// residuals (1 - SSE_rel / SST_rel, the fitted objective) wins; within 1e-9 the lower RMSE (s)
// wins; a remaining tie goes to the power model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ditscale/balance/bench_csv.h"
#include "ditscale/balance/cost_model.h"
#include "ditscale/core/result.h"

namespace ditscale::balance {

// Goodness of fit of one model over the rows it was fitted to.
struct FitQuality {
  double r2 = 0;                // 1 - SSE / SST on the step times (unweighted)
  double adj_r2 = 0;            // 1 - (1 - r2_rel) * (n - 1) / (n - k - 1) on relative residuals
  double r2_rel = 0;            // 1 - sum(r_i/t_i)^2 / sum((t_i - mean)/t_i)^2: the fitted metric
  double rmse_s = 0;            // sqrt(mean((t_i - f_i)^2)), s
  double max_rel_residual = 0;  // max |t_i - f_i| / t_i
  std::vector<double> residuals_s;  // per row: measured - predicted, s (row order)
};

struct ModelFit {
  CostModel model;
  FitQuality quality;
};

struct MemoryFit {
  MemoryModel model;
  double r2 = 0;
  double rmse_bytes = 0;
  double max_rel_residual = 0;
  int64_t rows = 0;                     // rows with a peak_mem_bytes value
  std::vector<double> residuals_bytes;  // per such row, in row order
};

struct FitResult {
  ModelFit power;
  ModelFit quadratic;
  CostModel::Kind chosen = CostModel::Kind::kPower;
  std::string choice_reason;        // one line: why `chosen` won
  std::optional<MemoryFit> memory;  // present when the table has peak memory
  const ModelFit& best() const { return chosen == CostModel::Kind::kPower ? power : quadratic; }
};

// Each needs at least 4 rows (5 when a_mb is fitted) and 2 distinct seq_len values; Failures
// name the file.
Result<ModelFit> FitPowerModel(const BenchTable& table);
Result<ModelFit> FitQuadraticModel(const BenchTable& table);
// Needs at least 2 rows with peak memory and 2 distinct B*S among them.
Result<MemoryFit> FitMemoryModel(const BenchTable& table);
// Both step-time fits, the choice, and the memory fit when the table has peak memory.
Result<FitResult> FitBench(const BenchTable& table);

// The range the power fit's exponent p is searched in, and the least R^2 (unweighted, the
// "R^2" that `ditscale fit` prints) of a fit that explains the data.
inline constexpr double kPowerExponentLo = 0.5;
inline constexpr double kPowerExponentHi = 3.5;
inline constexpr double kMinFitR2 = 0.9;

// Why the chosen fit cannot be used as a cost model, or nullopt when it can. A fit is refused
// when its work term is not positive (power b <= 0, quadratic c1 + c2 <= 0: times that do not
// grow with B*S), when the power exponent sits at a bound of its search range (within 1e-6:
// the data asked for a steeper or flatter curve than any plausible one), when R^2 < kMinFitR2,
// or when the memory fit's slope m1 <= 0 or its R^2 < kMinFitR2 (peak memory that does not grow
// with B*S would make M_mem unbounded). `ditscale fit` and `ditscale plan --bench` fail with this
// message.
std::optional<std::string> FitProblem(const FitResult& fit);

}  // namespace ditscale::balance
