// The W8A8 / W4A8 kernel core: per-token int8 activations times int8 or int4 weights, on raw
// pointers, no torch and no threads. qlinear.cpp binds it to torch (at::parallel_for over output
// columns); kernel_check.cpp runs it alone, natively or cross-compiled for aarch64 under qemu.
//
// Every variant has the scalar "generic" twin. SIMD variants are compiled with function-level
// target attributes and chosen at run time by name (best_variant() reads the CPU's features):
//   x86-64:  avx2, avx512_vnni, both in the panel layout of qlinear_panels.h (not the rows below)
//   aarch64: neon (Armv8.0), neon_dotprod (sdot), neon_i8mm (sdot for GEMV, smmla 2x2 tiles for GEMM)
// Integer accumulation is exact everywhere. W8A8's float epilogue is shared, so every variant is
// bit-identical to the twin. For W4A8 the Arm variants reduce each group to one int32 before the same
// scalar float update as the twin (bit-identical); the x86 variants keep per-group products in
// vector lanes (equal within float rounding).
//
// Row layouts (repacked at load, chosen by the variant; W8A8 rows are the int8 weights as they are).
// Int4: per row, per 32-element block, 16 bytes;
// byte j holds w[k0 + j] in its low nibble and w[k0 + 16 + j] in its high nibble, as
//   Offset (x86, generic): w + 8, unsigned 0..15. Dot products use the unsigned nibble (the u8 operand
//     of maddubs / dpbusd) and subtract 8 * sum(activations of the group), which the activation
//     quantizer computes once per token and group.
//   TwosComplement (aarch64 NEON): w & 0xF. `shl #4` of the byte and `and #0xF0` give 16 * w as int8
//     with no correction; the group's int32 sum is divided by 16 (exact) before the float update.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "qlinear_panels.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#include <sys/auxv.h>
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif
#endif

namespace cpk {

// Inner products. dot_i8: sum a*w over k. row_u4: sum_g s_g * sum_{group g} nibble * a (before the
// -8 correction and the activation scale). tile_*: the same for 2 activation rows x 2 weight rows at
// once (out = [r0c0, r0c1, r1c0, r1c1]); null where the variant has no tile kernel.
using DotI8 = int32_t (*)(const int8_t*, const int8_t*, int64_t);
using RowU4 = float (*)(const int8_t*, const uint8_t*, const float*, int64_t, int64_t);
using TileI8 = void (*)(const int8_t*, const int8_t*, const int8_t*, const int8_t*, int64_t, int32_t*);
using TileU4 = void (*)(const int8_t*, const int8_t*, const uint8_t*, const uint8_t*, const float*, const float*,
                        int64_t, int64_t, float*);

enum class Int4Layout { Offset, TwosComplement };
// Which panel kernels (qlinear_panels.h) a variant runs, if any: AVX2 (signed int8 panels) or AVX-512
// VNNI (offset int8 panels); both read the same int4 panels.
enum PanelKind { kNoPanels = 0, kAvx2Panels, kVnniPanels };

struct Variant {
  const char* name;
  DotI8 dot_i8;
  RowU4 row_u4;
  TileI8 tile_i8;
  TileU4 tile_u4;
  bool w4_exact;  // W4A8 bit-identical to the generic twin of its layout
  Int4Layout layout;
  PanelKind panels = kNoPanels;  // weights in the panel layout and kernels of qlinear_panels.h instead
};

// ---------------------------------------------------------------- generic (scalar) twins
inline int32_t dot_i8_generic(const int8_t* a, const int8_t* w, int64_t k) {
  int32_t acc = 0;
  for (int64_t i = 0; i < k; ++i) acc += int32_t(a[i]) * int32_t(w[i]);
  return acc;
}

// One group of len values (a multiple of 32): sum of value(nibble) * a over the layout above, where
// `value` reads a 4-bit nibble as the layout stores it.
template <typename Value>
inline int32_t dot_nibbles_generic(const int8_t* a, const uint8_t* w, int64_t len, Value value) {
  int32_t acc = 0;
  for (int64_t b = 0; b < len / 32; ++b) {
    const uint8_t* wb = w + b * 16;
    const int8_t* ab = a + b * 32;
    for (int j = 0; j < 16; ++j) {
      acc += value(wb[j] & 0x0F) * int32_t(ab[j]);
      acc += value(wb[j] >> 4) * int32_t(ab[16 + j]);
    }
  }
  return acc;
}

// Offset nibbles as stored (0..15; the caller subtracts 8 * sum(a)) and two's-complement nibbles
// as their signed value (the Arm layout).
inline int32_t dot_u4_generic(const int8_t* a, const uint8_t* w, int64_t len) {
  return dot_nibbles_generic(a, w, len, [](int n) { return int32_t(n); });
}
inline int32_t dot_s4_generic(const int8_t* a, const uint8_t* w, int64_t len) {
  return dot_nibbles_generic(a, w, len, [](int n) { return int32_t(n >= 8 ? n - 16 : n); });
}

template <int32_t (*Dot)(const int8_t*, const uint8_t*, int64_t)>
inline float row_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  float y = 0.f;
  for (int64_t g = 0; g < groups; ++g) y += float(Dot(a + g * group, w + g * group / 2, group)) * s[g];
  return y;
}
inline float row_u4_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  return row_generic<dot_u4_generic>(a, w, s, groups, group);
}
inline float row_s4_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  return row_generic<dot_s4_generic>(a, w, s, groups, group);
}

