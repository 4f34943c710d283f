// avx512_vnni's decode attention: keys in blocks of 16, no horizontal sum per dot product, a vector
// exp, and long contexts split into parts over the threads (the flash-decoding reduction). Shapes it
// does not fit (head dimension not a multiple of 16 or over 256, over 16 query heads per KV head) run
// the portable loops compiled for AVX-512.
#if defined(__x86_64__)
#include <immintrin.h>

#include "../../attention.h"
#include "kernels.h"

namespace cpk {
namespace {

// ---- AVX-512: keys in blocks of 16, no horizontal sum per dot product, vector exp.
// Scores: each key row is converted to fp32 once for the heads sharing it; each (head, key) leaves a
// 16-lane partial, and the 16 partials of a key block are summed lane-wise by one transpose tree
// (sum16) into the block's 16 scores. Softmax with a vector exp. Values: per 16 columns of the head
// dimension, every head's accumulator in a register, each value row read once.
#define CPK_AVX512 __attribute__((target("avx512f")))

CPK_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CPK_AVX512 inline __m512 load16(const Bf16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
CPK_AVX512 inline __m512 load16(const F16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
CPK_AVX512 inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 values of a cache row as the attention reads them: an int8 row times its scale, a float row as stored.
template <typename T>
CPK_AVX512 inline __m512 load16_scaled(const T* p, float scale) {
  if constexpr (kInt8Cache<T>) return _mm512_mul_ps(load16(p), _mm512_set1_ps(scale));
  return load16(p);
}

// Lane l of the result = the sum of v[l]'s 16 lanes.
CPK_AVX512 inline __m512 sum16(__m512 (&v)[16]) {
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
CPK_AVX512 inline __m512 exp16(__m512 x) {
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

constexpr int64_t kMaxHeadChunks = 16;  // head dimension up to 256
constexpr int64_t kMaxGroup = 16;       // query heads per KV head

// One part of a job: keys [l0, l1) of (seq, head) for its `group` query heads. Leaves, per head, the
// part's largest score (mx), the sum of e^(score - mx) (total) and the unnormalized output
// sum e^(score - mx) v (o, [group, d]); an empty part leaves -inf, 0, 0. attention_avx512 merges.
template <typename T>
CPK_AVX512 void attention_part_avx512(const AttentionArgs& a, int64_t seq, int64_t head, int64_t l0,
                                           int64_t l1, float* scores, float* mx, float* total, float* o) {
  const int64_t group = a.hq / a.hkv, d = a.d, chunks = d / 16, count = l1 - l0;
  const int64_t stride = (count + 15) / 16 * 16;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  const int64_t base = (a.slots ? 0 : seq * a.kb) + head * a.kh;
  const int64_t* slot = a.slots ? a.slots + seq * a.slot_stride : nullptr;
  const float* qs = a.q + (seq * a.hq + head * group) * d;
  auto position = [&](int64_t l) { return slot ? slot[l] : l; };
  auto row = [&](const T* p, int64_t l) { return p + base + position(l) * a.ks; };
  alignas(64) float partial[kMaxGroup][16][16];
  for (int64_t b0 = 0; b0 < count; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, count - b0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= nb) {  // past the end of the part: zero partials, masked off below
        for (int64_t g = 0; g < group; ++g) _mm512_store_ps(partial[g][j], _mm512_setzero_ps());
        continue;
      }
      const T* key = row(kp, l0 + b0 + j);
      const float ks = row_scale<T>(a.k_scale, a, seq, position(l0 + b0 + j), head);
      __m512 kv[kMaxHeadChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16_scaled(key + 16 * c, ks);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qs + g * d;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], acc);
        _mm512_store_ps(partial[g][j], acc);
      }
    }
    const __mmask16 live = __mmask16((1u << nb) - 1);
    for (int64_t g = 0; g < group; ++g) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) v[j] = _mm512_load_ps(partial[g][j]);
      _mm512_mask_storeu_ps(scores + g * stride + b0, live, _mm512_mul_ps(sum16(v), _mm512_set1_ps(a.scale)));
    }
  }
  auto mask_at = [&](int64_t l) { return __mmask16(count - l >= 16 ? 0xFFFF : (1u << (count - l)) - 1); };
  for (int64_t g = 0; g < group; ++g) {
    float* sc = scores + g * stride;
    __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < count; l += 16)
      top = _mm512_mask_max_ps(top, mask_at(l), top, _mm512_maskz_loadu_ps(mask_at(l), sc + l));
    mx[g] = _mm512_reduce_max_ps(top);
    const __m512 shift = _mm512_set1_ps(mx[g]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; l += 16) {
      const __mmask16 m = mask_at(l);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + l), shift));
      _mm512_mask_storeu_ps(sc + l, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    __m512 acc[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t l = 0; l < count; ++l) {
      const __m512 value =
          load16_scaled(row(vp, l0 + l) + 16 * c, row_scale<T>(a.v_scale, a, seq, position(l0 + l), head));
      for (int64_t g = 0; g < group; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + l]), value, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(o + g * d + 16 * c, acc[g]);
  }
}

