#include "ditscale/balance/report.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace ditscale::balance {
namespace {

const char* kColors[] = {"#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"};

std::string Escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '&':
        o += "&amp;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string Num(double v, int digits = 3) {
  char buf[64];
  if (v != 0 && (std::fabs(v) >= 1e6 || std::fabs(v) < 1e-3)) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, v);
  } else {
    std::snprintf(buf, sizeof(buf), "%.*f", std::fabs(v) >= 100 ? 0 : digits, v);
  }
  return buf;
}

// A plot frame: maps data to pixels inside margins.
struct Frame {
  double w = 760, h = 260, left = 64, right = 16, top = 16, bottom = 40;
  double x0 = 0, x1 = 1, y0 = 0, y1 = 1;
  bool log_x = false, log_y = false;
  double X(double x) const {
    const double t = log_x ? (std::log10(x) - std::log10(x0)) / (std::log10(x1) - std::log10(x0))
                           : (x - x0) / (x1 - x0);
    return left + t * (w - left - right);
  }
  double Y(double y) const {
    const double t = log_y ? (std::log10(y) - std::log10(y0)) / (std::log10(y1) - std::log10(y0))
                           : (y - y0) / (y1 - y0);
    return h - bottom - t * (h - top - bottom);
  }
};

void OpenSvg(std::ostringstream& o, const Frame& f) {
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << f.w << "' height='" << f.h
    << "' font-family='sans-serif' font-size='11'>\n"
    << "<rect x='" << f.left << "' y='" << f.top << "' width='" << f.w - f.left - f.right
    << "' height='" << f.h - f.top - f.bottom << "' fill='none' stroke='#999'/>\n";
}

std::vector<double> Ticks(double lo, double hi, bool log_scale) {
  std::vector<double> t;
  if (log_scale) {
    for (double d = std::pow(10, std::floor(std::log10(lo))); d <= hi * 1.0001; d *= 10) {
      if (d >= lo * 0.9999) t.push_back(d);
    }
    if (t.size() < 2) t = {lo, hi};
    return t;
  }
  const double span = hi - lo;
  if (span <= 0) return {lo};
  const double raw = span / 5, mag = std::pow(10, std::floor(std::log10(raw)));
  const double step = raw / mag < 2 ? 2 * mag : raw / mag < 5 ? 5 * mag : 10 * mag;
  for (double v = std::ceil(lo / step) * step; v <= hi + 1e-9 * span; v += step) t.push_back(v);
  return t;
}

void Axes(std::ostringstream& o, const Frame& f, const std::string& xlabel,
          const std::string& ylabel) {
  for (double t : Ticks(f.x0, f.x1, f.log_x)) {
    o << "<text x='" << f.X(t) << "' y='" << f.h - f.bottom + 14 << "' text-anchor='middle'>"
      << Num(t, 2) << "</text>\n";
  }
  for (double t : Ticks(f.y0, f.y1, f.log_y)) {
    o << "<line x1='" << f.left << "' x2='" << f.w - f.right << "' y1='" << f.Y(t) << "' y2='"
      << f.Y(t) << "' stroke='#eee'/><text x='" << f.left - 4 << "' y='" << f.Y(t) + 4
      << "' text-anchor='end'>" << Num(t, 2) << "</text>\n";
  }
  o << "<text x='" << (f.left + f.w - f.right) / 2 << "' y='" << f.h - 6
    << "' text-anchor='middle'>" << Escape(xlabel) << "</text>\n"
    << "<text x='12' y='" << (f.top + f.h - f.bottom) / 2 << "' text-anchor='middle' transform='"
    << "rotate(-90 12 " << (f.top + f.h - f.bottom) / 2 << ")'>" << Escape(ylabel) << "</text>\n";
}

