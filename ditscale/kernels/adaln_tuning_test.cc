// The DITSCALE_ADALN_TUNING parser: fields set by name, errors name the variable and the entry.
#include "ditscale/kernels/internal/adaln_tuning.h"

#include <gtest/gtest.h>

#include <string>

#include "ditscale/core/error.h"

namespace ditscale::kernels::internal {
namespace {

TEST(AdaLNTuning, AppliesNamedIntegerKnobs) {
  AdaLNTuning t;
  apply_adaln_tuning(t, "pdl=0,bwd_stages=3,,fwd_warp_prefetch=-1,pipelined=0,bwd_reg_cap=0",
                     "TEST");
  EXPECT_EQ(t.pdl, 0);
  EXPECT_EQ(t.bwd_stages, 3);
  EXPECT_EQ(t.fwd_warp_prefetch, -1);
  EXPECT_FALSE(t.pipelined);
  EXPECT_EQ(t.bwd_reg_cap, 0);
  EXPECT_EQ(t.fwd_stages, AdaLNTuning{}.fwd_stages);  // untouched
  AdaLNTuning u;
  apply_adaln_tuning(u, nullptr, "TEST");
  apply_adaln_tuning(u, "", "TEST");
  EXPECT_EQ(u.pdl, AdaLNTuning{}.pdl);
}

TEST(AdaLNTuning, RejectsBadEntriesNamingThem) {
  auto expect_throw = [](const char* text, const std::string& needle) {
    AdaLNTuning t;
    try {
      apply_adaln_tuning(t, text, "DITSCALE_ADALN_TUNING");
      ADD_FAILURE() << "no throw for '" << text << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_throw("pdl=1,fast=1", "DITSCALE_ADALN_TUNING: entry 'fast=1': no AdaLN tuning knob");
  expect_throw("pdl", "DITSCALE_ADALN_TUNING: entry 'pdl' is not name=value");
  expect_throw("pdl=on", "entry 'pdl=on': 'on' is not an integer");
  expect_throw("pdl=", "entry 'pdl=': '' is not an integer");
  expect_throw("bwd_stages=2x", "'2x' is not an integer");
  expect_throw("pipelined=2", "pipelined takes 0 or 1");
}

}  // namespace
}  // namespace ditscale::kernels::internal
