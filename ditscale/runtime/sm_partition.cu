#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "ditscale/core/cuda_check.h"
#include "ditscale/core/cuda_resources.h"
#include "ditscale/runtime/sm_partition.h"
#include "ditscale/sp/topology.h"

namespace ditscale::runtime {
namespace {

struct GreenApi {
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetDevResource_v12040 get_resource = nullptr;
  PFN_cuDevSmResourceSplitByCount_v12040 split = nullptr;
  PFN_cuDevResourceGenerateDesc_v12040 generate_desc = nullptr;
  PFN_cuGreenCtxCreate_v12040 create = nullptr;
  PFN_cuGreenCtxStreamCreate_v12050 stream_create = nullptr;
  std::string missing;  // the first entry point the driver lacks
};

const GreenApi& Api() {
  static const GreenApi api = [] {
    GreenApi a;
    auto load = [&a](const char* name, int version) -> void* {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e =
          cudaGetDriverEntryPointByVersion(name, &fn, version, cudaEnableDefault, &q);
      if ((e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) &&
          a.missing.empty()) {
        (void)cudaGetLastError();
        a.missing = std::string(name) + " (" + CudaErrorText(e) + ")";
      }
      return fn;
    };
    a.device_get = reinterpret_cast<PFN_cuDeviceGet_v2000>(load("cuDeviceGet", 2000));
    a.get_resource =
        reinterpret_cast<PFN_cuDeviceGetDevResource_v12040>(load("cuDeviceGetDevResource", 12040));
    a.split = reinterpret_cast<PFN_cuDevSmResourceSplitByCount_v12040>(
        load("cuDevSmResourceSplitByCount", 12040));
    a.generate_desc = reinterpret_cast<PFN_cuDevResourceGenerateDesc_v12040>(
        load("cuDevResourceGenerateDesc", 12040));
    a.create = reinterpret_cast<PFN_cuGreenCtxCreate_v12040>(load("cuGreenCtxCreate", 12040));
    a.stream_create =
        reinterpret_cast<PFN_cuGreenCtxStreamCreate_v12050>(load("cuGreenCtxStreamCreate", 12050));
    return a;
  }();
  return api;
}

// The driver cannot make the partition (no green contexts, a call failed).
Failure Fail(const std::string& what) {
  return Failure::Unavailable("SM partition: " + what, "comm_sms");
}
// The device has no partition of the requested size.
Failure NoFit(const std::string& what) {
  return Failure::Infeasible("SM partition: " + what, "comm_sms");
}

// The device's whole SM resource (its primary context initialised first, as the driver advises).
Result<std::pair<CUdevice, CUdevResource>> WholeDevice(int device) {
  const GreenApi& api = Api();
  if (!api.missing.empty()) {
    return Fail("the driver has no green contexts: entry point " + api.missing +
                " unavailable (needs a CUDA 12.5+ driver)");
  }
  {
    // Initialise the device's primary context; the caller's current device stays current.
    cuda::DeviceGuard guard(device, std::nothrow);
    int now = -1;
    cudaError_t e = cudaGetDevice(&now);
    if (e == cudaSuccess && now != device) e = cudaErrorInvalidDevice;
    if (e == cudaSuccess) e = cudaFree(nullptr);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      return Fail("device " + std::to_string(device) + ": " + CudaErrorText(e));
    }
  }
  CUdevice dev = 0;
  CUresult r = api.device_get(&dev, device);
  if (r != CUDA_SUCCESS)
    return Fail("cuDeviceGet(" + std::to_string(device) + "): " + CuErrorText(r));
  CUdevResource whole{};
  r = api.get_resource(dev, &whole, CU_DEV_RESOURCE_TYPE_SM);
  if (r != CUDA_SUCCESS) return Fail("cuDeviceGetDevResource: " + CuErrorText(r));
  return std::make_pair(dev, whole);
}

}  // namespace

Result<SmPartitionInfo> QuerySmPartitions(int device) {
  auto whole = WholeDevice(device);
  if (!whole.ok()) return whole.failure();
  const CUdevSmResource& sm = whole->second.sm;
  SmPartitionInfo info;
  info.device_sms = static_cast<int>(sm.smCount);
  info.min_sms = static_cast<int>(sm.minSmPartitionSize);
  info.step = static_cast<int>(sm.smCoscheduledAlignment);
  return info;
}

Result<int> ComputeSmsForDevice(int device, int comm_sms) {
  auto info = QuerySmPartitions(device);
  if (!info.ok()) return info.failure();
  const int sms = sp::PartitionSms(info->device_sms, info->step, comm_sms);
  if (sms == 0 || (comm_sms > 0 && sms < info->min_sms)) {
    return NoFit(std::to_string(comm_sms) + " SMs for communication leave no partition of the " +
                 std::to_string(info->device_sms) + " SMs of device " + std::to_string(device) +
                 " (partitions: multiples of " + std::to_string(info->step) + ", at least " +
                 std::to_string(info->min_sms) + ")");
  }
  return sms;
}

Result<void*> CreatePartitionStream(int device, int sms, int priority) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, CUgreenCtx> contexts;  // kept for the process
  auto whole = WholeDevice(device);
  if (!whole.ok()) return whole.failure();
  const GreenApi& api = Api();
  std::lock_guard<std::mutex> lock(mu);
  CUgreenCtx& ctx = contexts[{device, sms}];
  if (ctx == nullptr) {
    CUdevResource group{};
    unsigned int groups = 1;
    CUresult r = api.split(&group, &groups, &whole->second, nullptr, 0, sms);
    if (r != CUDA_SUCCESS || groups != 1 || static_cast<int>(group.sm.smCount) != sms) {
      contexts.erase({device, sms});
      return NoFit("cuDevSmResourceSplitByCount could not make one group of exactly " +
                   std::to_string(sms) + " SMs on device " + std::to_string(device) + " (" +
                   CuErrorText(r) + ", " + std::to_string(groups) + " group(s) of " +
                   std::to_string(group.sm.smCount) + ")");
    }
    CUdevResourceDesc desc = nullptr;
    r = api.generate_desc(&desc, &group, 1);
    if (r == CUDA_SUCCESS) r = api.create(&ctx, desc, whole->first, CU_GREEN_CTX_DEFAULT_STREAM);
    if (r != CUDA_SUCCESS) {
      contexts.erase({device, sms});
      return Fail("cuGreenCtxCreate (" + std::to_string(sms) + " SMs): " + CuErrorText(r));
    }
  }
  CUstream stream = nullptr;
  const CUresult r = api.stream_create(&stream, ctx, CU_STREAM_NON_BLOCKING, priority);
  if (r != CUDA_SUCCESS) return Fail("cuGreenCtxStreamCreate: " + CuErrorText(r));
  return static_cast<void*>(stream);
}

}  // namespace ditscale::runtime
