// Compile-time dispatch helpers in the style of flash-attention's static_switch.h, written as
// function templates taking a generic lambda (no macro, no reliance on the caller's local names):
//
//   dispatch_dtype(p.dtype, [&](auto tag) { using T = typename decltype(tag)::type; ... });
//   dispatch_bool(gated, [&](auto kGated) { if constexpr (kGated) ...; });
//   dispatch_int<1, 2, 4>(k, [&](auto kVecs) { kernel<T, kVecs><<<...>>>(...); });
//
// CUDA only (names the CUDA 16-bit float types); include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include "ditscale/core/error.h"
#include "ditscale/kernels/dtype.h"

namespace ditscale::kernels::internal {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<E>{}) with E = float, __half or __nv_bfloat16 for `dtype`; throws otherwise.
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return std::forward<F>(f)(TypeTag<float>{});
    case DType::kFloat16:
      return std::forward<F>(f)(TypeTag<__half>{});
    case DType::kBFloat16:
      return std::forward<F>(f)(TypeTag<__nv_bfloat16>{});
    case DType::kFloat64:
      break;
  }
  DS_FAIL("dtype ", dtype_name(dtype), " is not supported by the CUDA kernels");
}

// Calls f(std::true_type{}) or f(std::false_type{}).
template <typename F>
decltype(auto) dispatch_bool(bool value, F&& f) {
  if (value) return std::forward<F>(f)(std::true_type{});
  return std::forward<F>(f)(std::false_type{});
}

// Calls f(std::integral_constant<int, K>{}) for the K in Ks equal to `value`; throws when none is.
template <int... Ks, typename F>
void dispatch_int(int value, F&& f) {
  const bool found = ((value == Ks ? (f(std::integral_constant<int, Ks>{}), true) : false) || ...);
  DS_CHECK(found, "dispatch_int: no instantiation for value ", value);
}

}  // namespace ditscale::kernels::internal
