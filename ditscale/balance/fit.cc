// The least-squares fits of fit.h (the benchmark CSV reader: bench_csv.cc).
#include "ditscale/balance/fit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

namespace ditscale::balance {
namespace {

// ---------------------------------------------------------------------------------------------
// Small dense least squares

// At most 4 unknowns: (a, a_mb, c1, c2) or (a, a_mb, log b, p).
constexpr int kMaxParams = 4;
using Vec = std::array<double, kMaxParams>;
using Mat = std::array<Vec, kMaxParams>;

// Solves the k x k system A x = b (k <= kMaxParams) by Gaussian elimination with partial
// pivoting.
bool Solve(int k, Mat A, Vec b, Vec* x) {
  for (int c = 0; c < k; ++c) {
    int piv = c;
    for (int r = c + 1; r < k; ++r) {
      if (std::abs(A[r][c]) > std::abs(A[piv][c])) piv = r;
    }
    if (!(std::abs(A[piv][c]) > 1e-14)) return false;
    std::swap(A[c], A[piv]);
    std::swap(b[c], b[piv]);
    for (int r = c + 1; r < k; ++r) {
      const double f = A[r][c] / A[c][c];
      for (int j = c; j < k; ++j) A[r][j] -= f * A[c][j];
      b[r] -= f * b[c];
    }
  }
  for (int c = k - 1; c >= 0; --c) {
    double s = b[c];
    for (int j = c + 1; j < k; ++j) s -= A[c][j] * (*x)[j];
    (*x)[c] = s / A[c][c];
  }
  return true;
}

// min sum_i w_i (y_i - sum_j X[j][i] beta_j)^2 subject to beta >= 0, k <= kMaxParams columns:
// every active set is solved (columns scaled to unit max for conditioning) and the best feasible
// solution kept, which is the exact NNLS optimum.
Vec Nnls(const std::vector<std::vector<double>>& X, const std::vector<double>& y,
         const std::vector<double>& w, double* sse_out) {
  const int k = static_cast<int>(X.size());
  const size_t n = y.size();
  Vec scale{1, 1, 1, 1};
  for (int j = 0; j < k; ++j) {
    double m = 0;
    for (double v : X[j]) m = std::max(m, std::abs(v));
    scale[j] = m > 0 ? m : 1;
  }
  Vec best{0, 0, 0, 0};
  double best_sse = std::numeric_limits<double>::infinity();
  for (int mask = 0; mask < (1 << k); ++mask) {
    std::array<int, kMaxParams> cols{};
    int m = 0;
    for (int j = 0; j < k; ++j) {
      if (mask & (1 << j)) cols[m++] = j;
    }
    Vec beta{0, 0, 0, 0};
    if (m > 0) {
      Mat A{};
      Vec b{};
      for (size_t i = 0; i < n; ++i) {
        for (int r = 0; r < m; ++r) {
          const double xr = X[cols[r]][i] / scale[cols[r]];
          b[r] += w[i] * xr * y[i];
          for (int c = 0; c < m; ++c) A[r][c] += w[i] * xr * X[cols[c]][i] / scale[cols[c]];
        }
      }
      Vec sol{};
      if (!Solve(m, A, b, &sol)) continue;
      bool feasible = true;
      for (int r = 0; r < m; ++r) {
        if (sol[r] < 0) feasible = false;
        beta[cols[r]] = sol[r] / scale[cols[r]];
      }
      if (!feasible) continue;
    }
    double sse = 0;
    for (size_t i = 0; i < n; ++i) {
      double f = 0;
      for (int j = 0; j < k; ++j) f += X[j][i] * beta[j];
      sse += w[i] * (y[i] - f) * (y[i] - f);
    }
    if (sse < best_sse) {
      best_sse = sse;
      best = beta;
    }
  }
  if (sse_out) *sse_out = best_sse;
  return best;
}

FitQuality Quality(const BenchTable& t, const std::vector<double>& pred, int num_params) {
  FitQuality q;
  const size_t n = t.rows.size();
  double mean = 0, sum_inv = 0, sum_inv2 = 0;
  for (const auto& r : t.rows) {
    mean += r.step_time_s;
    sum_inv += 1 / r.step_time_s;
    sum_inv2 += 1 / (r.step_time_s * r.step_time_s);
  }
  mean /= n;
  const double mean_rel = sum_inv / sum_inv2;  // minimises sum ((t - c) / t)^2
  double sse = 0, sst = 0, sse_rel = 0, sst_rel = 0;
  for (size_t i = 0; i < n; ++i) {
    const double y = t.rows[i].step_time_s;
    const double r = y - pred[i];
    q.residuals_s.push_back(r);
    sse += r * r;
    sst += (y - mean) * (y - mean);
    sse_rel += (r / y) * (r / y);
    sst_rel += ((y - mean_rel) / y) * ((y - mean_rel) / y);
    q.max_rel_residual = std::max(q.max_rel_residual, std::abs(r) / y);
  }
  q.r2 = sst > 0 ? 1 - sse / sst : (sse == 0 ? 1 : 0);
  q.r2_rel = sst_rel > 0 ? 1 - sse_rel / sst_rel : (sse_rel == 0 ? 1 : 0);
  const double dof = static_cast<double>(n) - num_params;
  q.adj_r2 = dof > 0 ? 1 - (1 - q.r2_rel) * (n - 1) / dof : q.r2_rel;
  q.rmse_s = std::sqrt(sse / n);
  return q;
}

// Whether the per-micro-batch overhead a_mb is fitted: only rows with k >= 2 micro-batches tell
// it apart from a (with k = 1 everywhere, a and a_mb only appear as their sum).
bool FitsAmb(const BenchTable& t) {
  for (const auto& r : t.rows) {
    if (r.micro_batches >= 2) return true;
  }
  return false;
}

Result<bool> CheckEnough(const BenchTable& t) {
  const size_t params = FitsAmb(t) ? 4 : 3;
  if (t.rows.size() < params + 1) {
    return Failure::InFile(t.source, 0, "",
                           "need at least " + std::to_string(params + 1) +
                               " benchmark rows to fit " + std::to_string(params) +
                               " parameters, got " + std::to_string(t.rows.size()));
  }
  std::set<int64_t> seqs;
  for (const auto& r : t.rows) seqs.insert(r.seq_len);
  if (seqs.size() < 2) {
    return Failure::InFile(t.source, 0, "seq_len",
                           "need at least 2 distinct seq_len values to fit how cost grows with S");
  }
  return true;
}

// Weighted SSE and (a, a_mb, b) of the power model for a fixed exponent p. Columns: 1, [k,]
// k * B * S^p (k = micro_batches; the k column only when a_mb is fitted).
struct PowerAt {
  double sse, a, a_mb, b;
};
PowerAt SolvePowerAt(const BenchTable& t, double p, bool fit_amb) {
  const size_t n = t.rows.size();
  std::vector<std::vector<double>> X(fit_amb ? 3 : 2, std::vector<double>(n));
  std::vector<double> y(n), w(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& r = t.rows[i];
    const double k = static_cast<double>(r.micro_batches);
    X[0][i] = 1;
    if (fit_amb) X[1][i] = k;
    X.back()[i] =
        k * static_cast<double>(r.batch_size) * std::pow(static_cast<double>(r.seq_len), p);
    y[i] = r.step_time_s;
    w[i] = 1 / (y[i] * y[i]);
  }
  double sse;
  auto beta = Nnls(X, y, w, &sse);
  return {sse, beta[0], fit_amb ? beta[1] : 0.0, fit_amb ? beta[2] : beta[1]};
}

double PowerSse(const BenchTable& t, double a, double a_mb, double b, double p) {
  double sse = 0;
  for (const auto& r : t.rows) {
    const double k = static_cast<double>(r.micro_batches);
    const double f =
        a + k * (a_mb + b * r.batch_size * std::pow(static_cast<double>(r.seq_len), p));
    const double e = (r.step_time_s - f) / r.step_time_s;
    sse += e * e;
  }
  return sse;
}

// Levenberg-Marquardt on (a, log b, p), or (a, log b, p, a_mb) when a_mb is fitted, with a, a_mb
// >= 0 and p in [p_lo, p_hi] kept by rejecting steps (noisy benches otherwise let p run away where
// b*S^p is nearly flat).
void PolishPower(const BenchTable& t, double p_lo, double p_hi, bool fit_amb, double* a,
                 double* a_mb, double* b, double* p) {
  if (*b <= 0) return;
  const int np = fit_amb ? 4 : 3;
  double beta = std::log(*b);
  double sse = PowerSse(t, *a, *a_mb, *b, *p);
  double lambda = 1e-3;
  for (int it = 0; it < 100 && lambda < 1e12; ++it) {
    Mat JtJ{};
    Vec Jtr{};
    for (const auto& r : t.rows) {
      const double s = static_cast<double>(r.seq_len);
      const double k = static_cast<double>(r.micro_batches);
      const double x = k * std::exp(beta) * r.batch_size * std::pow(s, *p);
      const double res = (r.step_time_s - *a - k * *a_mb - x) / r.step_time_s;
      const Vec J = {-1 / r.step_time_s, -x / r.step_time_s, -x * std::log(s) / r.step_time_s,
                     -k / r.step_time_s};
      for (int i = 0; i < np; ++i) {
        Jtr[i] += J[i] * res;
        for (int j = 0; j < np; ++j) JtJ[i][j] += J[i] * J[j];
      }
    }
    auto A = JtJ;
    for (int i = 0; i < np; ++i) A[i][i] += lambda * std::max(JtJ[i][i], 1e-30);
    Vec delta{};
    if (!Solve(np, A, {-Jtr[0], -Jtr[1], -Jtr[2], -Jtr[3]}, &delta)) {
      lambda *= 10;
      continue;
    }
    const double na = *a + delta[0], nbeta = beta + delta[1], np_ = *p + delta[2];
    const double namb = fit_amb ? *a_mb + delta[3] : *a_mb;
    const double nsse = (na >= 0 && namb >= 0 && np_ >= p_lo && np_ <= p_hi)
                            ? PowerSse(t, na, namb, std::exp(nbeta), np_)
                            : std::numeric_limits<double>::infinity();
    if (nsse < sse) {
      const bool converged = sse - nsse < 1e-15 * std::max(sse, 1e-300);
      *a = na;
      *a_mb = namb;
      beta = nbeta;
      *p = np_;
      sse = nsse;
      lambda = std::max(lambda / 10, 1e-12);
      if (converged) break;
    } else {
      lambda *= 10;
    }
  }
  *b = std::exp(beta);
}

}  // namespace

Result<ModelFit> FitPowerModel(const BenchTable& t) {
  if (auto ok = CheckEnough(t); !ok.ok()) return ok.failure();
  const bool fit_amb = FitsAmb(t);
  // Profile p on a grid, refine by golden section inside the best cell.
  constexpr double kLo = kPowerExponentLo, kHi = kPowerExponentHi, kStep = 0.01;
  const int steps = static_cast<int>(std::lround((kHi - kLo) / kStep));
  int best_i = 0;
  double best_sse = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= steps; ++i) {
    const double sse = SolvePowerAt(t, kLo + i * kStep, fit_amb).sse;
    if (sse < best_sse) {
      best_sse = sse;
      best_i = i;
    }
  }
  double lo = kLo + std::max(0, best_i - 1) * kStep;
  double hi = kLo + std::min(steps, best_i + 1) * kStep;
  const double g = (std::sqrt(5.0) - 1) / 2;
  double x1 = hi - g * (hi - lo), x2 = lo + g * (hi - lo);
  double f1 = SolvePowerAt(t, x1, fit_amb).sse, f2 = SolvePowerAt(t, x2, fit_amb).sse;
  while (hi - lo > 1e-9) {
    if (f1 < f2) {
      hi = x2;
      x2 = x1;
      f2 = f1;
      x1 = hi - g * (hi - lo);
      f1 = SolvePowerAt(t, x1, fit_amb).sse;
    } else {
      lo = x1;
      x1 = x2;
      f1 = f2;
      x2 = lo + g * (hi - lo);
      f2 = SolvePowerAt(t, x2, fit_amb).sse;
    }
  }
  double p = (lo + hi) / 2;
  PowerAt at = SolvePowerAt(t, p, fit_amb);
  if (best_sse < at.sse) {  // the grid point was better than the refined one (flat region)
    p = kLo + best_i * kStep;
    at = SolvePowerAt(t, p, fit_amb);
  }
  double a = at.a, a_mb = at.a_mb, b = at.b;
  PolishPower(t, kLo, kHi, fit_amb, &a, &a_mb, &b, &p);
  ModelFit fit;
  fit.model.kind = CostModel::Kind::kPower;
  fit.model.a = a;
  fit.model.a_mb = a_mb;
  fit.model.b = b;
  fit.model.p = p;
  fit.model.source = "fit:" + t.source;
  std::vector<double> pred;
  for (const auto& r : t.rows) {
    pred.push_back(fit.model.AccumStepTime(r.micro_batches, r.batch_size, r.seq_len));
  }
  fit.quality = Quality(t, pred, fit_amb ? 4 : 3);
  return fit;
}

