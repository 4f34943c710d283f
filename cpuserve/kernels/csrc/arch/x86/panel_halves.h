// The panels as two 8-column halves of one ymm each: loads, broadcasts and stores shared by the
// 256-bit variants (avx2, avx_vnni). Compiled for AVX2; they inline into any superset target.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "panel_runs.h"

#define CPK_AVX2_TARGET "avx2,fma"

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

// The 8 scales of half h of panel i at s (masked past the panel's width).
__attribute__((target(CPK_AVX2_TARGET))) inline __m256 load_scales_half(const PanelRun& run, int i, int h,
                                                                         const float* s) {
  return _mm256_maskload_ps(s, lanes_below(run.width[i] - 8 * h));
}

}  // namespace cpk