void RankLoadPlot(std::ostringstream& o, const ReportPolicy& p, int max_steps, double y_max,
                  const char* color) {
  const SimResult& s = p.sim;
  const int64_t steps = std::min<int64_t>(s.num_steps, max_steps);
  const int w = s.world_size;
  if (steps == 0 || w == 0 || s.rank_cost_s.empty()) {
    o << "<p>(no steps)</p>\n";
    return;
  }
  Frame f;
  f.x0 = 0, f.x1 = static_cast<double>(steps), f.y0 = 0, f.y1 = y_max;
  OpenSvg(o, f);
  Axes(o, f, "step", "predicted rank cost (s)");
  std::ostringstream line;
  for (int64_t k = 0; k < steps; ++k) {
    for (int r = 0; r < w; ++r) {
      o << "<circle cx='" << f.X(k + 0.5) << "' cy='" << f.Y(s.rank_cost_s[k * w + r])
        << "' r='1.8' fill='" << color << "' fill-opacity='0.45'/>";
    }
    line << (k == 0 ? "" : " ") << f.X(k + 0.5) << "," << f.Y(s.step_time_s[k]);
  }
  o << "\n<polyline points='" << line.str() << "' fill='none' stroke='#333' stroke-width='1'/>\n";
  if (p.rank_budget_s > 0 && p.rank_budget_s <= y_max) {
    o << "<line x1='" << f.left << "' x2='" << f.w - f.right << "' y1='" << f.Y(p.rank_budget_s)
      << "' y2='" << f.Y(p.rank_budget_s) << "' stroke='#555' stroke-dasharray='5,4'/>\n";
  }
  o << "</svg>\n";
}

void BatchSizePlot(std::ostringstream& o, const ReportInput& in) {
  Frame f;
  f.log_x = f.log_y = true;
  double s_lo = 1e300, s_hi = 0, b_hi = 1;
  for (size_t s = 0; s < in.seq_len_of_shape.size(); ++s) {
    if (s < in.count_of_shape.size() && in.count_of_shape[s] == 0) continue;
    s_lo = std::min(s_lo, static_cast<double>(std::max<int64_t>(1, in.seq_len_of_shape[s])));
    s_hi = std::max(s_hi, static_cast<double>(in.seq_len_of_shape[s]));
    for (const auto& p : in.policies) {
      if (s < p.batch_size_of_shape.size()) {
        b_hi = std::max(b_hi, static_cast<double>(p.batch_size_of_shape[s]));
      }
    }
  }
  if (s_hi <= 0) return;
  f.x0 = s_lo / 1.2, f.x1 = s_hi * 1.2, f.y0 = 0.8, f.y1 = b_hi * 1.5;
  OpenSvg(o, f);
  Axes(o, f, "sequence length S (tokens)", "batch size B");
  for (size_t i = 0; i < in.policies.size(); ++i) {
    const auto& p = in.policies[i];
    const double dx = (static_cast<double>(i) - 1) * 2;
    for (size_t s = 0; s < in.seq_len_of_shape.size() && s < p.batch_size_of_shape.size(); ++s) {
      if (s < in.count_of_shape.size() && in.count_of_shape[s] == 0) continue;
      o << "<circle cx='" << f.X(std::max<double>(1, in.seq_len_of_shape[s])) + dx << "' cy='"
        << f.Y(p.batch_size_of_shape[s]) << "' r='2.5' fill='" << kColors[i % 5]
        << "' fill-opacity='0.7'/>";
    }
    o << "<text x='" << f.w - f.right - 110 << "' y='" << f.top + 14 + 14 * i << "' fill='"
      << kColors[i % 5] << "'>&#9679; " << Escape(p.name) << "</text>\n";
  }
  o << "</svg>\n";
}

void Bars(std::ostringstream& o, const std::string& title, const ReportInput& in,
          double (*get)(const SimResult&), double (*ref)(const SimResult&)) {
  const double bar_h = 22, w = 760, label_w = 110;
  const double h = 26 + bar_h * 1.4 * static_cast<double>(in.policies.size());
  double mx = 0;
  for (const auto& p : in.policies) {
    mx = std::max(mx, get(p.sim));
    if (ref) mx = std::max(mx, ref(p.sim));
  }
  if (mx <= 0) mx = 1;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='11'><text x='0' y='14' font-weight='bold'>"
    << Escape(title) << "</text>\n";
  for (size_t i = 0; i < in.policies.size(); ++i) {
    const double y = 22 + bar_h * 1.4 * static_cast<double>(i);
    const double v = get(in.policies[i].sim);
    const double len = (w - label_w - 90) * v / mx;
    o << "<text x='0' y='" << y + 15 << "'>" << Escape(in.policies[i].name) << "</text><rect x='"
      << label_w << "' y='" << y << "' width='" << len << "' height='" << bar_h << "' fill='"
      << kColors[i % 5] << "'/><text x='" << label_w + len + 4 << "' y='" << y + 15 << "'>"
      << Num(v) << "</text>";
    if (ref) {
      const double rx = label_w + (w - label_w - 90) * ref(in.policies[i].sim) / mx;
      o << "<line x1='" << rx << "' x2='" << rx << "' y1='" << y - 2 << "' y2='" << y + bar_h + 2
        << "' stroke='#000' stroke-width='2'/>";
    }
    o << "\n";
  }
  o << "</svg>\n";
}