Result<ModelFit> FitQuadraticModel(const BenchTable& t) {
  if (auto ok = CheckEnough(t); !ok.ok()) return ok.failure();
  const bool fit_amb = FitsAmb(t);
  const size_t n = t.rows.size();
  // Columns: 1, [k,] k * B * S, k * B * S^2 (k = micro_batches; k only when a_mb is fitted).
  const int off = fit_amb ? 1 : 0;
  std::vector<std::vector<double>> X(3 + off, std::vector<double>(n));
  std::vector<double> y(n), w(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& r = t.rows[i];
    const double s = static_cast<double>(r.seq_len);
    const double k = static_cast<double>(r.micro_batches);
    X[0][i] = 1;
    if (fit_amb) X[1][i] = k;
    X[1 + off][i] = k * r.batch_size * s;
    X[2 + off][i] = k * r.batch_size * s * s;
    y[i] = r.step_time_s;
    w[i] = 1 / (y[i] * y[i]);
  }
  auto beta = Nnls(X, y, w, nullptr);
  ModelFit fit;
  fit.model.kind = CostModel::Kind::kQuadratic;
  fit.model.a = beta[0];
  fit.model.a_mb = fit_amb ? beta[1] : 0.0;
  fit.model.c1 = beta[1 + off];
  fit.model.c2 = beta[2 + off];
  fit.model.source = "fit:" + t.source;
  std::vector<double> pred;
  for (const auto& r : t.rows) {
    pred.push_back(fit.model.AccumStepTime(r.micro_batches, r.batch_size, r.seq_len));
  }
  fit.quality = Quality(t, pred, fit_amb ? 4 : 3);
  return fit;
}