#if defined(__aarch64__)
// ---------------------------------------------------------------- aarch64: NEON (Armv8.0)
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

// ---------------------------------------------------------------- aarch64: dotprod (sdot)
#define CPK_DOTPROD_TARGET "arch=armv8.2-a+dotprod"
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

// ---------------------------------------------------------------- aarch64: I8MM (smmla)
// smmla multiplies a 2x8 int8 block (two activation rows) by the transpose of another 2x8 block (two
// weight rows) into a 2x2 int32 tile: 32 multiply-adds per instruction, twice sdot's.
#define CPK_I8MM_TARGET "arch=armv8.2-a+dotprod+i8mm"
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
#endif  // __aarch64__

// ---------------------------------------------------------------- variants
inline std::vector<Variant> compiled_variants() {
  using L = Int4Layout;
  std::vector<Variant> v{{"generic", dot_i8_generic, row_u4_generic, nullptr, nullptr, true, L::Offset}};
#if defined(__x86_64__)
  // x86 runs only the panel layout (qlinear_panels.h): no row kernels.
  v.push_back({"avx2", nullptr, nullptr, nullptr, nullptr, false, L::Offset, kAvx2Panels});
  v.push_back({"avx512_vnni", nullptr, nullptr, nullptr, nullptr, false, L::Offset, kVnniPanels});
#endif
#if defined(__aarch64__)
  v.push_back({"neon", dot_i8_neon, row_s4_neon, nullptr, nullptr, true, L::TwosComplement});
  v.push_back({"neon_dotprod", dot_i8_dotprod, row_s4_dotprod, nullptr, nullptr, true, L::TwosComplement});
  v.push_back({"neon_i8mm", dot_i8_dotprod, row_s4_dotprod, tile_i8_i8mm, tile_s4_i8mm, true, L::TwosComplement});
#endif
  return v;
}

// The scalar twin for a layout: what every variant of that layout is checked against.
inline const Variant& twin_for(Int4Layout layout) {
  static const Variant offset{"generic", dot_i8_generic, row_u4_generic, nullptr, nullptr, true, Int4Layout::Offset};
  static const Variant twos{"generic", dot_i8_generic, row_s4_generic, nullptr, nullptr, true,
                            Int4Layout::TwosComplement};
  return layout == Int4Layout::Offset ? offset : twos;
}

inline const Variant* variant_by_name(const std::string& name) {
  static const std::vector<Variant> all = compiled_variants();
  for (const Variant& v : all)
    if (name == v.name) return &v;
  return nullptr;
}

// The best variant this CPU runs, from the kernel's own view of the CPU (the platform layer makes
// the same choice from /proc/cpuinfo; a test checks that they agree).
inline std::string best_variant() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vnni"))
    return "avx512_vnni";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
#elif defined(__aarch64__)
  const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
  if ((hw & HWCAP_ASIMDDP) && (hw2 & HWCAP2_I8MM)) return "neon_i8mm";
  if (hw & HWCAP_ASIMDDP) return "neon_dotprod";
  return "neon";  // Advanced SIMD is mandatory in Armv8-A
#endif
  return "generic";
}

// ---------------------------------------------------------------- activation quantization
// One token: s = max(amax, 1e-8) / 127, q = round-half-even(x / s) in [-127, 127] (NaN -> -127);
// per-group sums (group 0: none). The scalar twin; quantize_row picks a SIMD copy that gives the
// same bytes (IEEE division and round-to-nearest-even are exact operations; max ignores NaN the way
// fmax does), checked against this one by kernel_check. Without it the twin's nearbyint (a libm call
// at the baseline ISA) cost ~4 ns per value: ~20% of a 2B prefill.
inline void group_sums(const int8_t* q, int64_t k, int64_t group, int32_t* sums) {
  if (group <= 0) return;
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t total = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) total += q[i];
    sums[g] = total;
  }
}

