// Test helper (header only): a fresh directory under the system temp directory, removed with
// everything in it when the TempDir goes out of scope, so a test leaves no file behind.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "ditscale/core/error.h"

namespace ditscale::testing {

class TempDir {
 public:
  // A directory <temp>/<prefix>XXXXXX made by mkdtemp (mode 0700).
  explicit TempDir(const std::string& prefix = "ditscale_test_") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
    DS_CHECK(::mkdtemp(pattern.data()) != nullptr, "mkdtemp ", pattern);
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ec;  // best effort: a destructor does not throw
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // Writes `text` to <dir>/<name> and returns that path.
  std::string Write(const std::string& name, const std::string& text) const {
    const std::string file = path_ + "/" + name;
    std::ofstream(file, std::ios::binary) << text;
    return file;
  }

 private:
  std::string path_;
};

}  // namespace ditscale::testing
