// Pieces of `ditscale plan` on a generated mixed manifest (1M rows by default; the 10M-row
// end-to-end run is bench/balance/plan_10m.sh): CSV parse, shaping, the two fused (what the CLI
// runs), M_comp search, each policy's plan, and the simulator. items/s are rows (samples) per
// second.
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "ditscale/balance/cost_model.h"
#include "ditscale/balance/internal/csv_manifest.h"
#include "ditscale/balance/manifest.h"
#include "ditscale/balance/planner.h"
#include "ditscale/balance/shaped_reader.h"
#include "ditscale/balance/shapes.h"
#include "ditscale/balance/simulate.h"

namespace ditscale::balance {
namespace {

constexpr int64_t kRows = 1 << 20;

// Open-Sora-style CSV: half images, half 1-15 s videos, 480p/720p-ish, a quoted caption.
const std::string& Csv() {
  static const std::string text = [] {
    std::mt19937_64 g(7);
    const int res[][2] = {{480, 832}, {720, 1280}, {832, 480}, {512, 512}, {1024, 1024}};
    std::string s = "path,num_frames,height,width,fps,caption\n";
    s.reserve(kRows * 64);
    for (int64_t i = 0; i < kRows; ++i) {
      const auto& r = res[g() % 5];
      const bool image = g() % 2 == 0;
      const int fps = image ? 0 : (g() % 2 ? 24 : 30);
      const int frames = image ? 1 : fps * (1 + static_cast<int>(g() % 15));
      s += "data/clip_" + std::to_string(i) + ".mp4," + std::to_string(frames) + "," +
           std::to_string(r[0]) + "," + std::to_string(r[1]) + "," +
           (image ? std::string() : std::to_string(fps)) + ",\"a cat, \"\"running\"\"\"\n";
    }
    return s;
  }();
  return text;
}

const ModelPreset& Model() {
  static const ModelPreset m = GetModelPreset("wan2.1-1.3b").value();
  return m;
}

const ShapedManifest& Shaped() {
  static const ShapedManifest s = ShapeManifest(ParseManifest(Csv(), "bench.csv").value(), Model());
  return s;
}

PlanOptions Options(Policy p) {
  PlanOptions o;
  o.policy = p;
  o.world_size = 16;
  o.seed = 1;
  o.m_mem_tokens = 4 * 75600;
  return o;
}

void BM_ParseCsv(benchmark::State& state) {
  for (auto _ : state) {
    auto m = ParseManifest(Csv(), "bench.csv");
    benchmark::DoNotOptimize(m);
  }
  state.SetItemsProcessed(state.iterations() * kRows);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(Csv().size()));
}
BENCHMARK(BM_ParseCsv)->Unit(benchmark::kMillisecond);

void BM_ShapeManifest(benchmark::State& state) {
  const Manifest m = ParseManifest(Csv(), "bench.csv").value();
  for (auto _ : state) {
    auto s = ShapeManifest(m, Model());
    benchmark::DoNotOptimize(s);
  }
  state.SetItemsProcessed(state.iterations() * kRows);
}
BENCHMARK(BM_ShapeManifest)->Unit(benchmark::kMillisecond);

void BM_ParseAndShapeFused(benchmark::State& state) {
  for (auto _ : state) {
    Manifest rows;
    auto s = internal::ShapeCsvText(Csv(), "bench.csv", Model(), {}, {}, &rows);
    benchmark::DoNotOptimize(s);
  }
  state.SetItemsProcessed(state.iterations() * kRows);
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(Csv().size()));
}
BENCHMARK(BM_ParseAndShapeFused)->Unit(benchmark::kMillisecond);

void BM_ChooseMComp(benchmark::State& state) {
  const CostModel cost = AnalyticalCost(Model());
  const PlanOptions o = Options(Policy::kAdaptive);
  const double p = PlanExponent(Shaped(), cost);
  for (auto _ : state) benchmark::DoNotOptimize(ChooseMComp(Shaped(), cost, o, p));
}
BENCHMARK(BM_ChooseMComp)->Unit(benchmark::kMillisecond);

void BM_MakePlan(benchmark::State& state) {
  const CostModel cost = AnalyticalCost(Model());
  PlanOptions o = Options(static_cast<Policy>(state.range(0)));
  o.m_comp = ChooseMComp(Shaped(), cost, o, PlanExponent(Shaped(), cost)).m_comp;
  for (auto _ : state) {
    auto plan = MakePlan(Shaped(), cost, o);
    benchmark::DoNotOptimize(plan);
  }
  state.SetItemsProcessed(state.iterations() * kRows);
  state.SetLabel(PolicyName(o.policy));
}
BENCHMARK(BM_MakePlan)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond);

void BM_Simulate(benchmark::State& state) {
  const CostModel cost = AnalyticalCost(Model());
  const Plan plan = MakePlan(Shaped(), cost, Options(Policy::kBalanced)).value();
  for (auto _ : state) benchmark::DoNotOptimize(Simulate(plan, Shaped(), cost));
  state.SetItemsProcessed(state.iterations() * kRows);
}
BENCHMARK(BM_Simulate)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace ditscale::balance

BENCHMARK_MAIN();
