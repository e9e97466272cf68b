// SM partitions (runtime/sm_partition.h) on a real GPU: a kernel on a partition stream runs on no
// more SMs than the partition has, one on an ordinary stream reaches (nearly) all of them, and a
// kernel of the primary context issued after a long partition kernel finishes long before it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

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

// Distinct SMs a grid of many spinning blocks touched on `stream`.
int SmsUsed(cudaStream_t stream, int device_sms) {
  int* used = nullptr;
  EXPECT_EQ(cudaMalloc(&used, 4096 * sizeof(int)), cudaSuccess);
  EXPECT_EQ(cudaMemset(used, 0, 4096 * sizeof(int)), cudaSuccess);
  MarkSms<<<device_sms * 16, 128, 0, stream>>>(used, 200000);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<int> host(4096);
  EXPECT_EQ(cudaMemcpy(host.data(), used, host.size() * sizeof(int), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(used);
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
  cudaStream_t part = static_cast<cudaStream_t>(*st);
  cudaStream_t whole = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&whole, cudaStreamNonBlocking), cudaSuccess);
  const int in_part = SmsUsed(part, device_sms);
  const int in_whole = SmsUsed(whole, device_sms);
  EXPECT_LE(in_part, *sms);
  EXPECT_GE(in_part, *sms * 9 / 10);
  EXPECT_GT(in_whole, *sms);  // the test can tell the two apart
  // A second stream of the same partition reuses its context.
  auto st2 = CreatePartitionStream(0, *sms, 0);
  ASSERT_TRUE(st2.ok()) << st2.failure().ToString();
  EXPECT_LE(SmsUsed(static_cast<cudaStream_t>(*st2), device_sms), *sms);
  // A short kernel issued after a long one that fills the partition runs beside it.
  int* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&scratch, 4096 * sizeof(int)), cudaSuccess);
  cudaEvent_t e[4];
  for (auto& x : e) ASSERT_EQ(cudaEventCreate(&x), cudaSuccess);
  cudaEventRecord(e[0], part);
  MarkSms<<<*sms * 4, 128, 0, part>>>(scratch, 50'000'000);  // ~25 ms per wave of blocks
  cudaEventRecord(e[1], part);
  cudaEventRecord(e[2], whole);
  MarkSms<<<1, 32, 0, whole>>>(scratch, 1000);
  cudaEventRecord(e[3], whole);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  float long_ms = 0, short_ms = 0;
  cudaEventElapsedTime(&long_ms, e[0], e[1]);
  cudaEventElapsedTime(&short_ms, e[2], e[3]);
  EXPECT_LT(short_ms * 20, long_ms) << "short " << short_ms << " ms, long " << long_ms << " ms";
  for (auto& x : e) cudaEventDestroy(x);
  cudaFree(scratch);
  cudaStreamDestroy(part);
  cudaStreamDestroy(static_cast<cudaStream_t>(*st2));
  cudaStreamDestroy(whole);
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
