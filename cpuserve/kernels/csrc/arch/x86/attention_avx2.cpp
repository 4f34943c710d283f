// avx2's (and avx_vnni's) attention. Prefill: the query and key blocks of prefill_blocks.h on ymm
// (fp32). Decode: the key blocks of attention_blocks.h on ymm (8 keys a
// block, lane masks for the tails, the exp's power of two built in the exponent bits). Shapes it
// does not fit (head dimension not a multiple of 8 or over 256, over 16 query heads per KV head)
// run the portable loops compiled for AVX2.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../attention.h"
#include "../../prefill_attention.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "../../attention_blocks.h"
#include "../../prefill_blocks.h"
#include "ymm_lanes.h"

namespace cpk {
namespace {

struct Ymm : YmmLanes {
  using Mask = __m256;  // all ones in the lanes it keeps
  using YmmLanes::load;
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static Mask first(int64_t n) {
    const int live = int(std::min<int64_t>(n, 8));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  }
  // maskload reads (and may fault on) only the lanes under the mask.
  static Vec load_first(const float* p, Mask m, float fill) {
    return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(p, _mm256_castps_si256(m)), m);
  }
  static void store_first(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, _mm256_castps_si256(m), v); }
  static Vec keep(Mask m, Vec v) { return _mm256_and_ps(m, v); }
  static float reduce_max(Vec v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static float reduce_add(Vec v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static Vec sum_lanes(const float (&rows)[8][8]) {
    Vec v[8];
    for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(rows[i]);
    __m256 a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
      b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    // b[0]'s 128-bit halves hold v[0..3]'s sums over lanes 0-3 and 4-7, b[1]'s v[4..7]'s.
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }
  // e^x, ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the AVX-512 kernel's degree-6 Taylor
  // polynomial; 2^n written into a float's exponent bits, so x is held to [-87.3, 88] (n in
  // [-126, 127]) and anything below -87.3 (the softmax's -inf shifted scores included) gives 0, as
  // does NaN, like AVX-512's exp (a NaN query still gives NaN: its largest score is NaN, and the
  // merge's weight e^(mx - top) with it).
  static Vec exp(Vec x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_NGE_UQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bias = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(bias, 23))));
  }
};

CPK_PORTABLE_ATTENTION(portable_avx2, )
CPK_PORTABLE_PREFILL(portable_prefill_avx2, )

}  // namespace

void decode_attention_avx2(const AttentionArgs& a, const Parallel& par) {
  attention_blocks::dispatch<Ymm>(a, par, portable_avx2);
}

void prefill_attention_avx2(const PrefillArgs& a, const Parallel& par) {
  prefill_blocks::dispatch<Ymm>(a, par, portable_prefill_avx2);
}

}  // namespace cpk

#pragma GCC pop_options
#endif  // __x86_64__
