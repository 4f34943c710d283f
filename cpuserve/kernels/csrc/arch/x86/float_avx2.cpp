// The float panel kernel (float_kernel.h) on AVX2 + FMA: a panel step is two ymm of 8 fp32, bf16
// widened by a zero-extend and a 16-bit shift, fp16 by F16C (every AVX2 CPU has it). 6 rows x 2
// vectors of sums + 2 weights + 1 broadcast: 15 of the 16 ymm registers.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../float_panels.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "../../float_kernel.h"

namespace cpk {
namespace {

struct Ymm {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kRows = 6;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec broadcast(float x) { return _mm256_set1_ps(x); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load(const Bf16* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static Vec load(const F16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};

}  // namespace

void float_linear_avx2(const FloatArgs& a, int64_t p0, int64_t p1) { float_kernel::linear<Ymm>(a, p0, p1); }

}  // namespace cpk

#pragma GCC pop_options
#endif
