// Coded group scales and offsets (linear_driver.h: GroupValues, GroupScales) expanded to the fp32
// values the kernels read, for a few 16-column units (panels) at a time, into a thread's buffer:
//   scale  = super[g / per] * code            (no super: the code itself)
//   offset = mid * scale + osuper[g / per] * ocode
// Both products are exact in fp32 (an fp16 times an 8-bit integer; mid a power of two) and the sum
// is rounded once, so every path here gives the same bits (quant/scale_codes.py is the reference).
// The scalar path serves every layout; full panels of the x86 panel variants take a vector path
// (AVX-512 or AVX2 with F16C): decode reads each panel's scales once, and a scalar expansion cost
// as much as the panel's weights took to stream.
// Decode's kernels (LinearArgs::direct) read them in place instead, one group of one panel at a time
// into registers (group16, group8; narrow_group for a weight's narrow last panel), with the same
// products and sums: no expanded copy written and read back, no second pass for the offsets.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "float_types.h"
#include "linear_driver.h"
#include "panel_layout.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cpk {
namespace scale_codes {

inline float widen(Code code, const void* p, int64_t i) {
  switch (code) {
    case Code::U8: return float(static_cast<const uint8_t*>(p)[i]);
    case Code::I8: return float(static_cast<const int8_t*>(p)[i]);
    case Code::F16: return to_float(static_cast<const F16*>(p)[i]);
    case Code::F32: break;
  }
  return static_cast<const float*>(p)[i];
}

// Units [u0, u1) of one GroupValues into dst (unit u0 first). panel_order: unit u's [G][w] block at
// 16u * G (panel scales, every offset); else rows [w][G].
inline void expand_scalar(const GroupValues& gv, bool panel_order, int64_t n, int64_t groups, int64_t u0, int64_t u1,
                          float* dst) {
  const int64_t supers = gv.super != nullptr ? groups / gv.per : 0;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t w = panel_width(n, u), at = u * kPanel * groups, sat = u * kPanel * supers;
    float* d = dst + (u - u0) * kPanel * groups;
    for (int64_t c = 0; c < w; ++c)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t i = panel_order ? g * w + c : c * groups + g;
        const float x = widen(gv.code, gv.values, at + i);
        if (gv.super == nullptr) {
          d[i] = x;
          continue;
        }
        d[i] = gv.super_at(sat + (panel_order ? (g / gv.per) * w + c : c * supers + g / gv.per)) * x;
      }
  }
}

// Offsets of units [u0, u1) (already expanded to their coded part) += mid * the scale of the same
// group and column, read from scales (unit u0 first, in the scales' order).
inline void add_mid_scales(int64_t n, int64_t groups, bool scales_panel_order, int64_t u0, int64_t u1,
                           const float* scales, float mid, float* offsets) {
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t w = panel_width(n, u), at = (u - u0) * kPanel * groups;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t c = 0; c < w; ++c) {
        const float s = scales[at + (scales_panel_order ? g * w + c : c * groups + g)];
        offsets[at + g * w + c] = mid * s + offsets[at + g * w + c];
      }
  }
}

// Where panel u's group values start: its values (codes or fp32) and its scales' and offsets'
// super-block factors, all in panel order (the offsets' order is the same for a full panel).
struct PanelAt {
  int64_t values = 0, scale_supers = 0, offset_supers = 0;
};
inline PanelAt panel_at(const GroupScales& gs, int64_t groups, int64_t u) {
  PanelAt at;
  at.values = u * kPanel * groups;
  if (gs.scales.super != nullptr) at.scale_supers = u * kPanel * (groups / gs.scales.per);
  if (gs.offsets.super != nullptr) at.offset_supers = u * kPanel * (groups / gs.offsets.per);
  return at;
}

// Group g's super-block of gv (0 without factors): once per group, not per panel.
inline int64_t super_block(const GroupValues& gv, int64_t g) { return gv.super != nullptr ? g / gv.per : 0; }

