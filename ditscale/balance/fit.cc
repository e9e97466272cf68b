// Benchmark CSV parsing and the least-squares fits of fit.h.
#include "ditscale/balance/fit.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

namespace ditscale::balance {
namespace {

// ---------------------------------------------------------------------------------------------
// CSV

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) {
    s.remove_suffix(1);
  }
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::vector<std::string_view> Split(std::string_view line) {
  std::vector<std::string_view> out;
  size_t start = 0;
  for (size_t i = 0; i <= line.size(); ++i) {
    if (i == line.size() || line[i] == ',') {
      out.push_back(Trim(line.substr(start, i - start)));
      start = i + 1;
    }
  }
  return out;
}

// A finite number > 0 (integer-valued when `integer`); nullopt with *why.
std::optional<double> ParsePositive(std::string_view s, bool integer, std::string* why) {
  if (s.empty()) {
    *why = "missing value";
    return std::nullopt;
  }
  double v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || !std::isfinite(v)) {
    *why = "not a finite number: '" + std::string(s) + "'";
    return std::nullopt;
  }
  if (integer && (v != std::floor(v) || v > 9e15)) {
    *why = "not an integer: '" + std::string(s) + "'";
    return std::nullopt;
  }
  if (v <= 0) {
    *why = "must be > 0, got '" + std::string(s) + "'";
    return std::nullopt;
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Small dense least squares

// Solves the k x k system A x = b (k <= 3) by Gaussian elimination with partial pivoting.
bool Solve(int k, std::array<std::array<double, 3>, 3> A, std::array<double, 3> b,
           std::array<double, 3>* x) {
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

// min sum_i w_i (y_i - sum_j X[j][i] beta_j)^2 subject to beta >= 0, k <= 3 columns: every
// active set is solved (columns scaled to unit max for conditioning) and the best feasible
// solution kept, which is the exact NNLS optimum.
std::array<double, 3> Nnls(const std::vector<std::vector<double>>& X, const std::vector<double>& y,
                           const std::vector<double>& w, double* sse_out) {
  const int k = static_cast<int>(X.size());
  const size_t n = y.size();
  std::array<double, 3> scale{1, 1, 1};
  for (int j = 0; j < k; ++j) {
    double m = 0;
    for (double v : X[j]) m = std::max(m, std::abs(v));
    scale[j] = m > 0 ? m : 1;
  }
  std::array<double, 3> best{0, 0, 0};
  double best_sse = std::numeric_limits<double>::infinity();
  for (int mask = 0; mask < (1 << k); ++mask) {
    std::array<int, 3> cols{};
    int m = 0;
    for (int j = 0; j < k; ++j) {
      if (mask & (1 << j)) cols[m++] = j;
    }
    std::array<double, 3> beta{0, 0, 0};
    if (m > 0) {
      std::array<std::array<double, 3>, 3> A{};
      std::array<double, 3> b{};
      for (size_t i = 0; i < n; ++i) {
        for (int r = 0; r < m; ++r) {
          const double xr = X[cols[r]][i] / scale[cols[r]];
          b[r] += w[i] * xr * y[i];
          for (int c = 0; c < m; ++c) A[r][c] += w[i] * xr * X[cols[c]][i] / scale[cols[c]];
        }
      }
      std::array<double, 3> sol{};
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

Result<bool> CheckEnough(const BenchTable& t) {
  if (t.rows.size() < 4) {
    return Failure{
        "need at least 4 benchmark rows to fit 3 parameters, got " + std::to_string(t.rows.size()),
        t.source, 0, ""};
  }
  std::set<int64_t> seqs;
  for (const auto& r : t.rows) seqs.insert(r.seq_len);
  if (seqs.size() < 2) {
    return Failure{"need at least 2 distinct seq_len values to fit how cost grows with S", t.source,
                   0, "seq_len"};
  }
  return true;
}

// Weighted SSE and (a, b) of the power model for a fixed exponent p.
struct PowerAt {
  double sse, a, b;
};
PowerAt SolvePowerAt(const BenchTable& t, double p) {
  const size_t n = t.rows.size();
  std::vector<std::vector<double>> X(2, std::vector<double>(n));
  std::vector<double> y(n), w(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& r = t.rows[i];
    X[0][i] = 1;
    X[1][i] = static_cast<double>(r.batch_size) * std::pow(static_cast<double>(r.seq_len), p);
    y[i] = r.step_time_s;
    w[i] = 1 / (y[i] * y[i]);
  }
  double sse;
  auto beta = Nnls(X, y, w, &sse);
  return {sse, beta[0], beta[1]};
}

double PowerSse(const BenchTable& t, double a, double b, double p) {
  double sse = 0;
  for (const auto& r : t.rows) {
    const double f = a + b * r.batch_size * std::pow(static_cast<double>(r.seq_len), p);
    const double e = (r.step_time_s - f) / r.step_time_s;
    sse += e * e;
  }
  return sse;
}

// Levenberg-Marquardt on (a, beta = log b, p) with a >= 0 and p in [p_lo, p_hi] kept by
// rejecting steps (noisy benches otherwise let p run away where b*S^p is nearly flat).
void PolishPower(const BenchTable& t, double p_lo, double p_hi, double* a, double* b, double* p) {
  if (*b <= 0) return;
  double beta = std::log(*b);
  double sse = PowerSse(t, *a, *b, *p);
  double lambda = 1e-3;
  for (int it = 0; it < 100 && lambda < 1e12; ++it) {
    std::array<std::array<double, 3>, 3> JtJ{};
    std::array<double, 3> Jtr{};
    for (const auto& r : t.rows) {
      const double s = static_cast<double>(r.seq_len);
      const double x = std::exp(beta) * r.batch_size * std::pow(s, *p);
      const double res = (r.step_time_s - *a - x) / r.step_time_s;
      const std::array<double, 3> J = {-1 / r.step_time_s, -x / r.step_time_s,
                                       -x * std::log(s) / r.step_time_s};
      for (int i = 0; i < 3; ++i) {
        Jtr[i] += J[i] * res;
        for (int j = 0; j < 3; ++j) JtJ[i][j] += J[i] * J[j];
      }
    }
    auto A = JtJ;
    for (int i = 0; i < 3; ++i) A[i][i] += lambda * std::max(JtJ[i][i], 1e-30);
    std::array<double, 3> delta{};
    if (!Solve(3, A, {-Jtr[0], -Jtr[1], -Jtr[2]}, &delta)) {
      lambda *= 10;
      continue;
    }
    const double na = *a + delta[0], nbeta = beta + delta[1], np = *p + delta[2];
    const double nsse = (na >= 0 && np >= p_lo && np <= p_hi)
                            ? PowerSse(t, na, std::exp(nbeta), np)
                            : std::numeric_limits<double>::infinity();
    if (nsse < sse) {
      const bool converged = sse - nsse < 1e-15 * std::max(sse, 1e-300);
      *a = na;
      beta = nbeta;
      *p = np;
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

Result<BenchTable> ParseBenchCsv(std::string_view text, const std::string& name) {
  BenchTable t;
  t.source = name;
  enum { kB, kS, kT, kM, kNum };
  static const char* kNames[kNum] = {"batch_size", "seq_len", "step_time_s", "peak_mem_bytes"};
  std::array<int, kNum> col;
  col.fill(-1);
  std::vector<std::string> header;
  int64_t line_no = 0;
  size_t pos = 0;
  bool have_header = false;
  std::string why;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string_view::npos) nl = text.size();
    std::string_view line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    std::string_view trimmed = Trim(line);
    if (trimmed.empty() || trimmed.front() == '#') continue;
    auto fields = Split(line);
    if (!have_header) {
      for (size_t i = 0; i < fields.size(); ++i) {
        header.emplace_back(fields[i]);
        for (int k = 0; k < kNum; ++k) {
          if (fields[i] == kNames[k]) {
            if (col[k] >= 0) return Failure{"duplicate column", name, line_no, kNames[k]};
            col[k] = static_cast<int>(i);
          }
        }
      }
      for (int k = 0; k < kM; ++k) {
        if (col[k] < 0) {
          return Failure{
              "header lacks required column (need batch_size, seq_len, step_time_s"
              "[, peak_mem_bytes])",
              name, line_no, kNames[k]};
        }
      }
      have_header = true;
      continue;
    }
    if (fields.size() != header.size()) {
      return Failure{"wrong field count: the row has " + std::to_string(fields.size()) +
                         " fields, the header has " + std::to_string(header.size()),
                     name, line_no, fields.size() < header.size() ? header[fields.size()] : ""};
    }
    BenchRow row;
    row.line = line_no;
    for (int k = 0; k < kNum; ++k) {
      if (col[k] < 0) continue;
      std::string_view f = fields[col[k]];
      if (k == kM && f.empty()) continue;
      auto v = ParsePositive(f, k == kB || k == kS, &why);
      if (!v) return Failure{why, name, line_no, kNames[k]};
      switch (k) {
        case kB:
          row.batch_size = static_cast<int64_t>(*v);
          break;
        case kS:
          row.seq_len = static_cast<int64_t>(*v);
          break;
        case kT:
          row.step_time_s = *v;
          break;
        default:
          row.peak_mem_bytes = *v;
          t.has_memory = true;
      }
    }
    t.rows.push_back(row);
  }
  if (!have_header) return Failure{"empty benchmark file: no header row", name, 1, ""};
  return t;
}

Result<BenchTable> ReadBenchCsv(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Failure{"cannot open benchmark file", path, 0, ""};
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseBenchCsv(ss.str(), path);
}

Result<ModelFit> FitPowerModel(const BenchTable& t) {
  if (auto ok = CheckEnough(t); !ok.ok()) return ok.failure();
  // Profile p on a grid, refine by golden section inside the best cell.
  constexpr double kLo = 0.5, kHi = 3.5, kStep = 0.01;
  const int steps = static_cast<int>(std::lround((kHi - kLo) / kStep));
  int best_i = 0;
  double best_sse = std::numeric_limits<double>::infinity();
  for (int i = 0; i <= steps; ++i) {
    const double sse = SolvePowerAt(t, kLo + i * kStep).sse;
    if (sse < best_sse) {
      best_sse = sse;
      best_i = i;
    }
  }
  double lo = kLo + std::max(0, best_i - 1) * kStep;
  double hi = kLo + std::min(steps, best_i + 1) * kStep;
  const double g = (std::sqrt(5.0) - 1) / 2;
  double x1 = hi - g * (hi - lo), x2 = lo + g * (hi - lo);
  double f1 = SolvePowerAt(t, x1).sse, f2 = SolvePowerAt(t, x2).sse;
  while (hi - lo > 1e-9) {
    if (f1 < f2) {
      hi = x2;
      x2 = x1;
      f2 = f1;
      x1 = hi - g * (hi - lo);
      f1 = SolvePowerAt(t, x1).sse;
    } else {
      lo = x1;
      x1 = x2;
      f1 = f2;
      x2 = lo + g * (hi - lo);
      f2 = SolvePowerAt(t, x2).sse;
    }
  }
  double p = (lo + hi) / 2;
  PowerAt at = SolvePowerAt(t, p);
  if (best_sse < at.sse) {  // the grid point was better than the refined one (flat region)
    p = kLo + best_i * kStep;
    at = SolvePowerAt(t, p);
  }
  double a = at.a, b = at.b;
  PolishPower(t, kLo, kHi, &a, &b, &p);
  ModelFit fit;
  fit.model.kind = CostModel::Kind::kPower;
  fit.model.a = a;
  fit.model.b = b;
  fit.model.p = p;
  fit.model.source = "fit:" + t.source;
  std::vector<double> pred;
  for (const auto& r : t.rows) pred.push_back(fit.model.StepTime(r.batch_size, r.seq_len));
  fit.quality = Quality(t, pred, 3);
  return fit;
}

Result<ModelFit> FitQuadraticModel(const BenchTable& t) {
  if (auto ok = CheckEnough(t); !ok.ok()) return ok.failure();
  const size_t n = t.rows.size();
  std::vector<std::vector<double>> X(3, std::vector<double>(n));
  std::vector<double> y(n), w(n);
  for (size_t i = 0; i < n; ++i) {
    const auto& r = t.rows[i];
    const double s = static_cast<double>(r.seq_len);
    X[0][i] = 1;
    X[1][i] = r.batch_size * s;
    X[2][i] = r.batch_size * s * s;
    y[i] = r.step_time_s;
    w[i] = 1 / (y[i] * y[i]);
  }
  auto beta = Nnls(X, y, w, nullptr);
  ModelFit fit;
  fit.model.kind = CostModel::Kind::kQuadratic;
  fit.model.a = beta[0];
  fit.model.c1 = beta[1];
  fit.model.c2 = beta[2];
  fit.model.source = "fit:" + t.source;
  std::vector<double> pred;
  for (const auto& r : t.rows) pred.push_back(fit.model.StepTime(r.batch_size, r.seq_len));
  fit.quality = Quality(t, pred, 3);
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
    return Failure{
        "need at least 2 rows with peak_mem_bytes and 2 distinct batch_size*seq_len "
        "to fit the memory model, got " +
            std::to_string(y.size()) + " rows",
        t.source, 0, "peak_mem_bytes"};
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

}  // namespace ditscale::balance
