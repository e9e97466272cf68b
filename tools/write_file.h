// Checked output for the CLI: every write of a command ends in success or in the error
// "error writing <file>: <strerror>" (a full disk, /dev/full, a closed pipe), never in exit 0
// with a truncated file.
#pragma once

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>

#include "ditscale/core/error.h"

namespace ditscale::cli {

// "error writing <name>: <strerror(err)>".
inline std::string WriteErrorText(const std::string& name, int err) {
  return "error writing " + name + ": " + std::strerror(err != 0 ? err : EIO);
}

// Closes f (flushing it first) and throws ditscale::Error naming `name` when any write to it
// failed.
// errno is not cleared first: a write that failed inside an earlier buffered fprintf left its
// errno (ENOSPC, EPIPE) there.
inline void CloseChecked(std::FILE* f, const std::string& name) {
  const bool bad = std::fflush(f) != 0 || std::ferror(f) != 0;
  int err = errno;
  if (std::fclose(f) != 0 && !bad) {
    err = errno;
    throw Error(WriteErrorText(name, err));
  }
  if (bad) throw Error(WriteErrorText(name, err));
}

// Writes `text` to `path` (created or truncated); throws ditscale::Error on any failure.
inline void WriteFileChecked(const std::string& path, std::string_view text) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) throw Error("cannot open " + path + " for writing: " + std::strerror(errno));
  if (!text.empty() && std::fwrite(text.data(), 1, text.size(), f) != text.size()) {
    const int err = errno;
    std::fclose(f);
    throw Error(WriteErrorText(path, err));
  }
  CloseChecked(f, path);
}

// Flushes stdout at the end of a command; throws when anything written to it was lost.
inline void FlushStdoutChecked() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0) {
    throw Error(WriteErrorText("stdout", errno));
  }
}

}  // namespace ditscale::cli