Result<MemoryFit> FitMemoryModel(const BenchTable& t) {
  std::vector<std::vector<double>> X(2);
  std::vector<double> y, w;
  std::set<double> tokens;
  for (const auto& r : t.rows) {
    if (r.peak_mem_bytes <= 0) continue;
    const double bs = static_cast<double>(r.batch_size) * r.seq_len;
    X[0].push_back(1);
    X[1].push_back(bs);
    y.push_back(r.peak_mem_bytes);
    w.push_back(1);
    tokens.insert(bs);
  }
  if (y.size() < 2 || tokens.size() < 2) {
    return Failure::InFile(t.source, 0, "peak_mem_bytes",
                           "need at least 2 rows with peak_mem_bytes and 2 distinct "
                           "batch_size*seq_len to fit the memory model, got " +
                               std::to_string(y.size()) + " rows");
  }
  auto beta = Nnls(X, y, w, nullptr);
  MemoryFit m;
  m.model.m0 = beta[0];
  m.model.m1 = beta[1];
  m.rows = static_cast<int64_t>(y.size());
  double mean = 0;
  for (double v : y) mean += v;
  mean /= y.size();
  double sse = 0, sst = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double r = y[i] - (m.model.m0 + m.model.m1 * X[1][i]);
    m.residuals_bytes.push_back(r);
    sse += r * r;
    sst += (y[i] - mean) * (y[i] - mean);
    m.max_rel_residual = std::max(m.max_rel_residual, std::abs(r) / y[i]);
  }
  m.r2 = sst > 0 ? 1 - sse / sst : 1;
  m.rmse_bytes = std::sqrt(sse / y.size());
  return m;
}

