// The dotprod (sdot) inner products, shared by neon_dotprod and neon_i8mm (which keeps sdot for the
// GEMV and the odd rows and columns of its tiles).
#pragma once

#include <arm_neon.h>

#include <cstdint>

namespace cpk {

#define CPK_DOTPROD_TARGET "arch=armv8.2-a+dotprod"
#define CPK_I8MM_TARGET "arch=armv8.2-a+dotprod+i8mm"
__attribute__((target(CPK_DOTPROD_TARGET))) inline int32_t dot_i8_dotprod(const int8_t* a, const int8_t* w,
                                                                          int64_t k) {
  int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    acc0 = vdotq_s32(acc0, vld1q_s8(a + i), vld1q_s8(w + i));
    acc1 = vdotq_s32(acc1, vld1q_s8(a + i + 16), vld1q_s8(w + i + 16));
  }
  for (; i + 16 <= k; i += 16) acc0 = vdotq_s32(acc0, vld1q_s8(a + i), vld1q_s8(w + i));
  int32_t total = vaddvq_s32(vaddq_s32(acc0, acc1));
  for (; i < k; ++i) total += int32_t(a[i]) * int32_t(w[i]);
  return total;
}

__attribute__((target(CPK_DOTPROD_TARGET))) inline int32_t group_s4_dotprod(const int8_t* a, const uint8_t* w,
                                                                            int64_t len) {
  const int8x16_t high = vdupq_n_s8(int8_t(0xF0));
  int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
  for (int64_t b = 0; b < len / 32; ++b) {
    int8x16_t packed = vld1q_s8(reinterpret_cast<const int8_t*>(w + b * 16));
    acc0 = vdotq_s32(acc0, vshlq_n_s8(packed, 4), vld1q_s8(a + b * 32));
    acc1 = vdotq_s32(acc1, vandq_s8(packed, high), vld1q_s8(a + b * 32 + 16));
  }
  return vaddvq_s32(vaddq_s32(acc0, acc1)) >> 4;
}

__attribute__((target(CPK_DOTPROD_TARGET))) inline float row_s4_dotprod(const int8_t* a, const uint8_t* w,
                                                                        const float* s, int64_t groups,
                                                                        int64_t group) {
  float y = 0.f;
  for (int64_t g = 0; g < groups; ++g) y += float(group_s4_dotprod(a + g * group, w + g * group / 2, group)) * s[g];
  return y;
}

}  // namespace cpk
