// Pieces shared by the NCCL and NVSHMEM transports: the size of a bootstrap unique id and the
// argument checks every transport call runs before it touches a communication library.
//
// The checks return an empty string when the arguments are fine and otherwise a message that
// names the call, the rank and the offending value, so that both the Result-returning entry points
// (Create/Init) and the throwing enqueue calls (Send/PutSignal ...) word their errors alike.
#pragma once

#include <cstddef>
#include <string>

namespace ditscale::comm {

// Bytes of an NCCL unique id (NCCL_UNIQUE_ID_BYTES) and of an NVSHMEM unique id
// (sizeof(nvshmemx_uniqueid_t)); both are 128, checked by static_asserts in the .cc files.
inline constexpr int kUniqueIdBytes = 128;

namespace internal {

// `nranks` >= 1, 0 <= `rank` < nranks, `device` >= 0. `who` names the caller in the message,
// e.g. "NcclComm::Create".
std::string CheckRankArgs(const char* who, int nranks, int rank, int device);

// 0 <= `peer` < nranks. `what` names the operation ("send", "recv", "put_signal" ...).
std::string CheckPeer(const char* what, int rank, int nranks, int peer);

// A byte count and its buffer: bytes above PTRDIFF_MAX are rejected as a negative count that was
// converted to size_t; a null buffer is rejected when bytes > 0. bytes == 0 is valid (a no-op).
std::string CheckBytes(const char* what, int rank, int peer, std::size_t bytes, const void* buf,
                       const char* buf_name);

// Throws ditscale::Error with `msg` when it is not empty (the argument checks above, in calls
// that report errors by throwing).
void ThrowIf(const std::string& msg);

}  // namespace internal
}  // namespace ditscale::comm
