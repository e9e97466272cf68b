#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "ditscale/core/temp_dir_test_util.h"

namespace ditscale::testing {
namespace {

// The directory and every file written into it are gone once the TempDir is.
TEST(TempDir, RemovesItselfAndItsFiles) {
  std::string dir, file;
  {
    TempDir d("ds_tempdir_");
    dir = d.path();
    EXPECT_EQ(std::filesystem::path(dir).parent_path(), std::filesystem::temp_directory_path());
    EXPECT_EQ(std::filesystem::path(dir).filename().string().rfind("ds_tempdir_", 0), 0u);
    file = d.Write("a.json", "{}");
    d.Write("b.json", "[]");
    std::filesystem::create_directory(dir + "/sub");
    std::ofstream(dir + "/sub/c.txt") << "x";
    std::ifstream in(file);
    std::string text;
    in >> text;
    EXPECT_EQ(text, "{}");
  }
  EXPECT_FALSE(std::filesystem::exists(file));
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(TempDir, TwoAreDistinct) {
  TempDir a, b;
  EXPECT_NE(a.path(), b.path());
  EXPECT_TRUE(std::filesystem::is_directory(a.path()));
}

}  // namespace
}  // namespace ditscale::testing
