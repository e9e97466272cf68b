// The sampler over plans with sequence-parallel degrees (sampler.h, planner_sp.cc): each
// MicroBatchRef carries its micro-batch's degree, the ranks of a group see it in the same place,
// the degrees are part of the fingerprint (a plan without them keeps the fingerprint of
// before), states of other degrees are refused; SpDegreesError's words.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ditscale/balance/internal/sp_test_util.h"
#include "ditscale/balance/sampler.h"
#include "ditscale/balance/sp_cost.h"
#include "ditscale/core/error.h"

namespace ditscale::balance {
namespace {

CostModel Quad() { return internal::QuadraticTestCost(); }

ShapedManifest Corpus() {
  return internal::ShapedTestManifest({256, 4096, 15000, 30000, 70000}, {300, 120, 40, 20, 8}, 5,
                                      1);
}

PlanOptions Options(const ShapedManifest& m, std::vector<int> degrees) {
  PlanOptions o;
  o.m_mem_tokens = 20000;
  o.seed = 9;
  o.tail = TailPolicy::kKeep;
  o.sp_degrees = std::move(degrees);
  if (!o.sp_degrees.empty()) {
    o.sp_comm_per_sample_s.assign(m.shapes.size() * kSpDegreeSlots, 0.0);
    for (size_t s = 0; s < m.shapes.size(); ++s) {
      for (int slot = 1; slot < kSpDegreeSlots; ++slot) {
        o.sp_comm_per_sample_s[s * kSpDegreeSlots + slot] =
            1e-7 * static_cast<double>(m.shapes[s].seq_len);
      }
    }
  }
  return o;
}

BalancedBatchSampler Make(std::vector<int> degrees, int rank, int world = 8) {
  const ShapedManifest m = Corpus();
  Result<BalancedBatchSampler> s =
      BalancedBatchSampler::FromShaped(m, Quad(), Options(m, std::move(degrees)), rank, world);
  if (!s.ok()) throw Error(s.failure().ToString());
  return std::move(s).value();
}

TEST(SpSampler, RefsCarryTheDegreesAndGroupsListTheirMicroBatchesAlike) {
  const int world = 8;
  std::vector<BalancedBatchSampler> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(Make({1, 2, 4}, r));
  std::set<int> used;
  std::multiset<int64_t> seen;
  for (int64_t k = 0; k < ranks[0].NumSteps(); ++k) {
    for (int r = 0; r < world; ++r) {
      const std::vector<MicroBatchRef> cell = ranks[r].Cell(k, r);
      for (const MicroBatchRef& mb : cell) {
        const int d = mb.sp_degree;
        used.insert(d);
        // The group's first rank lists the same micro-batches of degree d in the same order.
        std::vector<std::vector<int64_t>> mine, lead;
        for (const MicroBatchRef& x : cell) {
          if (x.sp_degree == d) mine.emplace_back(x.ids.begin(), x.ids.end());
        }
        for (const MicroBatchRef& x : ranks[r / d * d].Cell(k, r / d * d)) {
          if (x.sp_degree == d) lead.emplace_back(x.ids.begin(), x.ids.end());
        }
        EXPECT_EQ(mine, lead) << "step " << k << " rank " << r << " degree " << d;
        if (r % d == 0) seen.insert(mb.ids.begin(), mb.ids.end());
      }
    }
  }
  EXPECT_EQ(used, (std::set<int>{1, 2, 4}));
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), seen.size());
  EXPECT_EQ(static_cast<int64_t>(seen.size()) + ranks[0].DroppedSamples(),
            static_cast<int64_t>(Corpus().ids.size()));
  std::vector<int> flat;
  BalancedBatchSampler s = Make({1, 2, 4}, 3);
  while (auto mb = s.NextMicroBatch()) flat.push_back(mb->sp_degree);
  std::vector<int> cells;
  for (int64_t k = 0; k < s.NumSteps(); ++k) {
    for (const MicroBatchRef& mb : s.Cell(k, 3)) cells.push_back(mb.sp_degree);
  }
  EXPECT_EQ(flat, cells);
}

TEST(SpSampler, DegreesAreInTheFingerprintAndStatesOfOtherDegreesAreRefused) {
  BalancedBatchSampler a = Make({1, 2, 4}, 0), b = Make({1, 2}, 0), c = Make({}, 0);
  EXPECT_NE(a.State().plan_fingerprint, b.State().plan_fingerprint);
  EXPECT_NE(a.State().plan_fingerprint, c.State().plan_fingerprint);
  SamplerState other = b.State();
  EXPECT_THROW(a.LoadState(other), Error);
  EXPECT_THROW(c.LoadState(a.State()), Error);
  a.LoadState(Make({1, 2, 4}, 0).State());
  // Without degrees the fingerprint is that of before: a micro-batch's sp_degree (always 1
  // there) is not mixed in.
  Plan plain = c.plan();
  const uint64_t before = PlanFingerprint(plain);
  plain.micro_batches[0].sp_degree = 2;
  EXPECT_EQ(PlanFingerprint(plain), before);
  Plan mixed = a.plan();
  const uint64_t with = PlanFingerprint(mixed);
  mixed.micro_batches[0].sp_degree = static_cast<int16_t>(mixed.micro_batches[0].sp_degree * 2);
  EXPECT_NE(PlanFingerprint(mixed), with);
}

TEST(SpSampler, DegreeListErrorsNameTheArgument) {
  EXPECT_EQ(SpDegreesError({4, 1, 2}, 8, "sp_degrees"), std::nullopt);
  EXPECT_EQ(*SpDegreesError({1, 3}, 8, "sp_degrees"),
            "sp_degrees: 3 is not a power of two in [1, 8]");
  EXPECT_EQ(*SpDegreesError({16}, 32, "sp_degrees"),
            "sp_degrees: 16 is not a power of two in [1, 8]");
  EXPECT_EQ(*SpDegreesError({1, 4}, 2, "sp_degrees"),
            "sp_degrees: 4 must be at most the world size 2 and divide it");
  EXPECT_EQ(*SpDegreesError({2, 2}, 4, "sp_degrees"), "sp_degrees: 2 is given twice");
  EXPECT_NE(SpDegreesError({}, 4, "sp_degrees")->find("the list is empty"), std::string::npos);
  SamplerConfig config;
  config.plan.sp_degrees = {1, 2};
  config.plan.policy = Policy::kAdaptive;
  EXPECT_NE(SamplerConfigError(config, 0, 4)->find("sp_degrees: needs policy 'balanced'"),
            std::string::npos);
  config.plan.policy = Policy::kBalanced;
  EXPECT_EQ(SamplerConfigError(config, 0, 4), std::nullopt);
  EXPECT_EQ(*SamplerConfigError(config, 0, 1),
            "sp_degrees: 2 must be at most the world size 1 and divide it");
}

}  // namespace
}  // namespace ditscale::balance
