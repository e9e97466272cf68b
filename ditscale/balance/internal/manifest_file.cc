// Opening a manifest file within the limits of manifest.h; see manifest_file.h.
#include "ditscale/balance/internal/manifest_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ditscale/balance/internal/manifest_rows.h"
#include "ditscale/balance/manifest.h"

namespace ditscale::balance::internal {
namespace {

Failure Fail(const std::string& path, std::string message, long long line = 0) {
  return Failure{std::move(message), path, line, ""};
}

// Closes a descriptor at the end of a scope.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

ManifestFile::~ManifestFile() {
  if (map_bytes_ > 0) munmap(map_, map_bytes_);
}

std::optional<Failure> ManifestFile::Open(const std::string& path) {
  Fd fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) return Fail(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (fstat(fd.fd, &st) != 0)
    return Fail(path, std::string("cannot stat: ") + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) return Fail(path, "is a directory, not a manifest file");
  if (!S_ISREG(st.st_mode)) return ReadStream(fd.fd, path);
  const auto bytes = static_cast<uint64_t>(st.st_size);
  if (bytes > kMaxFileBytes) {
    return Fail(path, "file of " + std::to_string(bytes) + " bytes exceeds the " +
                          std::to_string(kMaxFileBytes) + "-byte limit of a manifest");
  }
  if (bytes == 0) return std::nullopt;
  void* m = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (m == MAP_FAILED) return Fail(path, std::string("cannot map: ") + std::strerror(errno));
  map_ = m;
  map_bytes_ = size_ = static_cast<size_t>(bytes);
  file_mapped_ = true;
  madvise(map_, size_, MADV_SEQUENTIAL);
  madvise(map_, size_, MADV_WILLNEED);
  return std::nullopt;
}

std::optional<Failure> ManifestFile::ReadStream(int fd, const std::string& path) {
  // One byte more than the limit, to tell "exactly the limit" from "over it".
  const size_t reserve = static_cast<size_t>(kMaxStreamBytes) + 1;
  void* m = mmap(nullptr, reserve, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    return Fail(path, std::string("cannot reserve memory for a stream: ") + std::strerror(errno));
  }
  map_ = m;
  map_bytes_ = reserve;
  char* buf = static_cast<char*>(m);
  long long line = 1;
  size_t line_start = 0;  // offset of the current physical line
  while (true) {
    const size_t room = std::min<size_t>(reserve - size_, size_t{1} << 20);
    if (room == 0) {
      return Fail(path,
                  "stream of more than " + std::to_string(kMaxStreamBytes) +
                      " bytes (the limit for a pipe or device; save it to a regular file)",
                  line);
    }
    const ssize_t n = ::read(fd, buf + size_, room);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      return Fail(path, std::string("cannot read: ") + std::strerror(errno), line);
    }
    const char* p = buf + size_;
    const char* end = p + n;
    size_ += static_cast<size_t>(n);
    for (const char* nl; (nl = static_cast<const char*>(std::memchr(p, '\n', end - p)));
         p = nl + 1) {
      if (static_cast<size_t>(nl - buf) - line_start > kMaxLineBytes) {
        return Fail(path, LineTooLong(), line);
      }
      ++line;
      line_start = static_cast<size_t>(nl - buf) + 1;
    }
    // The current line, its end not read yet, is already over the limit.
    if (size_ - line_start > kMaxLineBytes) return Fail(path, LineTooLong(), line);
  }
  return std::nullopt;
}

}  // namespace ditscale::balance::internal