// Group g of a narrow panel (w < 16 columns): its scales into s and its offsets (if any) into o,
// zero past w; expand_scalar's and add_mid_scales' arithmetic, so the same bits.
inline void narrow_group(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t g, float* s, float* o) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t sb = super_block(sv, g), ob = super_block(ov, g);
  for (int64_t c = 0; c < kPanel; ++c) {
    s[c] = o[c] = 0.f;
    if (c >= w) continue;
    const float x = widen(sv.code, sv.values, at.values + g * w + c);
    s[c] = sv.super != nullptr ? sv.super_at(at.scale_supers + sb * w + c) * x : x;
    if (ov.values == nullptr) continue;
    const float y = widen(ov.code, ov.values, at.values + g * w + c);
    const float coded = ov.super != nullptr ? ov.super_at(at.offset_supers + ob * w + c) * y : y;
    o[c] = ov.coded() ? gs.mid * s[c] + coded : coded;
  }
}

// The integer fold (GroupScales::fold_per, LinearArgs::sa_per): code i of an 8-bit GroupValues.
inline int32_t int_code(const GroupValues& gv, int64_t i) {
  return gv.code == Code::U8 ? int32_t(static_cast<const uint8_t*>(gv.values)[i])
                             : int32_t(static_cast<const int8_t*>(gv.values)[i]);
}

// Group g's integer codes (scales sc, offsets oc if any) and super-block b's factors (S, O) of the
// panel at `at` with w columns, zero past w: the narrow last panel's, and the twin's, reads.
inline void fold_codes(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t g, int32_t* sc, int32_t* oc) {
  for (int64_t c = 0; c < kPanel; ++c) {
    sc[c] = c < w ? int_code(gs.scales, at.values + g * w + c) : 0;
    oc[c] = c < w && gs.offsets.values != nullptr ? int_code(gs.offsets, at.values + g * w + c) : 0;
  }
}
inline void fold_supers(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t b, float* S, float* O) {
  for (int64_t c = 0; c < kPanel; ++c) {
    S[c] = c < w ? gs.scales.super_at(at.scale_supers + b * w + c) : 0.f;
    O[c] = c < w && gs.offsets.values != nullptr ? gs.offsets.super_at(at.offset_supers + b * w + c) : 0.f;
  }
}

#if defined(__x86_64__)
#define CPK_CODES_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#define CPK_CODES_AVX2 __attribute__((target("avx2,fma,f16c")))

// 16 (or 8) super-block factors, fp16 as stored, widened exactly.
CPK_CODES_AVX512 inline __m512 supers16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

CPK_CODES_AVX512 inline __m512 widen16(Code code, const void* p, int64_t i) {
  switch (code) {
    case Code::U8:
      return _mm512_cvtepi32_ps(
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i))));
    case Code::I8:
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + i))));
    case Code::F16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
    case Code::F32: break;
  }
  return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// Full panel u (16 columns): its scales into s and, with o, its offsets into o ([G][16] each). Groups
// in runs of `per` under one factor (no division per group: it cost more than the panel's weights).
// Coded offsets share their scales' super-blocks (quant/scale_codes.py: one `per` for both).
CPK_CODES_AVX512 inline void expand_panel_avx512(const GroupScales& gs, int64_t groups, int64_t u, float* s, float* o) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t at = u * kPanel * groups, per = sv.super != nullptr ? sv.per : groups;
  const F16* ssup = sv.super != nullptr ? sv.super + u * kPanel * (groups / per) : nullptr;
  const F16* osup = o != nullptr && ov.super != nullptr ? ov.super + u * kPanel * (groups / per) : nullptr;
  const __m512 mid = _mm512_set1_ps(gs.mid);
  for (int64_t g0 = 0, b = 0; g0 < groups; g0 += per, ++b) {
    const __m512 sf = ssup != nullptr ? supers16(ssup + b * kPanel) : _mm512_setzero_ps();
    const __m512 of = osup != nullptr ? supers16(osup + b * kPanel) : _mm512_setzero_ps();
    for (int64_t g = g0; g < g0 + per; ++g) {
      __m512 x = widen16(sv.code, sv.values, at + g * kPanel);
      if (ssup != nullptr) x = _mm512_mul_ps(sf, x);
      _mm512_storeu_ps(s + g * kPanel, x);
      if (o == nullptr) continue;
      __m512 y = widen16(ov.code, ov.values, at + g * kPanel);
      if (osup != nullptr) y = _mm512_mul_ps(of, y);
      _mm512_storeu_ps(o + g * kPanel, _mm512_add_ps(_mm512_mul_ps(mid, x), y));
    }
  }
}

