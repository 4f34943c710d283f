// The decoder's float ops around the quantized linears, one native call each instead of 5-20 torch
// ops: RMSNorm (alone and fused with the residual add), RoPE in place, SiLU-and-mul, and attention
// for one new token per sequence read straight from the (contiguous or paged) KV cache.
//
// Their reference twins are the pure-torch functions in cpuserve/model/ops.py. Each op rounds where
// the reference rounds (to bf16/fp16 after every torch op that produces a tensor of that dtype), so
// in fp32 the elementwise ops are bit-identical to torch; only sums (the RMSNorm mean, attention dot
// products) run in a different order. Loops are written with 8 independent partial sums so the
// compiler vectorizes them without reassociating float adds (-ffp-contract=off, no fast-math).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace {

constexpr int kLanes = 8;

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

// bf16 as its bits: a shift the compiler vectorizes (c10's conversion it does not).
template <>
inline float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = uint32_t(p[i].x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Rounds a float to T and back: where the torch reference materializes a T tensor.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

template <typename T>
float sum_squares(const T* x, int64_t n) {
  float part[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = load(x, i + j);
      part[j] += v * v;
    }
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += part[j];
  for (; i < n; ++i) total += load(x, i) * load(x, i);
  return total;
}

// out = w * T(x * rsqrt(mean(x^2) + eps)), as RMSNorm.forward in the reference.
template <typename T>
void rms_norm_row(const T* x, const T* w, int64_t n, float eps, T* out) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(load(w, i) * round_to<T>(load(x, i) * inv));
}

#define CPUSERVE_DISPATCH(dtype, name, ...)                                       \
  AT_DISPATCH_SWITCH(dtype, name, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)       \
                                      AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) \
                                      AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ (", a.scalar_type(), " vs ",
              b.scalar_type(), ")");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_same_dtype(x, weight, "rms_norm");
  auto xc = x.contiguous();
  const int64_t size = x.size(-1), count = size == 0 ? 0 : x.numel() / size;
  TORCH_CHECK(weight.numel() == size && weight.is_contiguous(), "rms_norm: weight must have ", size, " values");
  auto out = torch::empty(x.sizes(), x.options());
  CPUSERVE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        rms_norm_row(xp + i * size, wp, size, static_cast<float>(eps), op + i * size);
    });
  });
  return out;
}

// h' = h + delta * scale (rounded as the reference rounds), normed = rms_norm(h'). Returns {h', normed}.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, double scale, torch::Tensor weight,
                                        double eps) {
  check_same_dtype(h, delta, "add_rms_norm");
  check_same_dtype(h, weight, "add_rms_norm");
  TORCH_CHECK(h.sizes() == delta.sizes(), "add_rms_norm: h and delta shapes differ");
  auto hc = h.contiguous(), dc = delta.contiguous();
  const int64_t n = h.size(-1), rows = n == 0 ? 0 : h.numel() / n;
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "add_rms_norm: weight must have ", n, " values");
  auto sum = torch::empty(h.sizes(), h.options());
  auto normed = torch::empty(h.sizes(), h.options());
  const float s = static_cast<float>(scale);
  CPUSERVE_DISPATCH(h.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* hp = hc.data_ptr<scalar_t>();
    const scalar_t* dp = dc.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* sp = sum.data_ptr<scalar_t>();
    scalar_t* np = normed.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t o = r * n;
        if (s == 1.f) {
          for (int64_t i = 0; i < n; ++i) sp[o + i] = static_cast<scalar_t>(load(hp, o + i) + load(dp, o + i));
        } else {
          for (int64_t i = 0; i < n; ++i)
            sp[o + i] = static_cast<scalar_t>(load(hp, o + i) + round_to<scalar_t>(load(dp, o + i) * s));
        }
        rms_norm_row(sp + o, wp, n, static_cast<float>(eps), np + o);
      }
    });
  });
  return {sum, normed};
}