Result<FitResult> FitBench(const BenchTable& t) {
  auto power = FitPowerModel(t);
  if (!power.ok()) return power.failure();
  auto quad = FitQuadraticModel(t);
  if (!quad.ok()) return quad.failure();
  FitResult res;
  res.power = std::move(power).value();
  res.quadratic = std::move(quad).value();
  const auto& qp = res.power.quality;
  const auto& qq = res.quadratic.quality;
  char buf[200];
  if (std::abs(qp.adj_r2 - qq.adj_r2) > 1e-9) {
    res.chosen = qp.adj_r2 > qq.adj_r2 ? CostModel::Kind::kPower : CostModel::Kind::kQuadratic;
    std::snprintf(buf, sizeof(buf), "higher adjusted R^2 of relative residuals (%.6f vs %.6f)",
                  std::max(qp.adj_r2, qq.adj_r2), std::min(qp.adj_r2, qq.adj_r2));
  } else if (qp.rmse_s != qq.rmse_s) {
    res.chosen = qp.rmse_s <= qq.rmse_s ? CostModel::Kind::kPower : CostModel::Kind::kQuadratic;
    std::snprintf(buf, sizeof(buf), "equal adjusted R^2; lower RMSE (%.6g s vs %.6g s)",
                  std::min(qp.rmse_s, qq.rmse_s), std::max(qp.rmse_s, qq.rmse_s));
  } else {
    res.chosen = CostModel::Kind::kPower;
    std::snprintf(buf, sizeof(buf), "fits are equal; the power model is the default");
  }
  res.choice_reason = buf;
  if (t.has_memory) {
    auto mem = FitMemoryModel(t);
    if (!mem.ok()) return mem.failure();
    res.memory = std::move(mem).value();
  }
  return res;
}

