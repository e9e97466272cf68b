// RAII owners of CUDA runtime resources: DeviceGuard (the current device for a scope), Stream,
// Event and DeviceBuffer (move-only; each destroys its handle in its destructor, never throws).
//
// Creation throws ditscale::Error through DS_CHECK_CUDA (cuda_check.h), except DeviceBuffer's
// Allocate, which returns a Failure: running out of device memory is an expected outcome that the
// caller words with its context (which buffer, how many bytes). Handles belong to the device that
// was current when they were made; destroy them with any device current (the runtime finds the
// owning context), but synchronize first what must finish before memory is freed.
//
// Header-only, for CUDA-aware translation units (see cuda_check.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <new>
#include <string>
#include <utility>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/result.h"

namespace ditscale::cuda {

// Makes `device` current for the scope and restores the device that was current before (also
// when the scope is left by an exception). Not copyable, not movable: a scope object.
class DeviceGuard {
 public:
  // Throws ditscale::Error when the current device cannot be read or `device` cannot be set.
  explicit DeviceGuard(int device) {
    DS_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) DS_CHECK_CUDA(cudaSetDevice(device));
  }
  // For destructors and cleanup: ignores errors (and then restores nothing).
  DeviceGuard(int device, std::nothrow_t) {
    if (cudaGetDevice(&previous_) != cudaSuccess) {
      (void)cudaGetLastError();
      previous_ = -1;
      return;
    }
    if (previous_ != device && cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ < 0) return;
    if (cudaGetDevice(&now) != cudaSuccess || now != previous_) {
      if (cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
    }
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  int previous() const { return previous_; }  // -1 when unknown (nothrow guard that failed)

 private:
  int previous_ = -1;
};

namespace internal {

// A move-only owner of one handle H destroyed by Destroy (a cudaError_t (*)(H)); null = empty.
template <typename H, cudaError_t (*Destroy)(H)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(H h) : h_(h) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, H{})) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, H{});
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  H get() const { return h_; }
  explicit operator bool() const { return h_ != H{}; }
  // Gives up ownership: the caller destroys the handle.
  H release() { return std::exchange(h_, H{}); }
  // Destroys the handle now (errors ignored: a destructor cannot report them).
  void reset() {
    if (h_ != H{} && Destroy(h_) != cudaSuccess) (void)cudaGetLastError();
    h_ = H{};
  }

 private:
  H h_{};
};

inline cudaError_t FreeDevice(void* p) { return cudaFree(p); }

}  // namespace internal

// A CUDA stream of the device current at Create.
class Stream : public internal::Handle<cudaStream_t, cudaStreamDestroy> {
 public:
  Stream() = default;
  // Takes ownership of a stream made elsewhere (e.g. a green context's, sm_partition.h).
  static Stream Adopt(cudaStream_t s) { return Stream(s); }
  // cudaStreamCreateWithPriority(flags, priority); lower numbers are higher priorities
  // (cudaDeviceGetStreamPriorityRange).
  static Stream Create(int priority, unsigned flags = cudaStreamNonBlocking) {
    cudaStream_t s = nullptr;
    DS_CHECK_CUDA(cudaStreamCreateWithPriority(&s, flags, priority));
    return Stream(s);
  }

 private:
  explicit Stream(cudaStream_t s) : Handle(s) {}
};

// A CUDA event of the device current at Create; without timing by default (cheaper to record
// and wait for). Pass cudaEventDefault for cudaEventElapsedTime.
class Event : public internal::Handle<cudaEvent_t, cudaEventDestroy> {
 public:
  Event() = default;
  static Event Create(unsigned flags = cudaEventDisableTiming) {
    cudaEvent_t e = nullptr;
    DS_CHECK_CUDA(cudaEventCreateWithFlags(&e, flags));
    return Event(e);
  }

 private:
  explicit Event(cudaEvent_t e) : Handle(e) {}
};

// `bytes` of device memory on the device current at Allocate (cudaMalloc: uninitialised).
class DeviceBuffer : public internal::Handle<void*, internal::FreeDevice> {
 public:
  DeviceBuffer() = default;
  // bytes == 0 gives an empty buffer. A Failure "cudaMalloc of <n> bytes failed: <error>" when
  // the device has not enough memory (the error is cleared: out of memory is not sticky).
  static Result<DeviceBuffer> Allocate(std::size_t bytes) {
    if (bytes == 0) return DeviceBuffer();
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Failure::Unavailable("cudaMalloc of " + std::to_string(bytes) +
                                  " bytes failed: " + CudaErrorText(e));
    }
    return DeviceBuffer(p, bytes);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : Handle(std::move(o)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Handle::operator=(std::move(o));
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  char* data() const { return static_cast<char*>(get()); }
  std::size_t bytes() const { return bytes_; }
  void reset() {
    Handle::reset();
    bytes_ = 0;
  }
  void* release() {
    bytes_ = 0;
    return Handle::release();
  }

 private:
  DeviceBuffer(void* p, std::size_t bytes) : Handle(p), bytes_(bytes) {}
  std::size_t bytes_ = 0;
};

}  // namespace ditscale::cuda