// Whether any run trained tokens at a sequence-parallel degree above 1.
bool UsesDegrees(const ReportInput& in) {
  for (const auto& p : in.policies) {
    for (size_t slot = 1; slot < p.sim.sp_tokens.size(); ++slot) {
      if (p.sim.sp_tokens[slot] > 0) return true;
    }
  }
  return false;
}

// One stacked bar per run: the share of its tokens trained at degree 1, 2, 4, 8 (SimResult::
// sp_tokens, slot i = degree 2^i), and its share of rank-time in communication.
void DegreePlot(std::ostringstream& o, const ReportInput& in) {
  const double bar_h = 22, w = 760, label_w = 150, len = w - label_w - 120;
  const double h = 40 + bar_h * 1.4 * static_cast<double>(in.policies.size());
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << w << "' height='" << h
    << "' font-family='sans-serif' font-size='11'><text x='0' y='14' font-weight='bold'>"
       "tokens by sequence-parallel degree (right: communication share)</text>\n";
  for (size_t slot = 0; slot < 4; ++slot) {
    o << "<text x='" << label_w + 70 * static_cast<double>(slot) << "' y='30' fill='"
      << kColors[slot % 5] << "'>&#9632; d=" << (1 << slot) << "</text>";
  }
  for (size_t i = 0; i < in.policies.size(); ++i) {
    const SimResult& s = in.policies[i].sim;
    const double y = 38 + bar_h * 1.4 * static_cast<double>(i);
    double total = 0, x = label_w;
    for (int64_t t : s.sp_tokens) total += static_cast<double>(t);
    o << "<text x='0' y='" << y + 15 << "'>" << Escape(in.policies[i].name) << "</text>";
    for (size_t slot = 0; slot < s.sp_tokens.size() && total > 0; ++slot) {
      if (s.sp_tokens[slot] == 0) continue;
      const double part = len * static_cast<double>(s.sp_tokens[slot]) / total;
      o << "<rect x='" << x << "' y='" << y << "' width='" << part << "' height='" << bar_h
        << "' fill='" << kColors[slot % 5] << "'/>";
      x += part;
    }
    o << "<text x='" << label_w + len + 6 << "' y='" << y + 15 << "'>"
      << Num(100 * s.comm_fraction, 2) << "% comm</text>\n";
  }
  o << "</svg>\n";
}

// The policy comparison table: one row per run.
void ComparisonTable(std::ostringstream& o, const ReportInput& in) {
  o << "<h2>Policy comparison</h2>\n<table><tr><th>policy</th><th>tokens/s/GPU</th>"
       "<th>epoch (s)</th><th>lower bound (s)</th><th>compute CV</th><th>bubble</th>"
       "<th>steps</th><th>samples/step</th><th>dropped</th><th>M_comp</th></tr>\n";
  for (const auto& p : in.policies) {
    const SimResult& s = p.sim;
    o << "<tr><td>" << Escape(p.name) << "</td><td>" << Num(s.tokens_per_s_per_gpu) << "</td><td>"
      << Num(s.epoch_time_s) << "</td><td>" << Num(s.lower_bound_s) << "</td><td>"
      << Num(100 * s.compute_cv, 2) << "%</td><td>" << Num(100 * s.bubble_fraction, 2)
      << "%</td><td>" << s.num_steps << "</td><td>" << Num(s.mean_samples_per_step, 1)
      << "</td><td>" << s.dropped_samples << "</td><td>" << Num(p.m_comp, 4) << "</td></tr>\n";
  }
  o << "</table>\n";
}

}  // namespace

