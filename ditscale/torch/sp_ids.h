// Unique ids of the communicators (NCCL, NVSHMEM) as uint8 CPU tensors of
// comm::kUniqueIdBytes bytes: made on one rank, broadcast by ditscale.sp through the process
// group, turned back into ids on every rank.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <string>

#include "ditscale/comm/nccl_comm.h"

namespace ditscale::torch_ext {

// The id in `t`; fails naming `what` unless t is uint8 of kUniqueIdBytes elements.
template <typename Id>
Id IdFromTensor(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.numel() == comm::kUniqueIdBytes,
              "ditscale.sp: ", what, " must be a uint8 tensor of ", comm::kUniqueIdBytes, " bytes");
  at::Tensor c = t.to(at::kCPU).contiguous();
  Id id;
  std::memcpy(id.bytes.data(), c.data_ptr(), comm::kUniqueIdBytes);
  return id;
}

// torch.ops.ditscale.sp_nccl_id / sp_nvshmem_id: a new id.
at::Tensor sp_nccl_id();
at::Tensor sp_nvshmem_id();
// torch.ops.ditscale.sp_nvshmem_unavailable: "" when one-sided transfers can run, else why not.
std::string sp_nvshmem_unavailable();

}  // namespace ditscale::torch_ext
