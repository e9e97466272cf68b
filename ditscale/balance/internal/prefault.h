// Mapping the pages of a large array before it is first written, on another thread than the one
// that will write it: a fresh anonymous page costs a fault (zeroing, accounting) on its first
// write, ~20% of `ditscale plan`'s time on 10M samples. The planner hands that cost for its
// big arrays to a helper thread while its own thread fills them.
#pragma once

#include <cstddef>

namespace ditscale::balance::internal {

// Maps the whole pages within [p, p + bytes) of this process's anonymous memory writable
// (madvise MADV_POPULATE_WRITE, Linux 5.14+): their contents are unchanged, a later write
// faults no more. A hint only: nothing happens where it is not supported or fails (the pages
// are then faulted by their first write as usual).
void PrefaultForWrite(const void* p, size_t bytes);

}  // namespace ditscale::balance::internal