CPK_CODES_AVX2 inline __m256 supers8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

CPK_CODES_AVX2 inline __m256 widen8(Code code, const void* p, int64_t i) {
  switch (code) {
    case Code::U8:
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i))));
    case Code::I8:
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + i))));
    case Code::F16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    case Code::F32: break;
  }
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

CPK_CODES_AVX2 inline void expand_panel_avx2(const GroupScales& gs, int64_t groups, int64_t u, float* s, float* o) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t at = u * kPanel * groups, per = sv.super != nullptr ? sv.per : groups;
  const F16* ssup = sv.super != nullptr ? sv.super + u * kPanel * (groups / per) : nullptr;
  const F16* osup = o != nullptr && ov.super != nullptr ? ov.super + u * kPanel * (groups / per) : nullptr;
  const __m256 mid = _mm256_set1_ps(gs.mid);
  for (int64_t g0 = 0, b = 0; g0 < groups; g0 += per, ++b)
    for (int64_t h = 0; h < kPanel; h += 8) {
      const __m256 sf = ssup != nullptr ? supers8(ssup + b * kPanel + h) : _mm256_setzero_ps();
      const __m256 of = osup != nullptr ? supers8(osup + b * kPanel + h) : _mm256_setzero_ps();
      for (int64_t g = g0; g < g0 + per; ++g) {
        __m256 x = widen8(sv.code, sv.values, at + g * kPanel + h);
        if (ssup != nullptr) x = _mm256_mul_ps(sf, x);
        _mm256_storeu_ps(s + g * kPanel + h, x);
        if (o == nullptr) continue;
        __m256 y = widen8(ov.code, ov.values, at + g * kPanel + h);
        if (osup != nullptr) y = _mm256_mul_ps(of, y);
        _mm256_storeu_ps(o + g * kPanel + h, _mm256_add_ps(_mm256_mul_ps(mid, x), y));
      }
    }
}

inline int64_t code_bytes(Code code) { return code == Code::F32 ? 4 : code == Code::F16 ? 2 : 1; }

// The line at base + offset bytes requested (Hint: _MM_HINT_T0 into L1, T1 into L2). The address is
// made as an integer: decode's requests run past the end of their arrays (a thread's last run asks
// for the next one's), harmless for a prefetch, where a pointer formed there would not be.
template <decltype(_MM_HINT_T0) Hint>
__attribute__((always_inline)) inline void prefetch_at(const void* base, int64_t offset) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(base) + uintptr_t(offset)), Hint);
}

// The same when base + offset is the line's first group of values (groups of `bytes` each): a panel's
// groups are consecutive, so the other groups on the line came with it and asking again would only
// take a load slot.
template <decltype(_MM_HINT_T0) Hint>
inline void prefetch_values(const void* base, int64_t offset, int64_t bytes) {
  if (((reinterpret_cast<uintptr_t>(base) + uintptr_t(offset)) & 63) < uintptr_t(bytes)) prefetch_at<Hint>(base, offset);
}

