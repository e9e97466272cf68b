#include "python/src/bindings.h"

namespace ditscale::python {
void BindBalance(pybind11::module_& m) {}
}  // namespace ditscale::python
