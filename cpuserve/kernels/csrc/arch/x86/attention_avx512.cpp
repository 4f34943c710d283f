// avx512_vnni's attention. Decode: the key blocks of attention_blocks.h on zmm (16 keys a block,
// mask registers for the tails, scalef for the exp's power of two). Prefill: the query and key blocks
// of prefill_blocks.h on zmm; on a bf16 cache where the CPU has AVX512_BF16, with bf16 pairs
// (vdpbf16ps: keys, values, queries and the softmax's probabilities in bf16, sums in fp32; twice the
// multiply-adds of an fp32 FMA an instruction). Shapes neither fits (head dimension not a multiple
// of 16 or over 256; decode: over 16 query heads per KV head) run the portable loops compiled for
// AVX-512.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../attention.h"
#include "../../cpu_features.h"
#include "../../prefill_attention.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f")

#include "../../attention_blocks.h"
#include "../../prefill_blocks.h"

namespace cpk {
namespace {

struct Zmm {
  using Vec = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kLanes = 16;
  static constexpr int64_t kRegisters = 32;  // zmm0-31
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
CPK_PORTABLE_PREFILL(portable_prefill_avx512, )

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

// prefill_blocks' dot engine on bf16 pairs: a 32-bit lane holds two bf16 values neighbouring in
// the sum (keys: two dimensions of one key; values: one dimension of two keys), and vdpbf16ps adds
// both products to an fp32 lane. Packed keys [d / 2][kKeys], values [kKeys / 2][d].
struct Bf16Pairs {
  using Elem = uint32_t;
  static constexpr int64_t kStep = 2;
  static constexpr int64_t kKeys = prefill_blocks::kKeys;

  static uint32_t pair(uint16_t lo, uint16_t hi) { return uint32_t(lo) | uint32_t(hi) << 16; }

  template <typename T>
  static void pack(const PrefillArgs& a, int64_t seq, int64_t head, int64_t first, int64_t count, uint32_t* keys,
                   uint32_t* values) {
    static_assert(std::is_same<T, Bf16>::value, "bf16 pairs read a bf16 cache");
    const int64_t d = a.d;
    for (int64_t j = 0; j < kKeys; ++j) {
      const Bf16* k = j < count ? prefill_row<Bf16>(a, a.k, seq, head, first + j) : nullptr;
      for (int64_t x = 0; x < d; x += 2) keys[(x / 2) * kKeys + j] = k ? pair(k[x].bits, k[x + 1].bits) : 0u;
    }
    for (int64_t j = 0; j < kKeys; j += 2) {
      const Bf16* v0 = j < count ? prefill_row<Bf16>(a, a.v, seq, head, first + j) : nullptr;
      const Bf16* v1 = j + 1 < count ? prefill_row<Bf16>(a, a.v, seq, head, first + j + 1) : nullptr;
      for (int64_t x = 0; x < d; ++x) values[(j / 2) * d + x] = pair(v0 ? v0[x].bits : 0, v1 ? v1[x].bits : 0);
    }
  }

  // Query rows as bf16 pairs (exact for a bf16 model's queries), rows beyond `rows` repeating row 0.
  static void queries(const float* const* q, int64_t rows, int64_t padded, int64_t d, uint32_t* dst) {
    for (int64_t r = 0; r < padded; ++r) {
      const float* src = q[r < rows ? r : 0];
      for (int64_t x = 0; x < d; x += 32)
        _mm512_storeu_si512(dst + r * (d / 2) + x / 2,
                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + x + 16), _mm512_loadu_ps(src + x)));
    }
  }

  static void scores(const uint32_t* q, int64_t padded, int64_t d, const uint32_t* keys, float* s) {
    const int64_t steps = d / 2;
    for (int64_t r0 = 0; r0 < padded; r0 += 4) {
      __m512 acc[4][4];
      for (auto& row : acc)
        for (auto& x : row) x = _mm512_setzero_ps();
      for (int64_t x = 0; x < steps; ++x) {
        __m512bh kv[4];
        for (int c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(keys + x * kKeys + c * 16);
        for (int r = 0; r < 4; ++r) {
          const __m512bh qb = (__m512bh)_mm512_set1_epi32(int(q[(r0 + r) * steps + x]));
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, kv[c]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + (r0 + r) * kKeys + c * 16, acc[r][c]);
    }
  }

  // out [padded][d] += p [padded][kKeys] x values, p rounded to bf16 pairs of neighbouring keys; NC
  // vectors of the head dimension from column c0 (compile-time, so the accumulators stay in registers).
  template <int NC>
  static void add_value_columns(const uint32_t (*pairs)[kKeys / 2], int64_t d, const uint32_t* values, float* out,
                                int64_t c0) {
    __m512 acc[4][NC];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(out + r * d + c0 + c * 16);
    for (int64_t j = 0; j < kKeys / 2; ++j) {
      __m512bh vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(values + j * d + c0 + c * 16);
      for (int r = 0; r < 4; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(int(pairs[r][j]));
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + r * d + c0 + c * 16, acc[r][c]);
  }

  static void add_values(const float* p, int64_t padded, int64_t d, const uint32_t* values, float* out) {
    for (int64_t r0 = 0; r0 < padded; r0 += 4) {
      alignas(64) uint32_t pairs[4][kKeys / 2];
      for (int r = 0; r < 4; ++r)
        for (int64_t j = 0; j < kKeys; j += 32) {
          const float* pr = p + (r0 + r) * kKeys + j;
          _mm512_store_si512(pairs[r] + j / 2,
                             (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(pr + 16), _mm512_loadu_ps(pr)));
        }
      int64_t c0 = 0;
      for (; c0 + 64 <= d; c0 += 64) add_value_columns<4>(pairs, d, values, out + r0 * d, c0);
      if (c0 < d) add_value_columns<2>(pairs, d, values, out + r0 * d, c0);  // d % 32 == 0: 32 columns left
    }
  }
};

#pragma GCC pop_options

static_assert(prefill_blocks::rows_at_once<Zmm>() == 4, "the bf16 pair engine blocks 4 rows, as Zmm's");

}  // namespace

void decode_attention_avx512_vnni(const AttentionArgs& a, const Parallel& par) {
  attention_blocks::dispatch<Zmm>(a, par, portable_avx512);
}

void prefill_attention_avx512_vnni(const PrefillArgs& a, const Parallel& par) {
  if (a.q_bf16 && !a.k_scale && a.dtype == DType::Bf16 && (cpu_features() & kAvx512Bf16) && a.d % 32 == 0 &&
      a.d <= prefill_blocks::kMaxHeadDim)
    return prefill_blocks::run<Zmm, Bf16Pairs, Bf16>(a, par);
  prefill_blocks::dispatch<Zmm>(a, par, portable_prefill_avx512);
}

}  // namespace cpk

#pragma GCC pop_options
#endif  // __x86_64__
