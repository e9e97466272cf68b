// The configuration argument of the GPU runtime's torch ops: a str -> str dict that
// ditscale.sp.config.op_fields() builds from a ditscale.sp.Config, parsed here once into the
// SpConfig of the schedule and the runtime's transport options.
//
// Keys, every one required, no others: strategy, transport, ulysses_degree, ring_degree,
// chunks, ulysses_chunks, comm_sms (sp_args.h: values and ranges; integers in decimal),
// engine ("auto", "copy-engine", "nvshmem": runtime::OneSidedEngine) and signal ("write",
// "copy": runtime::Transports::signal_by_copy).
#pragma once

#include <ATen/core/Dict.h>

#include <string>

#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::torch_ext {

using SpConfigDict = c10::Dict<std::string, std::string>;

struct SpRunArgs {
  sp::SpConfig config;
  runtime::OneSidedEngine engine = runtime::OneSidedEngine::kAuto;
  bool signal_by_copy = false;

  // What names a layer's schedule: strategy, degrees, token and head chunks, transport
  // (one_sided_inter only with one_sided), e.g. "torus u0 r0 c2 h1 nvshmem-intra". describe()
  // and timeline() select by it.
  std::string LayerKey() const;
  // LayerKey() plus comm_sms, engine and signal: one executor each.
  std::string Key() const;
};

// Fails (TORCH_CHECK) naming `who` and the key: a missing or unknown key, a value that is not an
// integer, out of its range or not one of its names.
SpRunArgs RunArgsOf(const SpConfigDict& fields, const char* who);

// Fails (TORCH_CHECK) with "<who>: <name>: <v> is out of range [lo, hi]" unless lo <= v <= hi.
void CheckIntArg(const char* who, const char* name, int64_t v, int64_t lo, int64_t hi);
// machines and gpus_per_machine in [1, 65536].
void CheckMesh(const char* who, int64_t machines, int64_t gpus_per_machine);

}  // namespace ditscale::torch_ext