std::string RenderReportHtml(const ReportInput& in) {
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>" << Escape(in.title)
    << "</title>\n<style>body{font-family:sans-serif;max-width:800px;margin:20px auto;}"
       "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px;"
       "text-align:right}th{background:#f4f4f4}td:first-child{text-align:left}</style>"
       "</head><body>\n<h1>"
    << Escape(in.title) << "</h1>\n";
  if (!in.settings.empty()) {
    o << "<table>\n";
    for (const auto& [k, v] : in.settings) {
      o << "<tr><td>" << Escape(k) << "</td><td>" << Escape(v) << "</td></tr>\n";
    }
    o << "</table>\n";
  }
  ComparisonTable(o, in);
  Bars(
      o, "tokens/s per GPU (higher is better)", in,
      [](const SimResult& s) { return s.tokens_per_s_per_gpu; }, nullptr);
  Bars(
      o, "epoch time, s (black tick: lower bound = total cost / ranks)", in,
      [](const SimResult& s) { return s.epoch_time_s; },
      [](const SimResult& s) { return s.lower_bound_s; });
  Bars(
      o, "compute-load CV (mean over steps of std/mean across ranks)", in,
      [](const SimResult& s) { return s.compute_cv; }, nullptr);
  Bars(
      o, "bubble fraction (idle share of rank-time)", in,
      [](const SimResult& s) { return s.bubble_fraction; }, nullptr);
  if (UsesDegrees(in)) {
    o << "<h2>Sequence-parallel degrees</h2>\n<p>The share of each run's tokens trained on 1, "
         "2, 4 or 8 ranks together, and the share of rank-time in sequence-parallel "
         "communication.</p>\n";
    DegreePlot(o, in);
  }

  o << "<h2>Per-step rank loads</h2>\n<p>First " << in.max_steps
    << " steps; dots: each rank's predicted cost, line: step time (max over ranks), dashed: the "
       "balanced per-rank budget.</p>\n";
  double y_max = 0;
  for (const auto& p : in.policies) {
    const int64_t n = std::min<int64_t>(p.sim.num_steps, in.max_steps);
    for (int64_t k = 0; k < n && k < static_cast<int64_t>(p.sim.step_time_s.size()); ++k) {
      y_max = std::max(y_max, p.sim.step_time_s[k]);
    }
    y_max = std::max(y_max, p.rank_budget_s);
  }
  y_max = y_max > 0 ? y_max * 1.05 : 1;
  for (size_t i = 0; i < in.policies.size(); ++i) {
    o << "<h3>" << Escape(in.policies[i].name) << "</h3>\n";
    RankLoadPlot(o, in.policies[i], in.max_steps, y_max, kColors[i % 5]);
  }
  o << "<h2>Bucket batch sizes</h2>\n<p>B chosen for each training shape (balanced: the largest "
       "micro-batch; it may split one to fill a rank).</p>\n";
  BatchSizePlot(o, in);
  if (!in.budget_sweep.empty()) {
    o << "<h2>Balanced: per-rank budget sweep</h2>\n<table><tr><th>budget (s)</th>"
         "<th>compute CV</th><th>epoch (s)</th><th>epoch / lower bound</th><th>steps</th>"
         "<th>samples/step</th><th>tokens/s/GPU</th></tr>\n";
    for (const auto& r : in.budget_sweep) {
      o << "<tr><td>" << Num(r.budget_s) << "</td><td>" << Num(100 * r.compute_cv, 2)
        << "%</td><td>" << Num(r.epoch_time_s) << "</td><td>"
        << Num(r.lower_bound_s > 0 ? r.epoch_time_s / r.lower_bound_s : 0, 4) << "</td><td>"
        << r.num_steps << "</td><td>" << Num(r.mean_samples_per_step, 1) << "</td><td>"
        << Num(r.tokens_per_s_per_gpu) << "</td></tr>\n";
    }
    o << "</table>\n";
  }
  o << "</body></html>\n";
  return o.str();
}

Result<bool> WriteReportHtml(const std::string& path, const ReportInput& input) {
  const std::string html = RenderReportHtml(input);
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    return Failure::IoError(std::string("cannot open for writing: ") + std::strerror(errno), path);
  }
  const bool wrote = std::fwrite(html.data(), 1, html.size(), f) == html.size();
  int err = errno;
  const bool flushed = wrote && std::fflush(f) == 0 && std::ferror(f) == 0;
  if (wrote && !flushed) err = errno;
  const bool closed = std::fclose(f) == 0;
  if (flushed && !closed) err = errno;
  if (!flushed || !closed) {
    return Failure::IoError("error writing " + path + ": " + std::strerror(err != 0 ? err : EIO));
  }
  return true;
}

}  // namespace ditscale::balance
