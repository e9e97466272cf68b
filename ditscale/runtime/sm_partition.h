// SM partitions for the GPU executor's compute stream (CUDA green contexts).
//
// cuDNN's Hopper attention holds every SM for a whole call, so a kernel issued after it on another
// stream (NCCL's send/recv, a pack, NVSHMEM's put) waits for its end. A stream of a green context
// runs its kernels on a subset of the SMs; kernels of the primary context still use any SM, so
// with the compute stream in a partition of N - k SMs the comm streams' kernels run beside the
// call on the k left over (lab/results/sp-smpart_h200_2026-12/: the Flux call on 128 of 132 SMs
// 1.01-1.03x the whole GPU's time; a pack and an NCCL send/recv issued after it ran beside it).
// The driver API comes through the runtime's driver entry points (no libcuda link).
#pragma once

#include "ditscale/core/result.h"

namespace ditscale::runtime {

struct SmPartitionInfo {
  int device_sms = 0;  // the device's SMs
  int min_sms = 0;     // the smallest partition the driver makes
  int step = 0;        // partitions are multiples of this (SMs co-scheduled together)
};
// Asks the driver (cuDeviceGetDevResource). Fails without green contexts (driver < 12.4).
Result<SmPartitionInfo> QuerySmPartitions(int device);

// The compute partition of `device` that leaves at least `comm_sms` SMs outside it
// (sp::PartitionSms with the driver's numbers); the device's SMs for comm_sms == 0; a failure
// naming "comm_sms" when none fits.
Result<int> ComputeSmsForDevice(int device, int comm_sms);

// A new non-blocking stream on `device` at `priority` whose kernels run on `sms` SMs (a multiple of
// the step, >= the minimum, < the device's SMs). The green context is made once per (device, sms)
// and kept for the process; the stream is the caller's to destroy (cudaStreamDestroy, or
// cuda::Stream::Adopt).
Result<void*> CreatePartitionStream(int device, int sms, int priority);

}  // namespace ditscale::runtime
