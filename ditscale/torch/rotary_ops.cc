// Schema of the torch op ditscale::rotary (rotary embedding of interleaved pairs, see
// ditscale/kernels/rotary.h and rotary_impl.h) and its CPU backend. Its autograd is in
// rotary_autograd.cc, its fake kernel in python/ditscale/_fake_kernels.py.
//
// rotary(x, cos, sin, inverse=False) -> y: functional (y is new; nothing aliased or mutated).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ditscale/kernels/rotary.h"
#include "ditscale/torch/rotary_impl.h"

namespace ditscale::torch_ext {
namespace {

struct CpuRotary {
  static void run(const kernels::RotaryParams& p, const at::Tensor&) { kernels::rotary_ref(p); }
};

}  // namespace
}  // namespace ditscale::torch_ext

TORCH_LIBRARY_FRAGMENT(ditscale, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, bool inverse=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(ditscale, CPU, m) {
  m.impl("rotary", TORCH_FN(ditscale::torch_ext::rotary_op<ditscale::torch_ext::CpuRotary>));
}
