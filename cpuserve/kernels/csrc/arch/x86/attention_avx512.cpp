// avx512_vnni's decode attention: the key blocks of attention_blocks.h on zmm (16 keys a block,
// mask registers for the tails, scalef for the exp's power of two). Shapes it does not fit (head
// dimension not a multiple of 16 or over 256, over 16 query heads per KV head) run the portable
// loops compiled for AVX-512.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../attention.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f")

#include "../../attention_blocks.h"

namespace cpk {
namespace {

struct Zmm {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const Bf16* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static Vec load(const F16* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static Mask first(int64_t n) { return n >= 16 ? Mask(0xFFFF) : Mask((1u << n) - 1); }
  static Vec load_first(const float* p, Mask m, float fill) { return _mm512_mask_loadu_ps(set1(fill), m, p); }
  static void store_first(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
  static Vec keep(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }
  static float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
  static Vec sum_lanes(const float (&rows)[16][16]) {
    Vec v[16];
    for (int i = 0; i < 16; ++i) v[i] = _mm512_loadu_ps(rows[i]);
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
  }
  // e^x, ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6 Taylor polynomial; scalef
  // gives 0 for large negative x (the softmax's -inf shifted scores included).
  static Vec exp(Vec x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
  }
};

CPK_PORTABLE_ATTENTION(portable_avx512, )

}  // namespace

void decode_attention_avx512_vnni(const AttentionArgs& a, const Parallel& par) {
  attention_blocks::dispatch<Zmm>(a, par, portable_avx512);
}

}  // namespace cpk

#pragma GCC pop_options
#endif  // __x86_64__
