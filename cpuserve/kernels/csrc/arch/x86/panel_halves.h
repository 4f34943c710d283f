// The panels as two 8-column halves of one ymm each: loads, broadcasts and stores shared by the
// 256-bit variants (avx2, avx_vnni). Compiled for AVX2; they inline into any superset target.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "panel_runs.h"

#define CPK_AVX2_TARGET "avx2,fma,f16c"

namespace cpk {

__attribute__((target(CPK_AVX2_TARGET))) inline __m256i lanes_below(int64_t live) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Half h (columns 8h .. 8h + 7) of panel i's step j; lanes past the panel's width read as zero.
__attribute__((target(CPK_AVX2_TARGET))) inline __m256i load_half(const PanelRun& run, int i, int h, int64_t j) {
  const uint8_t* p = run.base[i] + j * run.step[i] + 32 * h;
  if (run.width[i] == kPanel) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), lanes_below(run.width[i] - 8 * h));
}

// A run's P weight streams as pointers advanced a step at a time, each step's bytes prefetched a run
// ahead (panel_runs.h prefetch_ahead): load_half's multiply per load and reloads of run's fields
// were a third of a decode block's instructions.
template <int P>
struct HalfStreams {
  const uint8_t* at[P];
  int64_t step[P];
  int64_t width[P];
  int64_t ahead;
  __attribute__((target(CPK_AVX2_TARGET), always_inline)) explicit HalfStreams(const PanelRun& run)
      : ahead(run.ahead) {
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      at[i] = run.base[i];
      step[i] = run.step[i];
      width[i] = run.width[i];
    }
  }
  // Half h of panel i's current step; lanes past the panel's width read as zero.
  __attribute__((target(CPK_AVX2_TARGET), always_inline)) __m256i half(int i, int h) const {
    if (width[i] == kPanel) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[i] + 32 * h));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(at[i] + 32 * h), lanes_below(width[i] - 8 * h));
  }
  __attribute__((target(CPK_AVX2_TARGET), always_inline)) void advance(int i) {
    if (ahead != 0) prefetch_l2(at[i], ahead);
    at[i] += step[i];
  }
};

// An int6 weight's 2-bit plane (panel_layout.h): step j of panel i's plane, 32 bytes after the
// panel's nibbles (prefetched a run ahead when the run says so), loaded once for both halves.
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline __m256i plane_step(const PanelRun& run, int i,
                                                                                 int64_t k, int64_t j) {
  const uint8_t* at = run.base[i] + kPanel * (k / 2) + j * kInt6PlaneStep;
  if (run.ahead != 0) prefetch_l2(at, run.ahead);
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}

// The plane step joined into half h's nibble vectors: half 0's lo takes bits 0-1 of its byte, half
// 1's bits 2-3, hi bits 4-5 and 6-7, each moved to bits 4-5 and masked.
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void join_plane_half(__m256i bits, int h, __m256i& lo,
                                                                                    __m256i& hi) {
  const __m256i two = _mm256_set1_epi8(0x30);
  const __m256i l = h == 0 ? _mm256_slli_epi16(bits, 4) : _mm256_slli_epi16(bits, 2);
  const __m256i u = h == 0 ? bits : _mm256_srli_epi16(bits, 2);
  lo = _mm256_or_si256(lo, _mm256_and_si256(l, two));
  hi = _mm256_or_si256(hi, _mm256_and_si256(u, two));
}

// A step's weight bytes v (half h) as two vectors of values: lo the low nibbles, hi the high ones,
// each joined with its two bits of the int6 plane step `bits` when HB != 0 (values <= 63).
template <int HB>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void nibble_halves(__m256i v, __m256i bits, int h,
                                                                                  __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(v, low);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (HB != 0) join_plane_half(bits, h, lo, hi);
}

// Int6 panels in prefill (as avx512_vnni's widen_int6_run): the run's np panels widened once into
// dst as int8 panels, each byte the stored w + 32 plus `lift` (-32: SignedPanels' w; 96: OffsetPanels'
// w + 128), for the W8A8 blocks (S8Panels, U8Panels); returns the run over dst.
__attribute__((target(CPK_AVX2_TARGET))) inline PanelRun widen_int6_run_halves(const PanelRun& run, int64_t np,
                                                                                int64_t k, uint8_t* dst,
                                                                                int8_t lift) {
  const __m256i add = _mm256_set1_epi8(lift);
  PanelRun wide = run;
  wide.ahead = 0;
  for (int64_t i = 0; i < np; ++i) {
    uint8_t* out = dst + i * kPanel * k;
    for (int64_t j = 0; j < k / kInt4StepInputs; ++j) {
      const __m256i bits = plane_step(wide, int(i), k, j);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run.base[i] + j * 4 * kPanel + 32 * h));
        __m256i lo, hi;
        nibble_halves<2>(v, bits, h, lo, hi);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 8 * kPanel + 32 * h), _mm256_add_epi8(lo, add));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j * 8 * kPanel + 4 * kPanel + 32 * h),
                            _mm256_add_epi8(hi, add));
      }
    }
  }
  for (int64_t i = 0; i < np; ++i) {
    wide.base[i] = dst + i * kPanel * k;
    wide.step[i] = 4 * kPanel;
  }
  return wide;
}

