// What the sequence-parallel ops (sp_ops.cc on the CPU, sp_cuda.cc on the GPU) share: the
// SpConfig their (strategy, U, R, chunks, transport, comm_sms) arguments name.
#pragma once

#include <cstdint>
#include <string>

#include "ditscale/sp/schedule.h"

namespace ditscale::torch_ext {

inline sp::SpConfig SpConfigOf(const std::string& strategy, int64_t ulysses, int64_t ring,
                               int64_t chunks, bool one_sided, bool one_sided_inter,
                               int64_t comm_sms = 0) {
  sp::SpConfig cfg;
  cfg.strategy = strategy;
  cfg.ulysses_degree = static_cast<int>(ulysses);
  cfg.ring_degree = static_cast<int>(ring);
  cfg.torus_chunks = static_cast<int>(chunks);
  cfg.one_sided = one_sided;
  cfg.one_sided_inter = one_sided_inter;
  cfg.comm_sms = static_cast<int>(comm_sms);
  return cfg;
}

}  // namespace ditscale::torch_ext
