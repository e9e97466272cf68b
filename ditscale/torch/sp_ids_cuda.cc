// Communicator ids as tensors (sp_ids.h).
#include "ditscale/comm/nvshmem_comm.h"
#include "ditscale/torch/sp_ids.h"

namespace ditscale::torch_ext {
namespace {

template <typename Id>
at::Tensor IdToTensor(const Id& id) {
  at::Tensor t = at::empty({comm::kUniqueIdBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(t.data_ptr(), id.bytes.data(), comm::kUniqueIdBytes);
  return t;
}

}  // namespace

at::Tensor sp_nccl_id() {
  auto id = comm::NcclNewId();
  TORCH_CHECK(id.ok(), "ditscale.sp: ", id.failure().ToString());
  return IdToTensor(id.value());
}

at::Tensor sp_nvshmem_id() {
  auto id = comm::NvshmemNewId();
  TORCH_CHECK(id.ok(), "ditscale.sp: ", id.failure().ToString());
  return IdToTensor(id.value());
}

std::string sp_nvshmem_unavailable() {
  return comm::NvshmemAvailable() ? std::string() : comm::NvshmemUnavailableReason();
}

}  // namespace ditscale::torch_ext
