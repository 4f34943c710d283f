// neon_i8mm: sdot for the GEMV (dotprod.h), smmla 2x2 tiles (two tokens x two output channels) for
// the GEMM. The tiles reduce each group to int32 before the twin's float update, per output, in the
// same order: bit-identical to the two's-complement twin.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <cstring>

#include "../../linear_rows.h"
#include "dotprod.h"
#include "kernels.h"

namespace cpk {
namespace {

// smmla multiplies a 2x8 int8 block (two activation rows) by the transpose of another 2x8 block (two
// weight rows) into a 2x2 int32 tile: 32 multiply-adds per instruction, twice sdot's.
__attribute__((target(CPK_I8MM_TARGET))) inline int8x16_t rows8(const int8_t* r0, const int8_t* r1) {
  return vcombine_s8(vld1_s8(r0), vld1_s8(r1));
}

__attribute__((target(CPK_I8MM_TARGET))) inline void tile_i8_i8mm(const int8_t* a0, const int8_t* a1,
                                                                  const int8_t* w0, const int8_t* w1, int64_t k,
                                                                  int32_t* out) {
  int32x4_t acc0 = vdupq_n_s32(0), acc1 = vdupq_n_s32(0);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    acc0 = vmmlaq_s32(acc0, rows8(a0 + i, a1 + i), rows8(w0 + i, w1 + i));
    acc1 = vmmlaq_s32(acc1, rows8(a0 + i + 8, a1 + i + 8), rows8(w0 + i + 8, w1 + i + 8));
  }
  for (; i + 8 <= k; i += 8) acc0 = vmmlaq_s32(acc0, rows8(a0 + i, a1 + i), rows8(w0 + i, w1 + i));
  vst1q_s32(out, vaddq_s32(acc0, acc1));
  for (; i < k; ++i) {
    out[0] += int32_t(a0[i]) * w0[i];
    out[1] += int32_t(a0[i]) * w1[i];
    out[2] += int32_t(a1[i]) * w0[i];
    out[3] += int32_t(a1[i]) * w1[i];
  }
}

// Two 16-byte vectors of 8-element chunks (x = [x0 x1], y = [y0 y1]) -> [x0 y0] and [x1 y1].
__attribute__((target(CPK_I8MM_TARGET))) inline void zip64(int8x16_t x, int8x16_t y, int8x16_t* first,
                                                           int8x16_t* second) {
  int64x2_t x64 = vreinterpretq_s64_s8(x), y64 = vreinterpretq_s64_s8(y);
  *first = vreinterpretq_s8_s64(vzip1q_s64(x64, y64));
  *second = vreinterpretq_s8_s64(vzip2q_s64(x64, y64));
}

__attribute__((target(CPK_I8MM_TARGET))) inline void tile_s4_i8mm(const int8_t* a0, const int8_t* a1,
                                                                  const uint8_t* w0, const uint8_t* w1,
                                                                  const float* s0, const float* s1,
                                                                  int64_t groups, int64_t group, float* out) {
  const int8x16_t high = vdupq_n_s8(int8_t(0xF0));
  float y[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t g = 0; g < groups; ++g) {
    int32x4_t acc = vdupq_n_s32(0);
    for (int64_t b = 0; b < group / 32; ++b) {
      const int64_t wo = (g * group + b * 32) / 2, ao = g * group + b * 32;
      int8x16_t p0 = vld1q_s8(reinterpret_cast<const int8_t*>(w0 + wo));
      int8x16_t p1 = vld1q_s8(reinterpret_cast<const int8_t*>(w1 + wo));
      // 16 x the weights k0..k0+15 (low nibbles) and k0+16..k0+31 (high nibbles) of both rows.
      int8x16_t lo0 = vshlq_n_s8(p0, 4), lo1 = vshlq_n_s8(p1, 4);
      int8x16_t hi0 = vandq_s8(p0, high), hi1 = vandq_s8(p1, high);
      int8x16_t wa, wb, wc, wd, xa, xb, xc, xd;
      zip64(lo0, lo1, &wa, &wb);
      zip64(hi0, hi1, &wc, &wd);
      zip64(vld1q_s8(a0 + ao), vld1q_s8(a1 + ao), &xa, &xb);
      zip64(vld1q_s8(a0 + ao + 16), vld1q_s8(a1 + ao + 16), &xc, &xd);
      acc = vmmlaq_s32(acc, xa, wa);
      acc = vmmlaq_s32(acc, xb, wb);
      acc = vmmlaq_s32(acc, xc, wc);
      acc = vmmlaq_s32(acc, xd, wd);
    }
    acc = vshrq_n_s32(acc, 4);  // 16 x the exact sums: exact division
    // The twin's float update, per output, in the same order: bit-identical results.
    y[0] += float(vgetq_lane_s32(acc, 0)) * s0[g];
    y[1] += float(vgetq_lane_s32(acc, 1)) * s1[g];
    y[2] += float(vgetq_lane_s32(acc, 2)) * s0[g];
    y[3] += float(vgetq_lane_s32(acc, 3)) * s1[g];
  }
  std::memcpy(out, y, sizeof(y));
}
}  // namespace

void w8a8_neon_i8mm(const LinearArgs& a, int64_t c0, int64_t c1) {
  w8a8_rows<dot_i8_dotprod, tile_i8_i8mm>(a, c0, c1);
}
void w4a8_neon_i8mm(const LinearArgs& a, int64_t c0, int64_t c1) {
  w4a8_rows<row_s4_dotprod, tile_s4_i8mm, false>(a, c0, c1);
}

}  // namespace cpk
#endif  // __aarch64__
