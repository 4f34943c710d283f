// neon (Armv8.0): s8 x s8 products widened to s16 in pairs, pairwise-accumulated into s32 lanes.
// Each group is reduced to one int32 before the twin's scalar float update: bit-identical to the
// two's-complement twin.
#if defined(__aarch64__)
#include <arm_neon.h>

#include "../../linear_rows.h"
#include "kernels.h"

namespace cpk {
namespace {

// s8 x s8 products widened to s16 in pairs (|a| <= 127, |w| <= 128: a pair sums to at most 32512,
// nibble pairs to 3810), then pairwise-accumulated into s32 lanes.
inline int32_t dot_i8_neon(const int8_t* a, const int8_t* w, int64_t k) {
  int32x4_t acc = vdupq_n_s32(0);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    int8x16_t va = vld1q_s8(a + i), vw = vld1q_s8(w + i);
    int16x8_t p = vmull_s8(vget_low_s8(va), vget_low_s8(vw));
    p = vmlal_s8(p, vget_high_s8(va), vget_high_s8(vw));
    acc = vpadalq_s16(acc, p);
  }
  int32_t total = vaddvq_s32(acc);
  for (; i < k; ++i) total += int32_t(a[i]) * int32_t(w[i]);
  return total;
}

// Two's-complement nibbles: shl #4 gives 16 * low value, and #0xF0 gives 16 * high value, both as
// int8; |16 w * a| <= 128 * 127, so a pair still fits int16. The group's sum is 16x, divided exactly.
inline int32_t group_s4_neon(const int8_t* a, const uint8_t* w, int64_t len) {
  const int8x16_t high = vdupq_n_s8(int8_t(0xF0));
  int32x4_t acc = vdupq_n_s32(0);
  for (int64_t b = 0; b < len / 32; ++b) {
    int8x16_t packed = vld1q_s8(reinterpret_cast<const int8_t*>(w + b * 16));
    int8x16_t lo = vshlq_n_s8(packed, 4), hi = vandq_s8(packed, high);
    int8x16_t a_lo = vld1q_s8(a + b * 32), a_hi = vld1q_s8(a + b * 32 + 16);
    int16x8_t p = vmull_s8(vget_low_s8(lo), vget_low_s8(a_lo));
    p = vmlal_s8(p, vget_high_s8(lo), vget_high_s8(a_lo));
    acc = vpadalq_s16(acc, p);
    p = vmull_s8(vget_low_s8(hi), vget_low_s8(a_hi));
    p = vmlal_s8(p, vget_high_s8(hi), vget_high_s8(a_hi));
    acc = vpadalq_s16(acc, p);
  }
  return vaddvq_s32(acc) >> 4;
}

inline float row_s4_neon(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  return row_generic<group_s4_neon>(a, w, s, groups, group);  // the twin's float update, same order
}

}  // namespace

void w8a8_neon(const LinearArgs& a, int64_t c0, int64_t c1) { w8a8_rows<dot_i8_neon>(a, c0, c1); }
void w4a8_neon(const LinearArgs& a, int64_t c0, int64_t c1) { w4a8_rows<row_s4_neon, nullptr, false>(a, c0, c1); }

}  // namespace cpk
#endif  // __aarch64__