std::optional<std::string> FitProblem(const FitResult& fit) {
  const ModelFit& best = fit.best();
  const CostModel& m = best.model;
  char buf[400];
  if (m.kind == CostModel::Kind::kPower) {
    if (!(m.b > 0)) {
      return "the power fit has b = 0: step times do not grow with B*S^p (constant or decreasing "
             "times); benchmark shapes whose cost differs";
    }
    if (std::abs(m.p - kPowerExponentLo) < 1e-6 || std::abs(m.p - kPowerExponentHi) < 1e-6) {
      std::snprintf(buf, sizeof(buf),
                    "the power fit's exponent p = %.6g is at a bound of its search range [%g, %g] "
                    "(R^2 = %.4f): the data are not explained by a plausible b*S^p",
                    m.p, kPowerExponentLo, kPowerExponentHi, best.quality.r2);
      return std::string(buf);
    }
  } else if (!(m.c1 + m.c2 > 0)) {
    return "the quadratic fit has c1 = c2 = 0: step times do not grow with B*S (constant or "
           "decreasing times)";
  }
  if (!(best.quality.r2 >= kMinFitR2)) {
    std::snprintf(buf, sizeof(buf),
                  "the chosen %s fit explains too little of the data: R^2 = %.4f is below %g",
                  m.kind == CostModel::Kind::kPower ? "power" : "quadratic", best.quality.r2,
                  kMinFitR2);
    return std::string(buf);
  }
  if (fit.memory && !(fit.memory->model.m1 > 0)) {
    return "the memory fit has slope m1 = 0 bytes per token: peak memory does not grow with "
           "B*S, so M_mem is unbounded; benchmark batches of different sizes (or drop "
           "peak_mem_bytes)";
  }
  if (fit.memory && !(fit.memory->r2 >= kMinFitR2)) {
    std::snprintf(buf, sizeof(buf),
                  "the memory fit explains too little of the peak memory: R^2 = %.4f is below %g "
                  "(m1 = %.4g bytes per token; does peak memory grow with B*S?)",
                  fit.memory->r2, kMinFitR2, fit.memory->model.m1);
    return std::string(buf);
  }
  return std::nullopt;
}

}  // namespace ditscale::balance
