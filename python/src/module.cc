// ditscale._core: Python bindings of the CPU core. Each module adds its bindings in its own
// file through a Bind* function declared in bindings.h.
#include <pybind11/pybind11.h>

#include "ditscale/core/error.h"
#include "python/src/bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "ditscale CPU core";
  pybind11::register_exception<ditscale::Error>(m, "Error", PyExc_RuntimeError);
  ditscale::python::BindBalance(m);
  ditscale::python::BindSpSimulator(m);
  ditscale::python::BindSp(m);
  ditscale::python::BindSpSchedule(m);
}
