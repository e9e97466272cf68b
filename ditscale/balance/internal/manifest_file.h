// A manifest file's bytes, within the limits of manifest.h: a regular file is mmap'ed (at most
// kMaxFileBytes); a pipe, FIFO or character device is read as it arrives into a reserved
// (MAP_NORESERVE) region of kMaxStreamBytes, its physical lines checked against kMaxLineBytes
// while reading, so `/dev/zero` fails at line 1 after 1 MiB instead of growing without end; a
// directory is refused.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

class ManifestFile {
 public:
  ManifestFile() = default;
  ManifestFile(const ManifestFile&) = delete;
  ManifestFile& operator=(const ManifestFile&) = delete;
  ~ManifestFile();

  // nullopt when the bytes are available through text(); else the Failure (file, and the line
  // for a stream line over the limit).
  std::optional<Failure> Open(const std::string& path);
  // True for a private read-only mapping of a regular file (its pages may be dropped).
  bool file_mapped() const { return file_mapped_; }
  std::string_view text() const { return std::string_view(static_cast<const char*>(map_), size_); }

 private:
  std::optional<Failure> ReadStream(int fd, const std::string& path);

  void* map_ = nullptr;
  size_t map_bytes_ = 0;  // the mapping's length (0: none)
  size_t size_ = 0;       // the bytes of text()
  bool file_mapped_ = false;
};

}  // namespace ditscale::balance::internal