// Group g's values and factors of the panel at `at` requested: decode's kernels ask for the next
// run's into L2 while this run computes (its code loads missed cache: the top samples of a Q4_K
// block), and for this run's next group into L1 (panel_runs.h request_group).
template <decltype(_MM_HINT_T0) Hint = _MM_HINT_T1>
inline void prefetch_group(const GroupScales& gs, const PanelAt& at, int64_t g, int64_t sb, int64_t ob) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t i = at.values + g * kPanel, f = int64_t(sizeof(F16));
  prefetch_values<Hint>(sv.values, i * code_bytes(sv.code), kPanel * code_bytes(sv.code));
  if (sv.super != nullptr) prefetch_values<Hint>(sv.super, (at.scale_supers + sb * kPanel) * f, kPanel * f);
  if (ov.values == nullptr) return;
  prefetch_values<Hint>(ov.values, i * code_bytes(ov.code), kPanel * code_bytes(ov.code));
  if (ov.super != nullptr) prefetch_values<Hint>(ov.super, (at.offset_supers + ob * kPanel) * f, kPanel * f);
}

// Group g (super-blocks sb, ob: super_block) of a full panel into registers: its 16 scales s and, if
// the linear has offsets, its 16 offsets o. expand_panel_avx512's products, so the same bits.
CPK_CODES_AVX512 inline void group16(const GroupScales& gs, const PanelAt& at, int64_t g, int64_t sb, int64_t ob,
                                     __m512& s, __m512& o) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t i = at.values + g * kPanel;
  s = widen16(sv.code, sv.values, i);
  if (sv.super != nullptr) s = _mm512_mul_ps(supers16(sv.super + at.scale_supers + sb * kPanel), s);
  if (ov.values == nullptr) return;
  o = widen16(ov.code, ov.values, i);
  if (ov.super != nullptr) o = _mm512_mul_ps(supers16(ov.super + at.offset_supers + ob * kPanel), o);
  if (ov.coded()) o = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(gs.mid), s), o);
}

// The integer fold's reads of the panel at `at` (w columns) into lanes: group g's codes (sc; oc the
// offsets', zero without) and super-block b's factors (S, O). A full panel reads them in place, a
// narrow one through fold_codes / fold_supers (lanes past w zero). 16 lanes, or half h's 8.
CPK_CODES_AVX512 inline __m512i int_codes16(const GroupValues& gv, int64_t i) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(gv.values) + i));
  return gv.code == Code::U8 ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes);
}
CPK_CODES_AVX512 inline void fold_codes16(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t g, __m512i& sc,
                                          __m512i& oc) {
  if (w == kPanel) {
    sc = int_codes16(gs.scales, at.values + g * kPanel);
    oc = gs.offsets.values != nullptr ? int_codes16(gs.offsets, at.values + g * kPanel) : _mm512_setzero_si512();
    return;
  }
  int32_t s16[kPanel], o16[kPanel];
  fold_codes(gs, at, w, g, s16, o16);
  sc = _mm512_loadu_si512(s16);
  oc = _mm512_loadu_si512(o16);
}
CPK_CODES_AVX512 inline void fold_supers16(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t b, __m512& S,
                                           __m512& O) {
  if (w == kPanel) {
    S = supers16(gs.scales.super + at.scale_supers + b * kPanel);
    O = gs.offsets.values != nullptr ? supers16(gs.offsets.super + at.offset_supers + b * kPanel)
                                     : _mm512_setzero_ps();
    return;
  }
  float s16[kPanel], o16[kPanel];
  fold_supers(gs, at, w, b, s16, o16);
  S = _mm512_loadu_ps(s16);
  O = _mm512_loadu_ps(o16);
}
CPK_CODES_AVX2 inline __m256i int_codes8(const GroupValues& gv, int64_t i) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(gv.values) + i));
  return gv.code == Code::U8 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
}
CPK_CODES_AVX2 inline void fold_codes8(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t g, int h,
                                       __m256i& sc, __m256i& oc) {
  if (w == kPanel) {
    const int64_t i = at.values + g * kPanel + 8 * h;
    sc = int_codes8(gs.scales, i);
    oc = gs.offsets.values != nullptr ? int_codes8(gs.offsets, i) : _mm256_setzero_si256();
    return;
  }
  int32_t s16[kPanel], o16[kPanel];
  fold_codes(gs, at, w, g, s16, o16);
  sc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + 8 * h));
  oc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(o16 + 8 * h));
}
CPK_CODES_AVX2 inline void fold_supers8(const GroupScales& gs, const PanelAt& at, int64_t w, int64_t b, int h,
                                        __m256& S, __m256& O) {
  if (w == kPanel) {
    S = supers8(gs.scales.super + at.scale_supers + b * kPanel + 8 * h);
    O = gs.offsets.values != nullptr ? supers8(gs.offsets.super + at.offset_supers + b * kPanel + 8 * h)
                                     : _mm256_setzero_ps();
    return;
  }
  float s16[kPanel], o16[kPanel];
  fold_supers(gs, at, w, b, s16, o16);
  S = _mm256_loadu_ps(s16 + 8 * h);
  O = _mm256_loadu_ps(o16 + 8 * h);
}

