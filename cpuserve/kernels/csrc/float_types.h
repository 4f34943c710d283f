// The 16-bit float formats the kernels read, without torch: the same bits as c10::BFloat16 and
// c10::Half, widened exactly to fp32 (so any correct widening gives the same floats).
#pragma once

#include <cstdint>
#include <cstring>

namespace cpk {

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2 && sizeof(F16) == 2, "16-bit floats are their bits");

enum class DType { F32, Bf16, F16 };

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// bf16 is the top half of an fp32: a shift the compiler vectorizes.
inline float to_float(Bf16 x) { return bits_to_float(uint32_t(x.bits) << 16); }

// IEEE half -> single: rebias the exponent; subnormal halves are normalized, inf / NaN kept.
inline float to_float(F16 x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000) << 16, exponent = (x.bits >> 10) & 0x1F;
  uint32_t mantissa = x.bits & 0x3FF;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  uint32_t e = 113;  // 2^-14 as a single-precision exponent, moved down while normalizing
  while ((mantissa & 0x400) == 0) {
    mantissa <<= 1;
    --e;
  }
  return bits_to_float(sign | (e << 23) | ((mantissa & 0x3FF) << 13));
}

inline float to_float(float x) { return x; }

// An int8 KV cache's value before its row's scale (attention.h).
inline float to_float(int8_t x) { return float(x); }

}  // namespace cpk