constexpr int64_t kMaxParts = 16;  // key parts per (sequence, KV head)

// Jobs [begin, end): the weighted sum of their parts' outputs over the weighted sum of their totals,
// each part weighted by e^(its max - the job's max).
CPK_AVX512 void merge_parts(const AttentionArgs& a, int64_t split, const float* mx, const float* total,
                                 const float* o, int64_t begin, int64_t end) {
  const int64_t group = a.hq / a.hkv, d = a.d;
  for (int64_t job = begin; job < end; ++job)
    for (int64_t g = 0; g < group; ++g) {
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t part = 0; part < split; ++part) top = std::max(top, mx[(job * split + part) * group + g]);
      float weight[kMaxParts], sum = 0.f;
      for (int64_t part = 0; part < split; ++part) {
        const int64_t i = (job * split + part) * group + g;
        weight[part] = total[i] > 0.f ? std::exp(mx[i] - top) : 0.f;
        sum += weight[part] * total[i];
      }
      const __m512 inv = _mm512_set1_ps(1.f / sum);
      float* out = a.out + ((job / a.hkv) * a.hq + (job % a.hkv) * group + g) * d;
      for (int64_t c = 0; c < d; c += 16) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t part = 0; part < split; ++part)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(weight[part]), _mm512_loadu_ps(o + ((job * split + part) * group + g) * d + c),
                                acc);
        _mm512_storeu_ps(out + c, _mm512_mul_ps(acc, inv));
      }
    }
}

// Splits each (sequence, KV head)'s keys into parts when there are too few of those to give every
// thread work (SmolLM2: 3 KV heads on 2 threads left one thread idle a third of the time), then merges
// the parts' softmax statistics (the flash-decoding reduction).
template <typename T>
CPK_AVX512 void attention_avx512(const AttentionArgs& a, const Parallel& par) {
  const int64_t group = a.hq / a.hkv, d = a.d, jobs = a.n * a.hkv;
  const int64_t threads = par.threads;
  int64_t split = jobs >= 2 * threads ? 1 : (2 * threads + jobs - 1) / jobs;
  split = std::max<int64_t>(1, std::min({split, a.longest / 64, kMaxParts}));  // at least 64 keys a part
  const int64_t parts = jobs * split;
  std::vector<float> mx(parts * group), total(parts * group), o(parts * group * d);
  par.for_range(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * ((a.longest + split - 1) / split + 16)));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t job = p / split, part = p % split, length = a.lengths[job / a.hkv];
      attention_part_avx512<T>(a, job / a.hkv, job % a.hkv, part * length / split, (part + 1) * length / split,
                               scores.data(), mx.data() + p * group, total.data() + p * group,
                               o.data() + p * group * d);
    }
  });
  // The merge is a few microseconds: on the calling thread unless there are many jobs.
  par.for_range(0, jobs, 64, [&](int64_t begin, int64_t end) {
    merge_parts(a, split, mx.data(), total.data(), o.data(), begin, end);
  });
}

constexpr bool fits(int64_t d, int64_t group) { return d % 16 == 0 && d / 16 <= kMaxHeadChunks && group <= kMaxGroup; }

CPK_PORTABLE_ATTENTION(portable_avx512, __attribute__((target("avx512f"))))

}  // namespace

void decode_attention_avx512_vnni(const AttentionArgs& a, const Parallel& par) {
  if (!fits(a.d, a.hq / a.hkv)) return portable_avx512(a, par);
  if (a.k_scale) return attention_avx512<int8_t>(a, par);
  if (a.dtype == DType::F32) return attention_avx512<float>(a, par);
  if (a.dtype == DType::Bf16) return attention_avx512<Bf16>(a, par);
  attention_avx512<F16>(a, par);
}

}  // namespace cpk
#endif  // __x86_64__
