// The GPU executor's resources (runtime/gpu_executor.h): Create, Run, tracing and the destructor
// on a real GPU leave the caller's current device as it was, with the compute stream on the whole
// GPU or in an SM partition; and Create's argument failures (no GPU needed). A compute-only
// replay of a 2-rank Ulysses schedule: no transport, an attention backend that only counts.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/strategies.h"
#include "tests/gpu/gpu_test_util.h"

namespace ditscale::runtime {
namespace {

class CountingAttention final : public AttentionBackend {
 public:
  void Attention(const AttentionArgs&, void*) override { ++calls; }
  int calls = 0;
};

sp::Schedule UlyssesSchedule(int comm_sms = 0) {
  sp::SpConfig cfg;
  cfg.strategy = sp::Strategy::kUlysses;
  cfg.comm_sms = comm_sms;
  sp::AttentionShape shape;
  shape.batch = 1;
  shape.seq_tokens = 512;
  shape.heads = 4;
  shape.head_dim = 64;
  shape.dtype_bytes = 2;
  return sp::BuildSchedule(sp::SpMesh{1, 2}, cfg, shape).ValueOrThrow();
}

Transports ComputeOnly() {
  Transports t;
  t.compute_only = true;
  return t;
}

int CurrentDevice() {
  int d = -1;
  DS_CHECK_CUDA(cudaGetDevice(&d));
  return d;
}

TEST(GpuExecutorArgs, CreateNamesTheBadArgument) {
  CountingAttention attention;
  auto bad_rank = GpuExecutor::Create(UlyssesSchedule(), 2, kernels::DType::kBFloat16, 0,
                                      ComputeOnly(), &attention);
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_EQ(bad_rank.failure().ToString(),
            "column 'rank': rank 2 is not in the schedule's 2 ranks");
  auto no_backend = GpuExecutor::Create(UlyssesSchedule(), 0, kernels::DType::kBFloat16, 0,
                                        ComputeOnly(), nullptr);
  ASSERT_FALSE(no_backend.ok());
  EXPECT_EQ(no_backend.failure().ToString(), "column 'attention': no attention backend");
  auto fp32 = GpuExecutor::Create(UlyssesSchedule(), 0, kernels::DType::kFloat32, 0, ComputeOnly(),
                                  &attention);
  ASSERT_FALSE(fp32.ok());
  EXPECT_EQ(fp32.failure().column, "dtype");
  auto no_nccl = GpuExecutor::Create(UlyssesSchedule(), 0, kernels::DType::kBFloat16, 0,
                                     Transports{}, &attention);
  ASSERT_FALSE(no_nccl.ok());
  EXPECT_EQ(no_nccl.failure().column, "transports");
  EXPECT_NE(no_nccl.failure().message.find("no NCCL communicator"), std::string::npos);
}

// Runs `layers` layers on the last GPU with device 0 current, checking the current device after
// every call, then the traced timeline.
void RunOnLastGpu(int comm_sms, int layers) {
  int n = 0;
  DS_CHECK_CUDA(cudaGetDeviceCount(&n));
  const int device = n - 1;
  DS_CHECK_CUDA(cudaSetDevice(0));
  CountingAttention attention;
  auto made = GpuExecutor::Create(UlyssesSchedule(comm_sms), 0, kernels::DType::kBFloat16, device,
                                  ComputeOnly(), &attention);
  ASSERT_TRUE(made.ok()) << made.failure().ToString();
  std::unique_ptr<GpuExecutor> ex = std::move(made).value();
  EXPECT_EQ(CurrentDevice(), 0) << "Create changed the current device";
  if (comm_sms > 0) {
    EXPECT_GT(ex->compute_sms(), 0);
  } else {
    EXPECT_EQ(ex->compute_sms(), 0);
  }
  auto untraced = ex->LastTimeline();
  ASSERT_FALSE(untraced.ok());
  EXPECT_EQ(untraced.failure().column, "trace");

  const sp::RankProgram& prog = ex->schedule().ranks[0];
  const sp::AttentionShape& shape = ex->schedule().shape;
  const std::size_t bytes = static_cast<std::size_t>(shape.batch * prog.image_token_count *
                                                     shape.heads * shape.head_dim * 2);
  cuda::DeviceBuffer q, k, v, out;
  cuda::Stream stream;
  {
    cuda::DeviceGuard on(device);
    q = cuda::DeviceBuffer::Allocate(bytes).ValueOrThrow();
    k = cuda::DeviceBuffer::Allocate(bytes).ValueOrThrow();
    v = cuda::DeviceBuffer::Allocate(bytes).ValueOrThrow();
    out = cuda::DeviceBuffer::Allocate(bytes).ValueOrThrow();
    stream = cuda::Stream::Create(0);
  }
  LayerIo io;
  io.q = q.data();
  io.k = k.data();
  io.v = v.data();
  io.out = out.data();
  ex->SetTrace(true);
  EXPECT_EQ(CurrentDevice(), 0) << "SetTrace changed the current device";
  for (int i = 0; i < layers; ++i) ex->Run(io, stream.get());
  EXPECT_EQ(CurrentDevice(), 0) << "Run changed the current device";
  EXPECT_EQ(ex->layers_run(), layers);
  EXPECT_GT(attention.calls, 0);
  auto timeline = ex->LastTimeline();
  ASSERT_TRUE(timeline.ok()) << timeline.failure().ToString();
  EXPECT_EQ(timeline->size(), ex->plan().units.size());
  EXPECT_EQ(CurrentDevice(), 0) << "LastTimeline changed the current device";
  ex.reset();
  EXPECT_EQ(CurrentDevice(), 0) << "the destructor changed the current device";
  DS_CHECK_CUDA(cudaStreamSynchronize(stream.get()));
  DS_CHECK_CUDA(cudaGetLastError());
}

TEST(GpuExecutorGpu, WholeGpuKeepsTheCallersDevice) {
  SKIP_WITHOUT_GPU();
  RunOnLastGpu(0, 3);
}

TEST(GpuExecutorGpu, PartitionedComputeStreamKeepsTheCallersDevice) {
  SKIP_WITHOUT_GPU();
  RunOnLastGpu(8, 2);
}

TEST(GpuExecutorGpu, ManyExecutorsCreatedAndDestroyed) {
  SKIP_WITHOUT_GPU();
  CountingAttention attention;
  for (int i = 0; i < 50; ++i) {
    auto ex = GpuExecutor::Create(UlyssesSchedule(), i % 2, kernels::DType::kBFloat16, 0,
                                  ComputeOnly(), &attention);
    ASSERT_TRUE(ex.ok()) << ex.failure().ToString();
  }
  DS_CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace
}  // namespace ditscale::runtime