// The same for half h (columns 8h .. 8h + 7) of a full panel: expand_panel_avx2's products.
// Always inlined: left to GCC it stayed a call per group and half, its results passed back through
// memory, and held a fifth of an AVX2 single-stream decode of the bundled Q4_1 model's samples
// (inlined: +8-40% tok/s, the avx2 variant on a Zen 5 host; docs/benchmarks.md). group16 inlined
// measured no gain on avx512_vnni there.
CPK_CODES_AVX2 __attribute__((always_inline)) inline void group8(const GroupScales& gs, const PanelAt& at, int64_t g,
                                                                 int64_t sb, int64_t ob, int h, __m256& s, __m256& o) {
  const GroupValues &sv = gs.scales, &ov = gs.offsets;
  const int64_t i = at.values + g * kPanel + 8 * h;
  s = widen8(sv.code, sv.values, i);
  if (sv.super != nullptr) s = _mm256_mul_ps(supers8(sv.super + at.scale_supers + sb * kPanel + 8 * h), s);
  if (ov.values == nullptr) return;
  o = widen8(ov.code, ov.values, i);
  if (ov.super != nullptr) o = _mm256_mul_ps(supers8(ov.super + at.offset_supers + ob * kPanel + 8 * h), o);
  if (ov.coded()) o = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(gs.mid), s), o);
}
#endif

// Units [u0, u1) of a linear's scales and offsets into s and o (unit u0 first), whichever are coded
// (plain scales: read where they are, at scales_at, unit u0 first). panels: the variant's scales are
// in panel order. A twin (no SIMD needs) takes the scalar path, the variants theirs: the same bits.
inline void expand(const Variant& v, const GroupScales& gs, bool panels, int64_t n, int64_t groups, int64_t u0,
                   int64_t u1, float* s, float* o, const float* scales_at) {
  const bool coded_scales = gs.scales.coded(), coded_offsets = gs.offsets.values != nullptr && gs.offsets.coded();
#if defined(__x86_64__)
  const bool same_blocks = gs.offsets.super == nullptr || (gs.scales.super != nullptr && gs.offsets.per == gs.scales.per);
  if (panels && coded_scales && (coded_offsets || gs.offsets.values == nullptr) && same_blocks &&
      (v.needs & (kAvx512Vnni | kAvx2))) {
    const bool wide = v.needs & kAvx512Vnni;
    int64_t u = u0;
    for (; u < u1 && panel_width(n, u) == kPanel; ++u) {
      float* su = s + (u - u0) * kPanel * groups;
      float* ou = coded_offsets ? o + (u - u0) * kPanel * groups : nullptr;
      if (wide)
        expand_panel_avx512(gs, groups, u, su, ou);
      else
        expand_panel_avx2(gs, groups, u, su, ou);
    }
    if (u == u1) return;
    s += (u - u0) * kPanel * groups;  // the narrow last panel
    if (coded_offsets) o += (u - u0) * kPanel * groups;
    u0 = u;
  }
#endif
  if (coded_scales) {
    expand_scalar(gs.scales, panels, n, groups, u0, u1, s);
    scales_at = s;
  }
  if (coded_offsets) {
    expand_scalar(gs.offsets, true, n, groups, u0, u1, o);
    add_mid_scales(n, groups, panels, u0, u1, scales_at, gs.mid, o);
  }
}

}  // namespace scale_codes
}  // namespace cpk
