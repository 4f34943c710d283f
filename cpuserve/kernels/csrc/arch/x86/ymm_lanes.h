// 8 fp32 lanes of a ymm register and the loads that widen the cache's and weights' element types
// into them (bf16 by a zero-extend and a 16-bit shift, fp16 by F16C): shared by the float panel
// kernel (float_avx2.cpp) and decode attention (attention_avx2.cpp). Include it under their
// "avx2,fma,f16c" target pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../../float_types.h"

namespace cpk {

struct YmmLanes {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int64_t kRegisters = 16;  // ymm0-15
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const Bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static Vec load(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};

}  // namespace cpk
