#pragma once

#include <pybind11/pybind11.h>

namespace ditscale::python {
// Sampler, manifest and planner bindings (python/src/balance_bindings.cc).
void BindBalance(pybind11::module_& m);
// The simulator's attention model for bench/sp/calibrate.py (python/src/sp_sim_bindings.cc).
void BindSpSimulator(pybind11::module_& m);
// Sequence-parallel planner and simulator bindings (python/src/sp_bindings.cc).
void BindSp(pybind11::module_& m);
// One rank's program of an sp schedule, for the CPU executor (python/src/sp_schedule_bindings.cc).
void BindSpSchedule(pybind11::module_& m);
}  // namespace ditscale::python
