// Element types of the kernels module and exact host conversions for the 16-bit float formats.
//
// DType names the element type behind a `void*` in the kernel params structs. The conversions
// below are plain C++ (no CUDA headers) so that the CPU references, their tests and the torch
// layer's CPU path share one definition of rounding:
//   float -> bfloat16 / float16: round to nearest, ties to even; NaN stays NaN (quiet), values
//   past the largest finite number become +-inf; float16 subnormals are produced exactly.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace ditscale::kernels {

// Element type of a buffer. kFloat64 is accepted only by the CPU references (for
// torch.autograd.gradcheck); the CUDA launchers reject it.
enum class DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
};

// Bytes of one element of `dtype`.
constexpr std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

// "float32", "float16", "bfloat16", "float64" (or "invalid").
constexpr const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
  }
  return "invalid";
}

// bfloat16 bits -> float (exact).
inline float bf16_bits_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

// float -> bfloat16 bits, round to nearest even.
inline std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, force a quiet payload.
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

// float16 bits -> float (exact, including subnormals, inf and NaN).
inline float fp16_bits_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) {  // inf / NaN
    return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  }
  if (exponent == 0) {
    if (mantissa == 0) return std::bit_cast<float>(sign);
    // Subnormal: value = mantissa * 2^-24, exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float -> float16 bits, round to nearest even (overflow to inf, exact subnormals).
inline std::uint16_t float_to_fp16_bits(float value) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (abs < 0x38800000u) {  // below 2^-14: float16 subnormal (or zero)
    // value / 2^-24 rounded to nearest even integer; the shift keeps exact tie detection.
    const std::uint32_t exp = abs >> 23;
    if (exp < 102) return sign;  // < 2^-25: rounds to zero
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // 24 + 102 ... : bits to drop
    const std::uint32_t kept = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    const std::uint32_t rounded = kept + ((rem > half || (rem == half && (kept & 1u))) ? 1u : 0u);
    return static_cast<std::uint16_t>(sign | rounded);
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const std::uint32_t rebased = abs - (112u << 23);
  const std::uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (rounded >> 13));
}

// Reads element `index` of a buffer of `dtype` as double.
inline double load_as_double(const void* data, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[index];
    case DType::kFloat64:
      return static_cast<const double*>(data)[index];
    case DType::kFloat16:
      return fp16_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
    case DType::kBFloat16:
      return bf16_bits_to_float(static_cast<const std::uint16_t*>(data)[index]);
  }
  return 0.0;
}

// Writes `value` into element `index` of a buffer of `dtype`, rounding once to that type
// (float16/bfloat16 go through float: double -> float -> half may double-round in the last bit
// of rare ties; the references accept that, their tolerances are far above it).
inline void store_from_double(void* data, DType dtype, std::int64_t index, double value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(data)[index] = static_cast<float>(value);
      return;
    case DType::kFloat64:
      static_cast<double*>(data)[index] = value;
      return;
    case DType::kFloat16:
      static_cast<std::uint16_t*>(data)[index] = float_to_fp16_bits(static_cast<float>(value));
      return;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(data)[index] = float_to_bf16_bits(static_cast<float>(value));
      return;
  }
}

}  // namespace ditscale::kernels
