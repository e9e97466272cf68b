// The parser of the AdaLN plan override (the kernel benchmark's --variants): fields set by name,
// errors name the source and the entry.
#include "ditscale/kernels/internal/adaln_tuning.h"

#include <gtest/gtest.h>

#include <string>

#include "ditscale/core/error.h"

namespace ditscale::kernels::internal {
namespace {

TEST(AdaLNTuning, AppliesNamedIntegerKnobs) {
  AdaLNTuning t;
  apply_adaln_tuning(t, "pdl=0,fwd_kernel=3,,pipelined=0,max_resident_blocks=7", "TEST");
  EXPECT_EQ(t.pdl, 0);
  EXPECT_EQ(t.fwd_kernel, 3);
  EXPECT_FALSE(t.pipelined);
  EXPECT_EQ(t.max_resident_blocks, 7);
  AdaLNTuning u;
  apply_adaln_tuning(u, nullptr, "TEST");
  apply_adaln_tuning(u, "", "TEST");
  EXPECT_EQ(u.pdl, AdaLNTuning{}.pdl);
  EXPECT_EQ(u.fwd_kernel, AdaLNTuning{}.fwd_kernel);
}

TEST(AdaLNTuning, RejectsBadEntriesNamingThem) {
  auto expect_throw = [](const char* text, const std::string& needle) {
    AdaLNTuning t;
    try {
      apply_adaln_tuning(t, text, "--variants");
      ADD_FAILURE() << "no throw for '" << text << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_throw("pdl=1,fast=1", "--variants: entry 'fast=1': no AdaLN tuning knob");
  expect_throw("pdl", "--variants: entry 'pdl' is not name=value");
  expect_throw("pdl=on", "entry 'pdl=on': 'on' is not an integer");
  expect_throw("pdl=", "entry 'pdl=': '' is not an integer");
  expect_throw("bwd_stages=2x", "'2x' is not an integer");
  expect_throw("pipelined=2", "pipelined takes 0 or 1");
  expect_throw("fwd_kernel=4", "entry 'fwd_kernel=4': fwd_kernel: 4 is out of range [0, 3]");
  expect_throw("pdl=-1", "entry 'pdl=-1': pdl: -1 is out of range [0, 1]");
  expect_throw("max_resident_blocks=-3", "max_resident_blocks: -3 is out of range [0, ");
  // The search knobs of the kernel tuning are gone (adaln-kernel-notes.md, "Removed variants").
  expect_throw("bwd_stages=3", "entry 'bwd_stages=3': no AdaLN tuning knob named 'bwd_stages'");
  expect_throw("fwd_tma_vecs=5", "no AdaLN tuning knob named 'fwd_tma_vecs'");
}

}  // namespace
}  // namespace ditscale::kernels::internal
