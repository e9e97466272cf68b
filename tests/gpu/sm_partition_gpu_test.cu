// SM partitions (runtime/sm_partition.h) on a real GPU: a kernel on a partition stream runs on no
// more SMs than the partition has, one on an ordinary stream reaches (nearly) all of them, and a
// kernel of the primary context issued after a long partition kernel finishes long before it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/runtime/sm_partition.h"
#include "ditscale/sp/topology.h"
#include "tests/gpu/gpu_test_util.h"

namespace ditscale::runtime {
namespace {

__global__ void MarkSms(int* used, long long spin_cycles) {
  unsigned smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) used[smid] = 1;
  const long long t0 = clock64();
  while (clock64() - t0 < spin_cycles) {
  }
}

// 4096 ints of device memory (throws when out of memory).
cuda::DeviceBuffer Ints() {
  return cuda::DeviceBuffer::Allocate(4096 * sizeof(int)).ValueOrThrow();
}

// Distinct SMs a grid of many spinning blocks touched on `stream` (CUDA errors throw).
int SmsUsed(cudaStream_t stream, int device_sms) {
  const cuda::DeviceBuffer buf = Ints();
  int* used = reinterpret_cast<int*>(buf.data());
  DS_CHECK_CUDA(cudaMemset(used, 0, buf.bytes()));
  MarkSms<<<device_sms * 16, 128, 0, stream>>>(used, 200000);
  DS_CHECK_CUDA(cudaGetLastError());
  DS_CHECK_CUDA(cudaStreamSynchronize(stream));
  std::vector<int> host(4096);
  DS_CHECK_CUDA(cudaMemcpy(host.data(), used, buf.bytes(), cudaMemcpyDeviceToHost));
  int n = 0;
  for (int u : host) n += u;
  return n;
}

TEST(SmPartitionGpu, KernelsStayInTheirPartition) {
  if (!gpu_test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto info = QuerySmPartitions(0);
  ASSERT_TRUE(info.ok()) << info.failure().ToString();
  int device_sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  EXPECT_EQ(info->device_sms, device_sms);
  EXPECT_GT(info->step, 0);
  auto sms = ComputeSmsForDevice(0, 4);
  ASSERT_TRUE(sms.ok()) << sms.failure().ToString();
  EXPECT_EQ(*sms, sp::PartitionSms(device_sms, info->step, 4));
  EXPECT_LE(*sms, device_sms - 4);
  auto st = CreatePartitionStream(0, *sms, 0);
  ASSERT_TRUE(st.ok()) << st.failure().ToString();
  const cuda::Stream part_owner = cuda::Stream::Adopt(static_cast<cudaStream_t>(*st));
  const cuda::Stream whole_owner = cuda::Stream::Create(0);
  cudaStream_t part = part_owner.get(), whole = whole_owner.get();
  const int in_part = SmsUsed(part, device_sms);
  const int in_whole = SmsUsed(whole, device_sms);
  EXPECT_LE(in_part, *sms);
  EXPECT_GE(in_part, *sms * 9 / 10);
  EXPECT_GT(in_whole, *sms);  // the test can tell the two apart
  // A second stream of the same partition reuses its context.
  auto st2 = CreatePartitionStream(0, *sms, 0);
  ASSERT_TRUE(st2.ok()) << st2.failure().ToString();
  const cuda::Stream part2 = cuda::Stream::Adopt(static_cast<cudaStream_t>(*st2));
  EXPECT_LE(SmsUsed(part2.get(), device_sms), *sms);
  // A short kernel issued after a long one that fills the partition runs beside it.
  const cuda::DeviceBuffer scratch_buf = Ints();
  int* scratch = reinterpret_cast<int*>(scratch_buf.data());
  cuda::Event e[4];
  for (auto& x : e) x = cuda::Event::Create(cudaEventDefault);
  DS_CHECK_CUDA(cudaEventRecord(e[0].get(), part));
  MarkSms<<<*sms * 4, 128, 0, part>>>(scratch, 50'000'000);  // ~25 ms per wave of blocks
  DS_CHECK_CUDA(cudaEventRecord(e[1].get(), part));
  DS_CHECK_CUDA(cudaEventRecord(e[2].get(), whole));
  MarkSms<<<1, 32, 0, whole>>>(scratch, 1000);
  DS_CHECK_CUDA(cudaEventRecord(e[3].get(), whole));
  DS_CHECK_CUDA(cudaDeviceSynchronize());
  float long_ms = 0, short_ms = 0;
  DS_CHECK_CUDA(cudaEventElapsedTime(&long_ms, e[0].get(), e[1].get()));
  DS_CHECK_CUDA(cudaEventElapsedTime(&short_ms, e[2].get(), e[3].get()));
  EXPECT_LT(short_ms * 20, long_ms) << "short " << short_ms << " ms, long " << long_ms << " ms";
}

TEST(SmPartitionGpu, RefusesPartitionsThatDoNotFit) {
  if (!gpu_test::have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto info = QuerySmPartitions(0);
  ASSERT_TRUE(info.ok()) << info.failure().ToString();
  auto none = ComputeSmsForDevice(0, info->device_sms);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.failure().column, "comm_sms");
  EXPECT_EQ(ComputeSmsForDevice(0, 0).value(), info->device_sms);
  auto odd = CreatePartitionStream(0, info->step + 1, 0);
  EXPECT_FALSE(odd.ok());
}

}  // namespace
}  // namespace ditscale::runtime
