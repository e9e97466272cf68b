// Host helpers of the AdaLN launchers: views -> kernel args, occupancy-sized grids and the launch
// itself (programmatic dependent launch on sm_90+). The plans (which kernel, how many vectors per
// thread) are in adaln_plan.h. Included by adaln.cu / adaln_bwd.cu.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <utility>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/error.h"
#include "ditscale/kernels/adaln.h"
#include "ditscale/kernels/internal/adaln_device.cuh"
#include "ditscale/kernels/internal/adaln_tuning.h"

namespace ditscale::kernels::internal {

inline DevView to_dev(const RowsView& v) {
  DevView d;
  d.data = v.data;
  d.sb = v.stride_b;
  d.sn = v.stride_n;
  d.f32 = v.dtype == DType::kFloat32;
  return d;
}

// Blocks of `kernel` (block of `threads`, `smem` bytes of dynamic shared memory) resident at once
// on one SM of the current device (the occupancy calculator's value). Raises the kernel's dynamic
// shared-memory limit first when smem > 48 KB. Throws when none fits.
template <typename Kernel>
int blocks_per_sm(Kernel* kernel, int threads, std::size_t smem) {
  if (smem > 32 * 1024) {  // the static shared memory counts against the 48 KB default too
    DS_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  }
  int per_sm = 0;
  DS_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  DS_CHECK(per_sm > 0, "AdaLN: a block of ", threads, " threads with ", smem,
           " bytes of shared memory does not fit on an SM");
  return per_sm;
}

// The same on the whole device (x SMs), capped by AdaLNTuning::max_resident_blocks.
template <typename Kernel>
std::int64_t resident_blocks(Kernel* kernel, int threads, std::size_t smem) {
  int per_sm = blocks_per_sm(kernel, threads, smem);
  int device = 0, sms = 0;
  DS_CHECK_CUDA(cudaGetDevice(&device));
  DS_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const AdaLNTuning& tune = adaln_tuning();
  std::int64_t blocks = static_cast<std::int64_t>(per_sm) * sms;
  if (tune.max_resident_blocks > 0) {
    blocks = std::min<std::int64_t>(blocks, tune.max_resident_blocks);
  }
  return blocks;
}

// Launches `kernel` on `stream` and throws on a launch error. With AdaLNTuning::pdl on and an
// sm_90+ device, as a programmatic dependent launch (cudaLaunchAttributeProgrammaticStream-
// Serialization): every AdaLN kernel begins with pdl_enter() (adaln_device.cuh), so it may be
// scheduled while the previous kernel of the stream retires its last blocks and then waits there
// for that kernel's results; launch latency and block ramp-up overlap the previous tail. Also
// valid inside CUDA-graph capture (a programmatic edge).
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, std::size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1]{};
  if (adaln_tuning().pdl != 0) {
    int device = 0, major = 0;
    DS_CHECK_CUDA(cudaGetDevice(&device));
    DS_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    if (major >= 9) {
      attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attr[0].val.programmaticStreamSerializationAllowed = 1;
      config.attrs = attr;
      config.numAttrs = 1;
    }
  }
  DS_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Grid of a persistent kernel over `work` independent items: one wave of resident blocks.
template <typename Kernel>
std::int64_t persistent_grid(Kernel* kernel, int threads, std::size_t smem, std::int64_t work) {
  const std::int64_t grid = std::min(work, resident_blocks(kernel, threads, smem));
  DS_CHECK(grid >= 1 && grid <= 0x7fffffff, "AdaLN: invalid grid size ", grid);
  return grid;
}

}  // namespace ditscale::kernels::internal
