#include "ditscale/balance/report.h"

#include <gtest/gtest.h>

#include <random>

namespace ditscale::balance {
namespace {

int Count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(Report, SelfContainedPageWithEveryPlot) {
  std::mt19937_64 g(std::random_device{}());
  ReportInput in;
  in.title = "plan <of> \"x\" & y";
  in.settings = {{"model", "wan2.1-1.3b"}};
  in.seq_len_of_shape = {1560, 8190, 32760, 75600};
  in.count_of_shape = {10, 0, 5, 2};
  for (const char* name : {"equal-token", "adaptive", "balanced"}) {
    ReportPolicy p;
    p.name = name;
    p.sim.world_size = 4;
    p.sim.num_steps = 300;
    for (int k = 0; k < 300; ++k) {
      double mx = 0;
      for (int r = 0; r < 4; ++r) {
        const double c = 1 + static_cast<double>(g() % 1000) / 1000;
        p.sim.rank_cost_s.push_back(c);
        mx = std::max(mx, c);
      }
      p.sim.step_time_s.push_back(mx);
    }
    p.sim.tokens_per_s_per_gpu = 1000 + static_cast<double>(g() % 1000);
    p.sim.epoch_time_s = 500;
    p.sim.lower_bound_s = 400;
    p.batch_size_of_shape = {64, 12, 3, 1};
    p.rank_budget_s = std::string(name) == "balanced" ? 1.5 : 0;
    in.policies.push_back(p);
  }
  in.budget_sweep = {{1.5, 0.01, 500, 490, 300, 12, 1000}, {3, 0.005, 495, 490, 150, 24, 1010}};
  const std::string html = RenderReportHtml(in);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_EQ(Count(html, "<svg"), 4 + 3 + 1);  // 4 bar charts, 3 rank-load plots, batch sizes
  EXPECT_EQ(Count(html, "<svg"), Count(html, "</svg>"));
  EXPECT_EQ(Count(html, "<script"), 0);
  EXPECT_EQ(Count(html, "http://") + Count(html, "https://"),
            Count(html, "http://www.w3.org/2000/svg"));  // no fetched resources
  EXPECT_NE(html.find("plan &lt;of&gt; &quot;x&quot; &amp; y"), std::string::npos);
  EXPECT_EQ(html.find("plan <of>"), std::string::npos);
  // 150 steps x 4 ranks dots per policy.
  EXPECT_EQ(Count(html, "<circle"), 3 * 150 * 4 + 3 * 3);
  EXPECT_NE(html.find("budget sweep"), std::string::npos);
  EXPECT_NE(html.find("stroke-dasharray"), std::string::npos);  // the balanced budget line
  EXPECT_EQ(html.find("Sequence-parallel degrees"), std::string::npos);  // no run used them
}

TEST(Report, DegreesPlotTheTokenSharesOfEachRun) {
  ReportInput in;
  in.seq_len_of_shape = {1560, 75600};
  in.count_of_shape = {10, 2};
  for (int d : {0, 1}) {
    ReportPolicy p;
    p.name = d ? "balanced sp 1,2,4,8" : "balanced sp 1";
    p.sim.world_size = 8;
    p.sim.sp_tokens = {15600, d ? 75600 : 0, 0, d ? 75600 : 0};
    p.sim.comm_fraction = d ? 0.035 : 0;
    in.policies.push_back(p);
  }
  const std::string html = RenderReportHtml(in);
  EXPECT_NE(html.find("<h2>Sequence-parallel degrees</h2>"), std::string::npos);
  EXPECT_EQ(Count(html, "d=8</text>"), 1);
  EXPECT_NE(html.find("3.50% comm"), std::string::npos);
  // The stacked segments: 1 (all at d = 1) + 3 (d = 1, 2, 8).
  const size_t at = html.find("<h2>Sequence-parallel degrees</h2>");
  const std::string section = html.substr(at, html.find("</svg>", at) - at);
  EXPECT_EQ(Count(section, "<rect"), 1 + 3);
  EXPECT_EQ(Count(html, "<svg"), Count(html, "</svg>"));
}

TEST(Report, WriteFailureNamesTheFile) {
  auto r = WriteReportHtml("/nonexistent-dir/report.html", ReportInput{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.failure().ToString().find("/nonexistent-dir/report.html"), std::string::npos);
}

}  // namespace
}  // namespace ditscale::balance