inline void quantize_row_generic(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  for (int64_t i = 0; i < k; ++i) {
    float v = std::nearbyint(x[i] / s);
    q[i] = int8_t(std::fmin(127.f, std::fmax(-127.f, v)));
  }
  group_sums(q, k, group, sums);
}

#if defined(__x86_64__)
// max_ps(a, b) returns b when a is NaN: with the running maximum (or the clamp bound) second, NaN
// inputs are skipped (amax) or become -127 (clamp), as in the twin.
__attribute__((target("avx512f,avx512bw"))) inline void quantize_row_avx512(const float* x, int64_t k, int64_t group,
                                                                           int8_t* q, float* scale, int32_t* sums) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
  float amax = _mm512_reduce_max_ps(vmax);
  for (; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  for (; i < k; ++i) q[i] = int8_t(std::fmin(127.f, std::fmax(-127.f, std::nearbyint(x[i] / s))));
  group_sums(q, k, group, sums);
}

__attribute__((target("avx2,fma"))) inline void quantize_row_avx2(const float* x, int64_t k, int64_t group, int8_t* q,
                                                                  float* scale, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), vmax);
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (float e : lanes) amax = std::fmax(amax, e);
  for (; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (i = 0; i + 8 <= k; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i n = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
  }
  for (; i < k; ++i) q[i] = int8_t(std::fmin(127.f, std::fmax(-127.f, std::nearbyint(x[i] / s))));
  group_sums(q, k, group, sums);
}
#endif

inline void quantize_row(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums) {
#if defined(__x86_64__)
  static const int level = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
  }();
  if (level == 2) return quantize_row_avx512(x, k, group, q, scale, sums);
  if (level == 1) return quantize_row_avx2(x, k, group, q, scale, sums);
#endif
  quantize_row_generic(x, k, group, q, scale, sums);
}

// ---------------------------------------------------------------- one thread's share of a linear
// Output columns [c0, c1) of out [M, N] (row-major, fp32) from quantized activations qa [M, K] with
// per-row scales sa, and int8 weights qw [N, K] with per-column scales sw.
inline void w8a8_columns(const Variant& v, const int8_t* qa, const float* sa, int64_t m, int64_t k,
                         const int8_t* qw, const float* sw, int64_t n, int64_t c0, int64_t c1, float* out) {
  auto put = [&](int64_t r, int64_t c, int32_t acc) { out[r * n + c] = (float(acc) * sw[c]) * sa[r]; };
  int64_t r = 0;
  if (v.tile_i8 != nullptr) {
    for (; r + 2 <= m; r += 2) {
      int64_t c = c0;
      for (; c + 2 <= c1; c += 2) {
        int32_t t[4];
        v.tile_i8(qa + r * k, qa + (r + 1) * k, qw + c * k, qw + (c + 1) * k, k, t);
        put(r, c, t[0]);
        put(r, c + 1, t[1]);
        put(r + 1, c, t[2]);
        put(r + 1, c + 1, t[3]);
      }
      for (; c < c1; ++c) {
        put(r, c, v.dot_i8(qa + r * k, qw + c * k, k));
        put(r + 1, c, v.dot_i8(qa + (r + 1) * k, qw + c * k, k));
      }
    }
  }
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t rr = r; rr < m; ++rr) put(rr, c, v.dot_i8(qa + rr * k, qw + c * k, k));
}

// W4A8: packed nibbles pw [N, K/2] in the variant's layout, scales sw [N, G], per-row per-group
// activation sums gs [M, G] (used by the offset layout only).
inline void w4a8_columns(const Variant& v, const int8_t* qa, const float* sa, const int32_t* gs, int64_t m,
                         int64_t k, const uint8_t* pw, const float* sw, int64_t groups, int64_t n, int64_t c0,
                         int64_t c1, float* out) {
  const int64_t group = k / groups;
  const bool offset = v.layout == Int4Layout::Offset;
  // Offset nibbles: sum_g s_g * (dot_g(u, a) - 8 * sum_g(a)), the correction a short scalar dot product.
  auto put = [&](int64_t r, int64_t c, float dot) {
    float correction = 0.f;
    if (offset) {
      const float* srow = sw + c * groups;
      for (int64_t g = 0; g < groups; ++g) correction += srow[g] * float(gs[r * groups + g]);
    }
    out[r * n + c] = (dot - 8.f * correction) * sa[r];
  };
  auto row = [&](int64_t r, int64_t c) {
    return v.row_u4(qa + r * k, pw + c * (k / 2), sw + c * groups, groups, group);
  };
  int64_t r = 0;
  if (v.tile_u4 != nullptr) {
    for (; r + 2 <= m; r += 2) {
      int64_t c = c0;
      for (; c + 2 <= c1; c += 2) {
        float t[4];
        v.tile_u4(qa + r * k, qa + (r + 1) * k, pw + c * (k / 2), pw + (c + 1) * (k / 2), sw + c * groups,
                  sw + (c + 1) * groups, groups, group, t);
        put(r, c, t[0]);
        put(r, c + 1, t[1]);
        put(r + 1, c, t[2]);
        put(r + 1, c + 1, t[3]);
      }
      for (; c < c1; ++c) {
        put(r, c, row(r, c));
        put(r + 1, c, row(r + 1, c));
      }
    }
  }
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t rr = r; rr < m; ++rr) put(rr, c, row(rr, c));
}