// x [T, H, D] (D contiguous, any row strides) rotated in place by cos/sin [T, D] ("rotate half").
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope_: x must be [T, H, D] with D contiguous");
  check_same_dtype(x, cos, "rope_");
  check_same_dtype(x, sin, "rope_");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  auto cc = cos.contiguous(), sc = sin.contiguous();
  TORCH_CHECK(d % 2 == 0 && cc.numel() == t * d && sc.numel() == t * d, "rope_: cos/sin must be [T, D]");
  const int64_t st = x.stride(0), sh = x.stride(1);
  CPUSERVE_DISPATCH(x.scalar_type(), "rope_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cc.data_ptr<scalar_t>();
    const scalar_t* sp = sc.data_ptr<scalar_t>();
    at::parallel_for(0, t * heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t job = begin; job < end; ++job) {
        const int64_t pos = job / heads;
        scalar_t* row = xp + pos * st + (job % heads) * sh;
        const scalar_t* c = cp + pos * d;
        const scalar_t* s = sp + pos * d;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = load(row, i), hi = load(row, i + half);
          // x * cos + rotated * sin, rotated = (-hi, lo): each product and the sum rounded to T.
          const float new_lo = round_to<scalar_t>(lo * load(c, i)) + round_to<scalar_t>(-hi * load(s, i));
          const float new_hi =
              round_to<scalar_t>(hi * load(c, i + half)) + round_to<scalar_t>(lo * load(s, i + half));
          row[i] = static_cast<scalar_t>(new_lo);
          row[i + half] = static_cast<scalar_t>(new_hi);
        }
      }
    });
  });
}

// gate, up [R, I] (rows of any stride, I contiguous; typically the two halves of one projection's
// output) -> silu(gate) * up [R, I].
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  check_same_dtype(gate, up, "silu_mul");
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: gate and up must be [R, I] with I contiguous");
  const int64_t rows = gate.size(0), inter = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = torch::empty({rows, inter}, gate.options());
  CPUSERVE_DISPATCH(gate.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    const scalar_t* upp = up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* g = gp + row * gs;
        const scalar_t* u = upp + row * us;
        scalar_t* o = op + row * inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float x = load(g, i);
          o[i] = static_cast<scalar_t>(round_to<scalar_t>(x / (1.f + std::exp(-x))) * load(u, i));
        }
      }
    });
  });
  return out;
}

namespace {

constexpr int kDotLanes = 16;  // one AVX-512 vector, two AVX2 vectors

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float part[kDotLanes] = {0.f};
  int64_t i = 0;
  for (; i + kDotLanes <= d; i += kDotLanes)
    for (int j = 0; j < kDotLanes; ++j) part[j] += q[i + j] * load(k, i + j);
  for (int w = kDotLanes / 2; w > 0; w /= 2)  // a tree, not a chain of 16 dependent adds
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  float total = part[0];
  for (; i < d; ++i) total += q[i] * load(k, i);
  return total;
}

// Where one decode-attention job reads and writes: sequence seq, KV head head.
struct AttentionJobs {
  const float* q;  // [N, Hq, D] fp32
  const void* k;
  const void* v;
  const int64_t* lengths;
  const int64_t* slots;  // [N, slot_stride] or null (contiguous cache: batch seq, position l)
  int64_t slot_stride, hq, hkv, d, kb, ks, kh, longest;
  float scale;
  float* out;  // [N, Hq, D] fp32
};

// Always inlined into the per-ISA clones below, so its loops are compiled for each ISA.
template <typename T>
__attribute__((always_inline)) inline void attention_jobs(const AttentionJobs& a, int64_t begin, int64_t end) {
  const int64_t group = a.hq / a.hkv, d = a.d;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  std::vector<float> scores(static_cast<size_t>(group * a.longest)), row(static_cast<size_t>(d));
  for (int64_t job = begin; job < end; ++job) {
    const int64_t seq = job / a.hkv, head = job % a.hkv, length = a.lengths[seq];
    const int64_t base = (a.slots ? 0 : seq * a.kb) + head * a.kh;
    const int64_t* slot = a.slots ? a.slots + seq * a.slot_stride : nullptr;
    const float* qs = a.q + (seq * a.hq + head * group) * d;
    for (int64_t l = 0; l < length; ++l) {  // each key row converted once for the heads that share it
      const T* key = kp + base + (slot ? slot[l] : l) * a.ks;
      for (int64_t i = 0; i < d; ++i) row[i] = load(key, i);
      for (int64_t g = 0; g < group; ++g) scores[g * a.longest + l] = dot(qs + g * d, row.data(), d) * a.scale;
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores.data() + g * a.longest;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t l = 0; l < length; ++l) top = std::max(top, sc[l]);
      float total = 0.f;
      for (int64_t l = 0; l < length; ++l) {
        sc[l] = std::exp(sc[l] - top);
        total += sc[l];
      }
      const float inv = 1.f / total;
      for (int64_t l = 0; l < length; ++l) sc[l] *= inv;
    }
    float* o = a.out + (seq * a.hq + head * group) * d;
    for (int64_t i = 0; i < group * d; ++i) o[i] = 0.f;
    for (int64_t l = 0; l < length; ++l) {  // each value row converted once, added to every head's output
      const T* value = vp + base + (slot ? slot[l] : l) * a.ks;
      for (int64_t i = 0; i < d; ++i) row[i] = load(value, i);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * a.longest + l];
        float* og = o + g * d;
        for (int64_t i = 0; i < d; ++i) og[i] += p * row[i];
      }
    }
  }
}