// vbroadcastss from memory: a load-port operation (set1 of a loaded int went through a general
// register, movd and vpbroadcastd: three ALU operations per broadcast, the inner loop's bottleneck).
__attribute__((target(CPK_AVX2_TARGET))) inline __m256i broadcast4_ymm(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// Stores (or masked stores) 8 results of half h of panel i.
__attribute__((target(CPK_AVX2_TARGET))) inline void store_half(const PanelRun& run, int i, int h, float* out,
                                                                 __m256 v) {
  if (run.width[i] == kPanel)
    _mm256_storeu_ps(out, v);
  else
    _mm256_maskstore_ps(out, lanes_below(run.width[i] - 8 * h), v);
}

// The 8 scales of half h of panel i at s (masked past the panel's width; a full panel's read plain:
// the mask and vmaskmovps ran once per group and half in the grouped blocks).
__attribute__((target(CPK_AVX2_TARGET))) inline __m256 load_scales_half(const PanelRun& run, int i, int h,
                                                                         const float* s) {
  if (run.width[i] == kPanel) return _mm256_loadu_ps(s);
  return _mm256_maskload_ps(s, lanes_below(run.width[i] - 8 * h));
}

// Half h of panel i's scales s and offsets o (Stored with offsets) of group g, in super-blocks sb and
// ob (scale_codes::super_block, once a group: a division per half cost as much as its weights).
template <typename Groups>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void group_values_half(const PanelRun& run,
                                                                                     const Groups& src, int i, int h,
                                                                                     int64_t groups, int64_t g,
                                                                                     int64_t sb, int64_t ob,
                                                                                     __m256& s, __m256& o) {
  if constexpr (!Groups::kStored) {
    if (h == 0) src.request_next(run, i, groups, g);
    s = load_scales_half(run, i, h, src.group(run, i, groups, g) + 8 * h);
  } else if (run.width[i] == kPanel) {
    scale_codes::group8(src.gs, src.at[i], g, sb, ob, h, s, o);
  } else {
    float sv[kPanel], ov[kPanel];
    scale_codes::narrow_group(src.gs, src.at[i], run.width[i], g, sv, ov);
    s = _mm256_loadu_ps(sv + 8 * h);
    o = _mm256_loadu_ps(ov + 8 * h);
  }
}

// The grouped blocks' float side, shared by every 256-bit grouped kernel (W4A8, grouped W8A8): group
// g's int32 sums folded into the float sums in memory (facc += float(acc) * s, s the group's weight
// scales, times the token's group scale when activations are scaled per group: PG), and at the end
// the float sums stored, times the token scale unless PG. The panel twin's fmas, in its order. With
// stored offsets (panel_runs.h StoredGroups), their term summed alongside in oacc and added at the
// end: the driver's offsets pass (linear_driver.cpp), same bits.
template <int R, int P, bool PG, typename Groups>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void fold_group_halves(
    const PanelRun& run, const __m256i (&acc)[R][P][2], const Groups& src, const int32_t* gs, int64_t groups,
    int64_t g, const float* sa, float (&facc)[R][P][2][8], float (&oacc)[R][P][2][8]) {
  int64_t sb = 0, ob = 0;
  if constexpr (Groups::kStored) {
    sb = scale_codes::super_block(src.gs.scales, g);
    ob = scale_codes::super_block(src.gs.offsets, g);
    for (int i = 0; i < src.prefetch; ++i) scale_codes::prefetch_group(src.gs, src.next[i], g, sb, ob);
  }
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i)
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 s, o = _mm256_setzero_ps();
      group_values_half(run, src, i, h, groups, g, sb, ob, s, o);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(facc[r][i][h],
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][i][h]),
                                        PG ? _mm256_mul_ps(s, _mm256_set1_ps(sa[r * groups + g])) : s,
                                        _mm256_load_ps(facc[r][i][h])));
        if constexpr (Groups::kStored) {
          if (!src.offsets) continue;
          const float gsum = float(gs[r * groups + g]);  // the driver's offsets_weight, one fma
          _mm256_store_ps(oacc[r][i][h], _mm256_fmadd_ps(o, _mm256_set1_ps(PG ? gsum * sa[r * groups + g] : gsum),
                                                         _mm256_load_ps(oacc[r][i][h])));
        }
      }
    }
}

