// Host helpers of the AdaLN launchers: views -> kernel args, the 16-byte alignment test of the
// vectorised path and the choice of elements per thread. Included by adaln.cu / adaln_bwd.cu.
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

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// True when every 16-byte vector of `v` at a feature index that is a multiple of the vector width
// is 16-byte aligned (absent views pass). Strides of size-1 dimensions do not matter.
inline bool view_aligned(const RowsView& v, std::int64_t batch, std::int64_t seq_len) {
  if (v.data == nullptr) return true;
  const auto esize = static_cast<std::int64_t>(dtype_size(v.dtype));
  const bool sb_ok = batch == 1 || (v.stride_b * esize) % 16 == 0;
  const bool sn_ok = seq_len == 1 || (v.stride_n * esize) % 16 == 0;
  return aligned16(v.data) && sb_ok && sn_ok;
}

inline std::int64_t round_up(std::int64_t v, std::int64_t m) { return (v + m - 1) / m * m; }

// Elements-per-thread choice: for each candidate K (vectors per thread) the row takes
// tpr = round_up(ceil(nvec / K), 32) threads; a candidate is valid when tpr <= max_threads(K).
// Pick the least idle slots (tpr * K - nvec); ties go to the higher rank(K, tpr) (default: all
// equal), then to tpr closest to `target_tpr`, then to the smaller K. Returns K = 0 when no
// candidate fits (the caller takes the general kernel).
struct VecPlan {
  int vecs = 0;     // K
  int threads = 0;  // tpr, threads per row
};

struct EqualRank {
  int operator()(int /*vecs*/, std::int64_t /*threads*/) const { return 0; }
};

template <typename MaxThreadsFn, typename RankFn = EqualRank>
VecPlan choose_vec_plan(std::int64_t nvec, const int* candidates, int num_candidates,
                        MaxThreadsFn max_threads, int target_tpr, RankFn rank = {}) {
  VecPlan best;
  std::int64_t best_waste = 0;
  int best_rank = 0;
  for (int i = 0; i < num_candidates; ++i) {
    const int k = candidates[i];
    const std::int64_t tpr = round_up((nvec + k - 1) / k, 32);
    if (tpr > max_threads(k)) continue;
    const std::int64_t waste = tpr * k - nvec;
    const int r = rank(k, tpr);
    const bool closer = std::llabs(tpr - target_tpr) < std::llabs(best.threads - target_tpr);
    const bool better = best.vecs == 0 || waste < best_waste ||
                        (waste == best_waste && (r != best_rank ? r > best_rank : closer));
    if (better) {
      best.vecs = k;
      best.threads = static_cast<int>(tpr);
      best_waste = waste;
      best_rank = r;
    }
  }
  return best;
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

// The same on the whole device (x SMs), capped by AdaLNTuning's limits.
template <typename Kernel>
std::int64_t resident_blocks(Kernel* kernel, int threads, std::size_t smem) {
  int per_sm = blocks_per_sm(kernel, threads, smem);
  int device = 0, sms = 0;
  DS_CHECK_CUDA(cudaGetDevice(&device));
  DS_CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const AdaLNTuning& tune = adaln_tuning();
  if (tune.max_blocks_per_sm > 0) per_sm = std::min(per_sm, tune.max_blocks_per_sm);
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