// ---------------------------------------------------------------- panel variants
// W8A8 panels [p0, p1) (pack_int8_panel, offset for VNNI, signed for AVX2) for all M rows of qa, each
// row readable 4 bytes past its end; asum: per-row activation sums (VNNI's offset correction).
inline void w8a8_panels(const Variant& v, const int8_t* qa, const float* sa, const int32_t* asum, int64_t m,
                        int64_t k, const uint8_t* pw, const float* sw, int64_t n, int64_t p0, int64_t p1,
                        float* out) {
#if defined(__x86_64__)
  if (v.panels == kVnniPanels) return w8a8_panels_vnni(qa, sa, asum, m, k, pw, sw, n, p0, p1, out);
  if (v.panels == kAvx2Panels) return w8a8_panels_avx2(qa, sa, m, k, pw, sw, n, p0, p1, out);
#endif
  (void)v, (void)qa, (void)sa, (void)asum, (void)m, (void)k, (void)pw, (void)sw, (void)n, (void)p0, (void)p1;
  (void)out;
}

// W4A8 panels [p0, p1) (pack_int4_panel) with scales in panel order (pack_scales_panel).
inline void w4a8_panels(const Variant& v, const int8_t* qa, const float* sa, const int32_t* gs, int64_t m, int64_t k,
                        const uint8_t* pw, const float* sp, int64_t groups, int64_t n, int64_t p0, int64_t p1,
                        float* out) {
#if defined(__x86_64__)
  if (v.panels == kVnniPanels) return w4a8_panels_vnni(qa, sa, gs, m, k, pw, sp, groups, n, p0, p1, out);
  if (v.panels == kAvx2Panels) return w4a8_panels_avx2(qa, sa, gs, m, k, pw, sp, groups, n, p0, p1, out);
#endif
  (void)v, (void)qa, (void)sa, (void)gs, (void)m, (void)k, (void)pw, (void)sp, (void)groups, (void)n, (void)p0;
  (void)p1, (void)out;
}

// ---------------------------------------------------------------- weight layouts
// One nibble of value v in [-8, 7] in a layout.
inline uint8_t nibble_of(int v, Int4Layout layout) {
  return layout == Int4Layout::Offset ? uint8_t(v + 8) : uint8_t(v & 0x0F);
}

// int8 values in [-8, 7], one row of K -> the layout above (K / 2 bytes).
inline void pack_int4_row(const int8_t* src, int64_t k, uint8_t* dst, Int4Layout layout) {
  for (int64_t b = 0; b < k / 32; ++b)
    for (int j = 0; j < 16; ++j)
      dst[b * 16 + j] = uint8_t(nibble_of(src[b * 32 + j], layout) | (nibble_of(src[b * 32 + 16 + j], layout) << 4));
}

// compressed-tensors pack-quantized int4 (int32 words; word j holds k = 8j..8j+7, value + 8 at bits
// 4i), one row -> the layout above, without an int8 intermediate (value + 8 xor 8 is the value's
// two's-complement nibble).
inline void words_to_nibbles_row(const uint32_t* row, int64_t k, uint8_t* dst, Int4Layout layout) {
  const uint8_t flip = layout == Int4Layout::Offset ? 0 : 0x8;
  auto nibble = [&](int64_t i) { return uint8_t(((row[i / 8] >> (4 * (i % 8))) & 0x0F) ^ flip); };
  for (int64_t b = 0; b < k / 32; ++b)
    for (int j = 0; j < 16; ++j) dst[b * 16 + j] = uint8_t(nibble(b * 32 + j) | (nibble(b * 32 + 16 + j) << 4));
}

}  // namespace cpk