template <int R, int P, bool PG, typename Groups>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void store_group_halves(
    const PanelRun& run, const Groups& src, const float (&facc)[R][P][2][8], const float (&oacc)[R][P][2][8],
    const float* sa, float* out, int64_t n) {
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i)
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 v = PG ? _mm256_load_ps(facc[r][i][h]) : _mm256_mul_ps(_mm256_load_ps(facc[r][i][h]), _mm256_set1_ps(sa[r]));
        if constexpr (Groups::kStored) {
          if (src.offsets) {
            const __m256 t = _mm256_load_ps(oacc[r][i][h]);
            v = _mm256_add_ps(v, PG ? t : _mm256_mul_ps(t, _mm256_set1_ps(sa[r])));
          }
        }
        store_half(run, i, h, out + r * n + i * kPanel + 8 * h, v);
      }
}

// The integer fold (Acts kFold) on halves, avx512_vnni's fold_int: the super-block's integer sums
// in memory beside the float sums (touched once per group; the registers hold the accumulators).
template <int R, int P>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void fold_int_halves(
    const PanelRun& run, const __m256i (&acc)[R][P][2], const StoredGroups& src, const int32_t* gs, int64_t groups,
    int64_t g, FoldAt& at, const float* sa, int32_t (&iacc)[R][P][2][8], int32_t (&macc)[R][P][2][8],
    float (&facc)[R][P][2][8]) {
  for (int i = 0; i < src.prefetch; ++i) scale_codes::prefetch_group(src.gs, src.next[i], g, at.b, at.b);
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i)
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i sc, oc;
      scale_codes::fold_codes8(src.gs, src.at[i], run.width[i], g, h, sc, oc);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i* ia = reinterpret_cast<__m256i*>(iacc[r][i][h]);
        _mm256_store_si256(ia, _mm256_add_epi32(_mm256_load_si256(ia), _mm256_mullo_epi32(acc[r][i][h], sc)));
        if (!src.offsets) continue;
        __m256i* ma = reinterpret_cast<__m256i*>(macc[r][i][h]);
        _mm256_store_si256(ma, _mm256_add_epi32(_mm256_load_si256(ma),
                                                _mm256_mullo_epi32(oc, _mm256_set1_epi32(gs[r * groups + g]))));
      }
    }
  const int64_t b = at.b;
  if (!at.closes(src.per)) return;
  ++at.b;
  const int64_t blocks = groups / src.per;
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i)
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 S, O;
      scale_codes::fold_supers8(src.gs, src.at[i], run.width[i], b, h, S, O);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i* ia = reinterpret_cast<__m256i*>(iacc[r][i][h]);
        __m256i* ma = reinterpret_cast<__m256i*>(macc[r][i][h]);
        __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_load_si256(ia)), S);
        if (src.offsets) t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(ma)), O, t);
        _mm256_store_ps(facc[r][i][h], _mm256_fmadd_ps(t, _mm256_set1_ps(sa[r * blocks + b]), _mm256_load_ps(facc[r][i][h])));
        _mm256_store_si256(ia, _mm256_setzero_si256());
        _mm256_store_si256(ma, _mm256_setzero_si256());
      }
    }
}

// A grouped block's sums on halves, in memory (touched once per group; the registers hold the
// integer accumulators): the float sums, the offsets' term, and the integer fold's sums (zeroed only
// under it). The fold's place in the super-blocks (FoldAt) stays a local of the block, in registers.
template <int R, int P, int A>
struct HalfSums {
  alignas(32) float facc[R][P][2][8] = {};
  alignas(32) float oacc[R][P][2][8] = {};
  alignas(32) int32_t iacc[R][P][2][8];
  alignas(32) int32_t macc[R][P][2][8];
  __attribute__((always_inline)) HalfSums() {
    if constexpr (A == kFold) {
      std::memset(iacc, 0, sizeof iacc);
      std::memset(macc, 0, sizeof macc);
    }
  }
};

// A grouped block's side per group (A: Acts): the float fold, or the integer fold.
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void end_group_halves(
    const PanelRun& run, const __m256i (&acc)[R][P][2], const Groups& src, const int32_t* gs, int64_t groups,
    int64_t g, FoldAt& at, const float* sa, HalfSums<R, P, A>& sums) {
  if constexpr (A == kFold) {
    if constexpr (Groups::kStored)
      fold_int_halves<R, P>(run, acc, src, gs, groups, g, at, sa, sums.iacc, sums.macc, sums.facc);
  } else {
    fold_group_halves<R, P, A == kPerGroup>(run, acc, src, gs, groups, g, sa, sums.facc, sums.oacc);
  }
}

// The end of a grouped block on halves: the sums stored (the fold's already scaled and offset).
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_AVX2_TARGET), always_inline)) inline void end_block_halves(
    const PanelRun& run, const Groups& src, const HalfSums<R, P, A>& sums, const float* sa, float* out, int64_t n) {
  if constexpr (A == kFold) {
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i)
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          store_half(run, i, h, out + r * n + i * kPanel + 8 * h, _mm256_load_ps(sums.facc[r][i][h]));
  } else {
    store_group_halves<R, P, A == kPerGroup>(run, src, sums.facc, sums.oacc, sa, out, n);
  }
}

}  // namespace cpk
