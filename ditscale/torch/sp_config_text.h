// The configuration argument of the GPU runtime's torch ops: the text encoding of a
// ditscale.sp.Config (sp_args.h: ditscale.sp.config.config_text writes it) plus the experiment
// variant's entries "engine=<auto|copy-engine|nvshmem>" (runtime::OneSidedEngine) and
// "signal=<write|copy>" (runtime::Transports::signal_by_copy), both required
// (ditscale._experimental.sp_variants). Parsed here once into the SpConfig of the schedule and the
// runtime's transport options.
#pragma once

#include <string>

#include "ditscale/runtime/gpu_executor.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::torch_ext {

using SpConfigText = std::string;

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

// Fails (TORCH_CHECK) naming `who` and the entry or key: a missing or unknown key, a value that is
// not an integer, out of its range or not one of its names.
SpRunArgs RunArgsOf(const SpConfigText& text, const char* who);

// Fails (TORCH_CHECK) with "<who>: <name>: <v> is out of range [lo, hi]" unless lo <= v <= hi.
void CheckIntArg(const char* who, const char* name, int64_t v, int64_t lo, int64_t hi);
// machines and gpus_per_machine in [1, 65536].
void CheckMesh(const char* who, int64_t machines, int64_t gpus_per_machine);

}  // namespace ditscale::torch_ext