// The same loops compiled for AVX-512, AVX2 and the baseline, picked by the loader (ifunc): the
// score and value loops are where the time goes, and the baseline build has only SSE2.
#if defined(__x86_64__)
#define CPUSERVE_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CPUSERVE_CLONES
#endif
CPUSERVE_CLONES void attention_jobs_f32(const AttentionJobs& a, int64_t begin, int64_t end) {
  attention_jobs<float>(a, begin, end);
}
CPUSERVE_CLONES void attention_jobs_bf16(const AttentionJobs& a, int64_t begin, int64_t end) {
  attention_jobs<c10::BFloat16>(a, begin, end);
}
CPUSERVE_CLONES void attention_jobs_f16(const AttentionJobs& a, int64_t begin, int64_t end) {
  attention_jobs<c10::Half>(a, begin, end);
}

#if defined(__x86_64__)
// ---- AVX-512: keys in blocks of 16, no horizontal sum per dot product, vector exp.
// Scores: each key row is converted to fp32 once for the heads sharing it; each (head, key) leaves a
// 16-lane partial, and the 16 partials of a key block are summed lane-wise by one transpose tree
// (sum16) into the block's 16 scores. Softmax with a vector exp. Values: per 16 columns of the head
// dimension, every head's accumulator in a register, each value row read once.
#define CPUSERVE_AVX512 __attribute__((target("avx512f")))

CPUSERVE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
CPUSERVE_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
CPUSERVE_AVX512 inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Lane l of the result = the sum of v[l]'s 16 lanes.
CPUSERVE_AVX512 inline __m512 sum16(__m512 (&v)[16]) {
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
CPUSERVE_AVX512 inline __m512 exp16(__m512 x) {
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
CPUSERVE_AVX512 void attention_part_avx512(const AttentionJobs& a, int64_t seq, int64_t head, int64_t l0,
                                           int64_t l1, float* scores, float* mx, float* total, float* o) {
  const int64_t group = a.hq / a.hkv, d = a.d, chunks = d / 16, count = l1 - l0;
  const int64_t stride = (count + 15) / 16 * 16;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  const int64_t base = (a.slots ? 0 : seq * a.kb) + head * a.kh;
  const int64_t* slot = a.slots ? a.slots + seq * a.slot_stride : nullptr;
  const float* qs = a.q + (seq * a.hq + head * group) * d;
  auto row = [&](const T* p, int64_t l) { return p + base + (slot ? slot[l] : l) * a.ks; };
  alignas(64) float partial[kMaxGroup][16][16];
  for (int64_t b0 = 0; b0 < count; b0 += 16) {
    const int64_t nb = std::min<int64_t>(16, count - b0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= nb) {  // past the end of the part: zero partials, masked off below
        for (int64_t g = 0; g < group; ++g) _mm512_store_ps(partial[g][j], _mm512_setzero_ps());
        continue;
      }
      const T* key = row(kp, l0 + b0 + j);
      __m512 kv[kMaxHeadChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(key + 16 * c);
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
      const __m512 value = load16(row(vp, l0 + l) + 16 * c);
      for (int64_t g = 0; g < group; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(scores[g * stride + l]), value, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) _mm512_storeu_ps(o + g * d + 16 * c, acc[g]);
  }
}

constexpr int64_t kMaxParts = 16;  // key parts per (sequence, KV head)

// Jobs [begin, end): the weighted sum of their parts' outputs over the weighted sum of their totals,
// each part weighted by e^(its max - the job's max).
CPUSERVE_AVX512 void merge_parts(const AttentionJobs& a, int64_t split, const float* mx, const float* total,
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
CPUSERVE_AVX512 void attention_avx512(const AttentionJobs& a, int64_t n) {
  const int64_t group = a.hq / a.hkv, d = a.d, jobs = n * a.hkv;
  const int64_t threads = at::get_num_threads();
  int64_t split = jobs >= 2 * threads ? 1 : (2 * threads + jobs - 1) / jobs;
  split = std::max<int64_t>(1, std::min({split, a.longest / 64, kMaxParts}));  // at least 64 keys a part
  const int64_t parts = jobs * split;
  std::vector<float> mx(parts * group), total(parts * group), o(parts * group * d);
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(group * ((a.longest + split - 1) / split + 16)));
    for (int64_t p = begin; p < end; ++p) {
      const int64_t job = p / split, part = p % split, length = a.lengths[job / a.hkv];
      attention_part_avx512<T>(a, job / a.hkv, job % a.hkv, part * length / split, (part + 1) * length / split,
                               scores.data(), mx.data() + p * group, total.data() + p * group,
                               o.data() + p * group * d);
    }
  });
  // The merge is a few microseconds: on the calling thread unless there are many jobs.
  at::parallel_for(0, jobs, 64, [&](int64_t begin, int64_t end) {
    merge_parts(a, split, mx.data(), total.data(), o.data(), begin, end);
  });
}

// The CPU has AVX-512, the shape fits, and CPUSERVE_ISA (read per call, for tests and A/B runs) does
// not name a variant below it (generic, avx2): then the loops above run the portable template.
bool attention_avx512_fits(int64_t d, int64_t group) {
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  const char* isa = std::getenv("CPUSERVE_ISA");
  const bool below = isa != nullptr && (std::strcmp(isa, "generic") == 0 || std::strcmp(isa, "avx2") == 0);
  return cpu && !below && d % 16 == 0 && d / 16 <= kMaxHeadChunks && group <= kMaxGroup;
}
#endif  // __x86_64__

}  // namespace

