// Pieces shared by the C++ autograd kernels of the ditscale ops (adaln_autograd.cc,
// rotary_autograd.cc): the typed handle of an op looked up once, and a Node allocated the way
// PyTorch's generated code allocates its nodes (deleteNode releases long backward chains without
// deep recursion).
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>

#include <memory>

namespace ditscale::torch_ext {

// The op's typed handle (`name` like "ditscale::adaln_fwd"; the schema must be defined).
template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

template <typename T>
std::shared_ptr<T> new_node() {
  return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
}

}  // namespace ditscale::torch_ext
