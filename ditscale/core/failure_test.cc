// The named Failure factories: each fills the fields its documentation names, and ToString()
// keeps the one user-facing form "file:line: column 'x': message".
#include <gtest/gtest.h>

#include "ditscale/core/result.h"

namespace ditscale {
namespace {

TEST(Failure, InFileNamesFileLineAndColumn) {
  const Failure f = Failure::InFile("m.csv", 7, "num_frames", "frames must be positive");
  EXPECT_EQ(f.file, "m.csv");
  EXPECT_EQ(f.line, 7);
  EXPECT_EQ(f.column, "num_frames");
  EXPECT_EQ(f.ToString(), "m.csv:7: column 'num_frames': frames must be positive");
}

TEST(Failure, InFileWithoutLineOrColumn) {
  EXPECT_EQ(Failure::InFile("cost.json", 0, "", "cannot open cost model file").ToString(),
            "cost.json: cannot open cost model file");
  EXPECT_EQ(Failure::InFile("cost.json", 0, "p", "exponent out of range").ToString(),
            "cost.json: column 'p': exponent out of range");
}

TEST(Failure, InvalidArgumentNamesTheField) {
  const Failure f = Failure::InvalidArgument("rank 9 is not in the schedule's 4 ranks", "rank");
  EXPECT_TRUE(f.file.empty());
  EXPECT_EQ(f.line, 0);
  EXPECT_EQ(f.ToString(), "column 'rank': rank 9 is not in the schedule's 4 ranks");
  EXPECT_EQ(Failure::InvalidArgument("no ranks").ToString(), "no ranks");
}

TEST(Failure, InfeasibleUnavailableAndBackendError) {
  EXPECT_EQ(Failure::Infeasible("no feasible configuration", "strategy").ToString(),
            "column 'strategy': no feasible configuration");
  EXPECT_EQ(Failure::Unavailable("ditscale was built without NCCL").ToString(),
            "ditscale was built without NCCL");
  EXPECT_EQ(Failure::Unavailable("no green contexts", "comm_sms").column, "comm_sms");
  const Failure b = Failure::BackendError("NCCL rank 1 of 2: timed out");
  EXPECT_EQ(b.ToString(), "NCCL rank 1 of 2: timed out");
  EXPECT_TRUE(b.column.empty());
}

TEST(Failure, IoErrorNamesTheFileButNoColumn) {
  const Failure f = Failure::IoError("cannot open for writing: Permission denied", "r.html");
  EXPECT_EQ(f.line, 0);
  EXPECT_TRUE(f.column.empty());
  EXPECT_EQ(f.ToString(), "r.html: cannot open for writing: Permission denied");
  EXPECT_EQ(Failure::IoError("error writing r.html: No space left on device").ToString(),
            "error writing r.html: No space left on device");
}

TEST(Failure, FactoriesMatchTheAggregateForm) {
  const Failure a{"bad", "f.json", 3, "x"};
  const Failure b = Failure::InFile("f.json", 3, "x", "bad");
  EXPECT_EQ(a.ToString(), b.ToString());
  Result<int> r = Failure::InvalidArgument("must be >= 1", "machines");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.failure().ToString(), "column 'machines': must be >= 1");
}

}  // namespace
}  // namespace ditscale