// One query token per sequence against its cached keys/values, softmax in fp32.
// q [N, Hq, D]; k, v [B, S, Hkv, D] (D contiguous, any other strides). Sequence n reads positions
// 0 .. lengths[n]-1: without slots, from batch n at those positions (the contiguous cache); with
// slots [N, L] int64, from batch 0 at slots[n, l] (the paged cache). Returns [N, Hq, D] in q's dtype.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                               torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "decode_attention: q [N, Hq, D], k/v [B, S, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "decode_attention: k and v must match");
  TORCH_CHECK(k.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  check_same_dtype(k, v, "decode_attention");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(2), cap = k.size(1);
  TORCH_CHECK(k.size(3) == d && hq % hkv == 0, "decode_attention: head shapes do not fit");
  auto len = lengths.to(torch::kLong).contiguous();
  TORCH_CHECK(len.numel() == n, "decode_attention: one length per sequence");
  const int64_t* lp = len.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1, "decode_attention: every sequence needs at least one cached token");
    longest = std::max(longest, lp[i]);
  }
  torch::Tensor sl;
  AttentionJobs a{};
  if (slots.has_value()) {
    sl = slots->to(torch::kLong).contiguous();
    TORCH_CHECK(sl.dim() == 2 && sl.size(0) == n && sl.size(1) >= longest, "decode_attention: slots must be [N, L]");
    a.slots = sl.data_ptr<int64_t>();
    a.slot_stride = sl.size(1);
  } else {
    TORCH_CHECK(k.size(0) >= n && longest <= cap, "decode_attention: lengths exceed the cache");
  }
  auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty({n, hq, d}, torch::kFloat32);
  a.q = qf.data_ptr<float>();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.lengths = lp;
  a.hq = hq, a.hkv = hkv, a.d = d, a.kb = k.stride(0), a.ks = k.stride(1), a.kh = k.stride(2);
  a.longest = longest;
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr<float>();
  auto run = k.scalar_type() == torch::kFloat32    ? attention_jobs_f32
             : k.scalar_type() == torch::kBFloat16 ? attention_jobs_bf16
             : k.scalar_type() == torch::kHalf     ? attention_jobs_f16
                                                   : nullptr;
  TORCH_CHECK(run != nullptr, "decode_attention: unsupported cache dtype ", k.scalar_type());
#if defined(__x86_64__)
  if (attention_avx512_fits(d, hq / hkv)) {
    if (k.scalar_type() == torch::kFloat32) attention_avx512<float>(a, n);
    if (k.scalar_type() == torch::kBFloat16) attention_avx512<c10::BFloat16>(a, n);
    if (k.scalar_type() == torch::kHalf) attention_avx512<c10::Half>(a, n);
    return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
  }
#endif
  at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) { run(a, begin, end); });
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

void register_layer_ops(pybind11::module& mod) {
  mod.def("rms_norm", &rms_norm, "RMSNorm over the last dimension");
  mod.def("add_rms_norm", &add_rms_norm, "residual add (scaled) fused with the next RMSNorm: {sum, normed}");
  mod.def("rope_", &rope_, "rotary embedding in place, rotate-half layout");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up");
  mod.def("decode_attention", &decode_attention, "one query per sequence over the contiguous or paged KV cache");
}
