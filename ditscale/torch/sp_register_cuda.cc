// Registration of the sequence-parallel GPU runtime's torch ops and class (ditscale._C, CUDA
// builds): only registration; the ops live in sp_ids, sp_diagnostics and sp_runtime.
#include <torch/custom_class.h>
#include <torch/library.h>

#include "ditscale/torch/sp_diagnostics.h"
#include "ditscale/torch/sp_ids.h"
#include "ditscale/torch/sp_runtime.h"

namespace ditscale::torch_ext {

TORCH_LIBRARY_FRAGMENT(ditscale, m) {
  m.def("sp_replay_compute", &sp_replay_compute);
  m.def("sp_run_local", &sp_run_local);
  m.def("sp_nccl_id", &sp_nccl_id);
  m.def("sp_nvshmem_id", &sp_nvshmem_id);
  m.def("sp_nvshmem_unavailable", &sp_nvshmem_unavailable);
  m.class_<SpRuntime>("SpRuntime")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, at::Tensor, at::Tensor, double,
                       int64_t>())
      .def("init_nvshmem", &SpRuntime::init_nvshmem)
      .def("has_nvshmem", &SpRuntime::has_nvshmem)
      .def("attention", &SpRuntime::attention)
      .def("synchronize", &SpRuntime::synchronize)
      .def("describe", &SpRuntime::describe)
      .def("set_trace", &SpRuntime::set_trace)
      .def("timeline", &SpRuntime::timeline)
      .def("executors", &SpRuntime::executors)
      .def("clear", &SpRuntime::clear);
}

}  // namespace ditscale::torch_ext
