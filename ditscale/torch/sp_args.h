// One sequence-parallel configuration as the Python API (ditscale.sp.Config) hands it to C++:
// the named fields of SpFields, turned into an sp::SpConfig (the strategy name parsed into an
// sp::Strategy here: this is an edge, strategy.h). Shared by the planning
// bindings of ditscale._core (python/src/sp_bindings.cc, no torch) and the torch ops of the GPU
// runtime (sp_config_dict.h). Header-only so that _core needs no torch sources.
//
// Fields and ranges (the same as ditscale.sp.Config's; out of range -> ditscale::Error
// "<field>: <value> is out of range [lo, hi]"):
//   strategy        one of sp::StrategyNames() ("auto" is resolved in Python, by the planner);
//                   else "strategy: 'x' is not one of ulysses, ulysses-overlap, ..."
//   transport       "nccl", "nvshmem" or "nvshmem-intra" (sp::SetTransport)
//   ulysses_degree  [0, kMaxDegree], 0 = the strategy's default
//   ring_degree     [0, kMaxDegree], 0 = the strategy's default
//   chunks          [1, kMaxChunks]: torus token chunks (SpConfig::torus_chunks); 1 for ulysses
//   ulysses_chunks  [1, kMaxChunks]: ulysses head chunks (SpConfig::ulysses_chunks); 1 unless
//                   strategy is ulysses
//   comm_sms        [0, kMaxCommSms]: SMs kept for communication (SpConfig::comm_sms)
#pragma once

#include <cstdint>
#include <string>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"
#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"
#include "ditscale/sp/strategies.h"

namespace ditscale::torch_ext {

inline constexpr long long kMaxDegree = 65536;
inline constexpr long long kMaxChunks = 4096;
inline constexpr long long kMaxCommSms = 4096;

struct SpFields {
  std::string strategy = "ulysses";
  std::string transport = "nccl";
  int64_t ulysses_degree = 0;
  int64_t ring_degree = 0;
  int64_t chunks = 1;
  int64_t ulysses_chunks = 1;
  int64_t comm_sms = 0;
};

// The strategy of a name; throws ditscale::Error "strategy: 'x' is not one of ...".
inline sp::Strategy StrategyOf(const std::string& name) {
  Result<sp::Strategy> s = sp::ParseStrategy(name);
  if (!s.ok()) throw Error("strategy: " + s.failure().message);
  return s.value();
}

// The SpConfig the fields name; throws ditscale::Error naming the field.
inline sp::SpConfig SpConfigOf(const SpFields& f) {
  const sp::Strategy strategy = StrategyOf(f.strategy);
  CheckRange("ulysses_degree", static_cast<long long>(f.ulysses_degree), 0, kMaxDegree);
  CheckRange("ring_degree", static_cast<long long>(f.ring_degree), 0, kMaxDegree);
  CheckRange("chunks", static_cast<long long>(f.chunks), 1, kMaxChunks);
  CheckRange("ulysses_chunks", static_cast<long long>(f.ulysses_chunks), 1, kMaxChunks);
  CheckRange("comm_sms", static_cast<long long>(f.comm_sms), 0, kMaxCommSms);
  sp::SpConfig cfg;
  if (!sp::SetTransport(f.transport, &cfg)) {
    throw Error("transport: '" + f.transport + "' is not one of nccl, nvshmem, nvshmem-intra");
  }
  cfg.strategy = strategy;
  cfg.ulysses_degree = static_cast<int>(f.ulysses_degree);
  cfg.ring_degree = static_cast<int>(f.ring_degree);
  cfg.torus_chunks = static_cast<int>(f.chunks);
  cfg.ulysses_chunks = static_cast<int>(f.ulysses_chunks);
  if (f.ulysses_chunks > 1 && strategy != sp::Strategy::kUlysses) {
    throw Error("ulysses_chunks: " + std::to_string(f.ulysses_chunks) +
                " head chunks need strategy ulysses, not " + f.strategy);
  }
  if (f.chunks > 1 && strategy == sp::Strategy::kUlysses) {
    throw Error("chunks: ulysses cuts its head group, not tokens: ulysses_chunks, not chunks " +
                std::to_string(f.chunks));
  }
  cfg.comm_sms = static_cast<int>(f.comm_sms);
  return cfg;
}

}  // namespace ditscale::torch_ext
