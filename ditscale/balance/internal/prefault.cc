// See prefault.h.
#include "ditscale/balance/internal/prefault.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>

namespace ditscale::balance::internal {

void PrefaultForWrite(const void* p, size_t bytes) {
#if defined(MADV_POPULATE_WRITE)
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = (reinterpret_cast<uintptr_t>(p) + page - 1) / page * page;
  const auto end = (reinterpret_cast<uintptr_t>(p) + bytes) / page * page;
  // In slices, so that the writer, which starts at the front, finds its pages mapped early.
  constexpr uintptr_t kSlice = uintptr_t{4} << 20;
  for (uintptr_t a = begin; a < end; a += kSlice) {
    const uintptr_t len = end - a < kSlice ? end - a : kSlice;
    if (madvise(reinterpret_cast<void*>(a), len, MADV_POPULATE_WRITE) != 0) return;
  }
#else
  (void)p;
  (void)bytes;
#endif
}

}  // namespace ditscale::balance::internal
