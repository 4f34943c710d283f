// The float panel kernel (float_kernel.h) on AVX-512F: a panel step is one zmm of 16 fp32, bf16
// widened by a zero-extend and a 16-bit shift, fp16 by vcvtph2ps. 8 rows of sums + 1 weight + 1
// broadcast of the 32 zmm registers (more rows gained nothing: the broadcasts share the load ports).
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../float_panels.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

#include "../../float_kernel.h"

namespace cpk {
namespace {

struct Zmm {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kRows = 8;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec broadcast(float x) { return _mm512_set1_ps(x); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const Bf16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Vec load(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
};

}  // namespace

void float_linear_avx512(const FloatArgs& a, int64_t p0, int64_t p1) { float_kernel::linear<Zmm>(a, p0, p1); }

}  // namespace cpk

#pragma GCC pop_options
#endif
