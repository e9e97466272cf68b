#include "ditscale/comm/comm_common.h"

#include <cstdint>

#include "ditscale/core/error.h"

namespace ditscale::comm::internal {

using ::ditscale::internal::StrCat;

std::string CheckRankArgs(const char* who, int nranks, int rank, int device) {
  if (nranks < 1) return StrCat(who, ": nranks must be >= 1, got ", nranks);
  if (rank < 0 || rank >= nranks) {
    return StrCat(who, ": rank ", rank, " is out of range for nranks ", nranks,
                  " (want 0 <= rank < nranks)");
  }
  if (device < 0) return StrCat(who, ": rank ", rank, ": device must be >= 0, got ", device);
  return {};
}

std::string CheckPeer(const char* what, int rank, int nranks, int peer) {
  if (peer < 0 || peer >= nranks) {
    return StrCat(what, " on rank ", rank, ": peer ", peer, " is out of range for ", nranks,
                  " ranks (want 0 <= peer < ", nranks, ")");
  }
  return {};
}

std::string CheckBytes(const char* what, int rank, int peer, std::size_t bytes, const void* buf,
                       const char* buf_name) {
  if (bytes > static_cast<std::size_t>(PTRDIFF_MAX)) {
    return StrCat(what, " on rank ", rank, " with peer ", peer, ": bytes = ", bytes,
                  " is too large (a negative count converted to size_t?)");
  }
  if (bytes > 0 && buf == nullptr) {
    return StrCat(what, " on rank ", rank, " with peer ", peer, ": ", buf_name, " is null for ",
                  bytes, " bytes");
  }
  return {};
}

void ThrowIf(const std::string& msg) {
  if (!msg.empty()) DS_FAIL(msg);
}

}  // namespace ditscale::comm::internal
