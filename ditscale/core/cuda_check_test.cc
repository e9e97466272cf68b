// DS_CHECK_CUDA / DS_CHECK_CU / DS_CHECK_NCCL / DS_CHECK_NVSHMEM and the RAII owners of
// cuda_resources.h. Runs with or without a GPU: the checks are fed status codes directly, and the
// owners are tested for real on a GPU and for their error text without one.
#include "ditscale/core/cuda_check.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "ditscale/core/cuda_resources.h"

// Stand-ins for nccl.h: DS_CHECK_NCCL names ncclSuccess and ncclGetErrorString only where it
// is expanded, so any status type with those names works (the real ones in nccl_comm.cc).
enum FakeNcclResult { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclInvalidArgument = 4 };
inline const char* ncclGetErrorString(FakeNcclResult r) {
  return r == ncclInvalidArgument ? "invalid argument (run with NCCL_DEBUG=WARN for details)"
                                  : "other";
}

namespace ditscale {
namespace {

std::string Thrown(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no exception)";
}

void ExpectContains(const std::string& s, const std::string& part) {
  EXPECT_NE(s.find(part), std::string::npos) << "'" << part << "' not in: " << s;
}

bool HaveGpu() {
  int n = 0;
  const bool ok = cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
  (void)cudaGetLastError();
  return ok;
}

TEST(CudaCheck, RuntimeErrorNamesFileLineCallAndCudaText) {
  const std::string what = Thrown([] { DS_CHECK_CUDA(cudaErrorInvalidValue); });
  ExpectContains(what, "cuda_check_test.cc:");
  ExpectContains(what, "CUDA error cudaErrorInvalidValue: invalid argument");
  ExpectContains(what, "in cudaErrorInvalidValue");
  EXPECT_NO_THROW(DS_CHECK_CUDA(cudaSuccess));
}

TEST(CudaCheck, DriverErrorNamesTheResult) {
  const std::string what = Thrown([] { DS_CHECK_CU(CUDA_ERROR_OUT_OF_MEMORY); });
  ExpectContains(what, "cuda_check_test.cc:");
  ExpectContains(what, "CUDA driver error ");
  ExpectContains(what, "in CUDA_ERROR_OUT_OF_MEMORY");
  // The driver's name when there is a driver, the number otherwise.
  if (HaveGpu()) {
    ExpectContains(what, "CUDA_ERROR_OUT_OF_MEMORY: out of memory");
  } else {
    ExpectContains(what, "CUresult 2");
  }
  EXPECT_NO_THROW(DS_CHECK_CU(CUDA_SUCCESS));
}

TEST(CudaCheck, NcclErrorNamesCodeAndText) {
  const std::string what = Thrown([] { DS_CHECK_NCCL(ncclInvalidArgument); });
  ExpectContains(what, "NCCL error 4: invalid argument (run with NCCL_DEBUG=WARN for details)");
  ExpectContains(what, "in ncclInvalidArgument");
  EXPECT_NO_THROW(DS_CHECK_NCCL(ncclSuccess));
}

TEST(CudaCheck, NvshmemStatusNamesTheCall) {
  const std::string what = Thrown([] { DS_CHECK_NVSHMEM(7 - 10); });
  ExpectContains(what, "NVSHMEM error: status -3 in 7 - 10");
  EXPECT_NO_THROW(DS_CHECK_NVSHMEM(0));
}

TEST(CudaCheck, EvaluatesTheCallOnce) {
  int calls = 0;
  auto call = [&] {
    ++calls;
    return cudaSuccess;
  };
  DS_CHECK_CUDA(call());
  EXPECT_EQ(calls, 1);
}

TEST(CudaCheck, ErrorTexts) {
  EXPECT_EQ(CudaErrorText(cudaErrorMemoryAllocation), "cudaErrorMemoryAllocation: out of memory");
  const std::string cu = CuErrorText(CUDA_ERROR_INVALID_VALUE);
  EXPECT_TRUE(cu == "CUresult 1" || cu.rfind("CUDA_ERROR_INVALID_VALUE", 0) == 0) << cu;
}

TEST(CudaResources, EmptyOwnersAreFalseAndMoveable) {
  cuda::Stream s;
  cuda::Event e;
  cuda::DeviceBuffer b;
  EXPECT_FALSE(s);
  EXPECT_FALSE(e);
  EXPECT_FALSE(b);
  EXPECT_EQ(b.bytes(), 0u);
  cuda::Stream s2 = std::move(s);
  EXPECT_FALSE(s2);
  auto zero = cuda::DeviceBuffer::Allocate(0);
  ASSERT_TRUE(zero.ok());
  EXPECT_FALSE(*zero);
}

TEST(CudaResources, WithoutGpuCreationFailsWithTheCall) {
  if (HaveGpu()) GTEST_SKIP() << "a GPU is present: see the GPU cases";
  ExpectContains(Thrown([] { (void)cuda::Stream::Create(0); }), "in cudaStreamCreateWithPriority");
  ExpectContains(Thrown([] { (void)cuda::Event::Create(); }), "in cudaEventCreateWithFlags");
  ExpectContains(Thrown([] { cuda::DeviceGuard g(0); }), "CUDA error ");
  auto b = cuda::DeviceBuffer::Allocate(1024);
  ASSERT_FALSE(b.ok());
  ExpectContains(b.failure().ToString(), "cudaMalloc of 1024 bytes failed: cuda");
  cuda::DeviceGuard quiet(0, std::nothrow);  // must not throw
  EXPECT_EQ(quiet.previous(), -1);
}

TEST(CudaResources, OnGpuOwnersWorkMoveAndRestoreTheDevice) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA device";
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  {
    cuda::DeviceGuard g(n - 1);
    int now = -1;
    ASSERT_EQ(cudaGetDevice(&now), cudaSuccess);
    EXPECT_EQ(now, n - 1);
    cuda::Stream s = cuda::Stream::Create(0);
    cuda::Event e = cuda::Event::Create();
    auto b = cuda::DeviceBuffer::Allocate(4096);
    ASSERT_TRUE(b.ok()) << b.failure().ToString();
    cuda::DeviceBuffer buf = std::move(b).value();
    EXPECT_EQ(buf.bytes(), 4096u);
    DS_CHECK_CUDA(cudaMemsetAsync(buf.data(), 0, buf.bytes(), s.get()));
    DS_CHECK_CUDA(cudaEventRecord(e.get(), s.get()));
    cuda::Stream moved = std::move(s);
    EXPECT_FALSE(s);  // NOLINT: moved-from is empty by contract
    EXPECT_TRUE(moved);
    DS_CHECK_CUDA(cudaEventSynchronize(e.get()));
    auto huge = cuda::DeviceBuffer::Allocate(std::size_t{1} << 60);
    ASSERT_FALSE(huge.ok());
    ExpectContains(huge.failure().ToString(), "cudaMalloc of 1152921504606846976 bytes failed");
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the failed allocation left no error behind
  }
  int after = -1;
  ASSERT_EQ(cudaGetDevice(&after), cudaSuccess);
  EXPECT_EQ(after, 0);
}

}  // namespace
}  // namespace ditscale
