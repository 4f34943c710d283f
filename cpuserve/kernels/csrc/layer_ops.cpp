// The decoder's float ops around the quantized linears, one native call each instead of 5-20 torch
// ops: RMSNorm (alone and fused with the residual add; Llama's and Gemma's unit-offset one), RoPE in
// place, SiLU-and-mul and GeGLU (gelu's tanh approximation), and the torch
// binding of decode attention (attention.h: one new token per sequence read straight from the
// contiguous or paged KV cache, the variant's own kernel). The elementwise ops have one version for
// every ISA (they are counted under the variant that called them), but for SiLU's and GeGLU's bf16
// rows, whose loop is compiled for each x86 width the variant's CPU allows (the same operations a
// lane: the same bits); attention has per-ISA versions.
//
// Their reference twins are the pure-torch functions in cpuserve/model/ops.py. Each op rounds where
// the reference rounds (to bf16/fp16 after every torch op that produces a tensor of that dtype), so
// in fp32 the elementwise ops are bit-identical to torch; only sums (the RMSNorm mean, attention dot
// products) run in a different order, and exp and tanh (SiLU, GeGLU) are other implementations. Loops are written with 8 independent partial sums so the
// compiler vectorizes them without reassociating float adds (-ffp-contract=off, no fast-math).

#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cpu_features.h"
#include "linear_driver.h"
#include "prefill_attention.h"
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

// exp(x) for x in [-87, 88.37] (clamped there: exp(-87) is tiny, and from 88.38 on n would be 128,
// outside float's exponents; a NaN becomes -87: callers keep x's NaN). Branch-free, so the compiler
// may vectorize its loops; libm's tanh, one call per element, made Gemma's pp512 655 tok/s against
// torch's 965, this 900-970 (docs/benchmarks.md, Zen 4). 2^n * e^r, n = round(x / ln 2), r = x - n ln 2
// with ln 2 in two parts (Cody-Waite), e^r by Cephes' expf polynomial on [-ln 2 / 2, ln 2 / 2], 2^n made in the exponent bits.
// Its error is bounded only through GeGLU's test budget (tests/test_layer_ops.py), not on its own.
inline float exp_poly(float x) {
  x = std::min(88.3762626647949f, std::max(-87.f, x));  // argument order: a NaN x gives -87
  const float shift = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer (the default rounding)
  const float n = (x * 1.44269504088896341f + shift) - shift;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
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

// out = w * T(x * rsqrt(mean(x^2) + eps)), as RMSNorm.forward in the reference; unit_offset
// (Gemma): out = T((x * rsqrt(mean(x^2) + eps)) * (1 + w)), all in fp32 before the one rounding.
template <typename T>
void rms_norm_row(const T* x, const T* w, int64_t n, float eps, T* out, bool unit_offset) {
  const float inv = 1.f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  if (unit_offset) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>((load(x, i) * inv) * (1.f + load(w, i)));
    return;
  }
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

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, const Variant& variant, bool unit_offset) {
  cpk::count(variant, cpk::kRmsNorm);
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
        rms_norm_row(xp + i * size, wp, size, static_cast<float>(eps), op + i * size, unit_offset);
    });
  });
  return out;
}

// h' = h + delta * scale (rounded as the reference rounds), normed = rms_norm(h'). Returns {h', normed}.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, double scale, torch::Tensor weight,
                                        double eps, const Variant& variant, bool unit_offset) {
  cpk::count(variant, cpk::kAddRmsNorm);
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
        rms_norm_row(sp + o, wp, n, static_cast<float>(eps), np + o, unit_offset);
      }
    });
  });
  return {sum, normed};
}

// x [T, H, D] (D contiguous, any row strides) rotated in place by cos/sin [T, D] ("rotate half").
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const Variant& variant) {
  cpk::count(variant, cpk::kRope);
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

// fp32 -> bf16 bits as c10::BFloat16's constructor rounds (to nearest even; NaN to 0x7FC0), in integer
// operations the compiler vectorizes (c10's conversion it does not).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float bf16_value(uint16_t bits) { return cpk::bits_to_float(uint32_t(bits) << 16); }

// One row of act_mul, every step vectorizable: act must be branch-free (exp_poly, not libm's). A
// bf16 row (as bits) rounds where the reference rounds; an fp32 row rounds nowhere. A decode step's
// 1536-wide SiLU row took 11 us in bf16 with scalar conversions and std::exp; fp32 rows compiled
// for the baseline ISA were 4% of a batch-8 SmolLM2 step held to AVX2.
template <typename Act>
inline void act_mul_row(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t n, const Act& act) {
  for (int64_t i = 0; i < n; ++i) o[i] = bf16_bits(bf16_value(bf16_bits(act(bf16_value(g[i])))) * bf16_value(u[i]));
}
template <typename Act>
inline void act_mul_row(const float* g, const float* u, float* o, int64_t n, const Act& act) {
  for (int64_t i = 0; i < n; ++i) o[i] = act(g[i]) * u[i];
}

template <typename E, typename Act>
using ActRow = void (*)(const E*, const E*, E*, int64_t, const Act&);

#if defined(__x86_64__)
template <typename E, typename Act>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void act_mul_avx512(const E* g, const E* u, E* o, int64_t n,
                                                                         const Act& act) {
  act_mul_row(g, u, o, n, act);
}
template <typename E, typename Act>
__attribute__((target("avx2,fma"))) void act_mul_avx2(const E* g, const E* u, E* o, int64_t n, const Act& act) {
  act_mul_row(g, u, o, n, act);
}
#endif
template <typename E, typename Act>
void act_mul_portable(const E* g, const E* u, E* o, int64_t n, const Act& act) {
  act_mul_row(g, u, o, n, act);
}

// The widest compilation of the row the variant's CPU features allow (the same floats at each:
// no contraction, no reassociation).
template <typename E, typename Act>
ActRow<E, Act> act_mul_for(const Variant& v) {
#if defined(__x86_64__)
  if (v.needs & cpk::kAvx512Vnni) return act_mul_avx512<E, Act>;
  if (v.needs & cpk::kAvx2) return act_mul_avx2<E, Act>;
#endif
  (void)v;
  return act_mul_portable<E, Act>;
}

// Rows of E (bf16 as bits, or fp32) through the variant's compilation of the row, rows over the threads.
template <typename E, typename Act>
void act_mul_rows(const E* gp, const E* upp, E* op_, int64_t rows, int64_t inter, int64_t gs, int64_t us,
                  const Variant& variant, const Act& act) {
  const ActRow<E, Act> row_of = act_mul_for<E, Act>(variant);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) row_of(gp + row * gs, upp + row * us, op_ + row * inter, inter, act);
  });
}

// gate, up [R, I] (rows of any stride, I contiguous; typically the two halves of one projection's
// output) -> T(act(gate)) * up [R, I], act in fp32 on the widened gate, rounded where the reference
// rounds (act's tensor, then the product). The SiLU and GeGLU ops below.
template <typename Act>
torch::Tensor act_mul(torch::Tensor gate, torch::Tensor up, const Variant& variant, cpk::Op op, const char* name,
                      const Act& act) {
  cpk::count(variant, op);
  check_same_dtype(gate, up, name);
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(1) == 1 && up.stride(1) == 1, name,
              ": gate and up must be [R, I] with I contiguous");
  const int64_t rows = gate.size(0), inter = gate.size(1), gs = gate.stride(0), us = up.stride(0);
  auto out = torch::empty({rows, inter}, gate.options());
  if (gate.scalar_type() == at::kBFloat16) {
    act_mul_rows(reinterpret_cast<const uint16_t*>(gate.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(up.data_ptr<at::BFloat16>()),
                 reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), rows, inter, gs, us, variant, act);
    return out;
  }
  if (gate.scalar_type() == at::kFloat) {
    act_mul_rows(gate.data_ptr<float>(), up.data_ptr<float>(), out.data_ptr<float>(), rows, inter, gs, us, variant, act);
    return out;
  }
  CPUSERVE_DISPATCH(gate.scalar_type(), "act_mul", [&] {
    const scalar_t* gp = gate.data_ptr<scalar_t>();
    const scalar_t* upp = up.data_ptr<scalar_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* g = gp + row * gs;
        const scalar_t* u = upp + row * us;
        scalar_t* o = op_ + row * inter;
        for (int64_t i = 0; i < inter; ++i)
          o[i] = static_cast<scalar_t>(round_to<scalar_t>(act(load(g, i))) * load(u, i));
      }
    });
  });
  return out;
}

// silu(gate) * up, e^-x from exp_poly (branch-free: the rows vectorize). Its clamp is harmless
// here: below x = -88 silu is x / (1 + 2.4e38), about 0 as it should be; above 87, x. At -inf the
// clamp would give -inf / 2.4e38 = -inf: NaN there, as torch's -inf * sigmoid(-inf) is (a select).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, const Variant& variant) {
  return act_mul(gate, up, variant, cpk::kSiluMul, "silu_mul", [](float x) {
    const float y = x / (1.f + exp_poly(-x));
    return x == -std::numeric_limits<float>::infinity() ? std::numeric_limits<float>::quiet_NaN() : y;
  });
}

// gelu(gate) * up with gelu's tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3),
// torch's formula, tanh from exp_poly.
torch::Tensor gelu_tanh_mul(torch::Tensor gate, torch::Tensor up, const Variant& variant) {
  const float beta = float(M_SQRT2 * M_2_SQRTPI * 0.5), kappa = 0.044715f;
  return act_mul(gate, up, variant, cpk::kGeluMul, "gelu_tanh_mul", [beta, kappa](float x) {
    // tanh(u) = 2 / (1 + e^(-2u)) - 1, rounded to fp32 as the reference's tanh is: below u of about -9
    // it is -1 and gelu exactly -0 there too, not the tiny value 1 + tanh(u) really is
    const float tanh = 2.f / (1.f + exp_poly(-2.f * (beta * (x + kappa * (x * x * x))))) - 1.f;
    return 0.5f * x * (1.f + tanh);
  });
}

// What both attention bindings read of a cache k [B, S, Hkv, D]: an int8 cache's row scales (fp32
// [B, S, Hkv], k's and v's alike) or a float cache's dtype, into args (AttentionArgs / PrefillArgs).
template <typename Args>
void cache_format(const torch::Tensor& k, const c10::optional<torch::Tensor>& k_scale,
                  const c10::optional<torch::Tensor>& v_scale, const char* op, Args& a) {
  const bool int8 = k.scalar_type() == torch::kInt8;
  TORCH_CHECK(int8 == k_scale.has_value() && int8 == v_scale.has_value(), op,
              ": an int8 cache needs its k and v scales, a float cache none");
  if (!int8) {
    a.dtype = float_dtype(k, (std::string(op) + ": cache").c_str());
    return;
  }
  for (const auto* s : {&*k_scale, &*v_scale})
    TORCH_CHECK(s->scalar_type() == torch::kFloat32 && s->dim() == 3 && s->sizes() == k.sizes().slice(0, 3), op,
                ": int8 cache scales must be fp32 [B, S, Hkv]");
  TORCH_CHECK(k_scale->strides() == v_scale->strides(), op, ": k and v scales must match");
  a.k_scale = k_scale->data_ptr<float>();
  a.v_scale = v_scale->data_ptr<float>();
  a.sb = k_scale->stride(0), a.ss = k_scale->stride(1), a.sh = k_scale->stride(2);
}

// One query token per sequence against its cached keys/values, softmax in fp32.
// q [N, Hq, D]; k, v [B, S, Hkv, D] (D contiguous, any other strides). Sequence n reads positions
// 0 .. lengths[n]-1: without slots, from batch n at those positions (the contiguous cache); with
// slots [N, L] int64, from batch 0 at slots[n, l] (the paged cache). Returns [N, Hq, D] in q's dtype.
// An int8 cache comes with k_scale, v_scale [B, S, Hkv] fp32: each row of D values times its scale.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                               torch::Tensor lengths, double scale, const Variant& variant,
                               c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
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
  cpk::AttentionArgs a{};
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
  cache_format(k, k_scale, v_scale, "decode_attention", a);
  a.lengths = lp;
  a.n = n, a.hq = hq, a.hkv = hkv, a.d = d, a.kb = k.stride(0), a.ks = k.stride(1), a.kh = k.stride(2);
  a.longest = longest;
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr<float>();
  cpk::decode_attention(variant, torch_parallel(), a);
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

// T new tokens per sequence against every key they see, causal (query i is key context - T + i),
// with an optional sliding window (0: none), softmax in fp32. q [B, T, Hq, D]; k, v [B, S, Hkv, D]
// (D contiguous, any other strides): key l of sequence b at position l, or with slots [L] int64
// (the paged cache, B == 1) at slots[l]; context = L keys. Returns [B, T, Hq, D] in q's dtype.
// An int8 cache comes with k_scale, v_scale [B, S, Hkv] fp32.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                                int64_t context, int64_t window, double scale, const Variant& variant,
                                c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "prefill_attention: q [B, T, Hq, D], k/v [B, S, Hkv, D]");
  TORCH_CHECK(k.sizes() == v.sizes() && k.strides() == v.strides(), "prefill_attention: k and v must match");
  TORCH_CHECK(k.stride(3) == 1, "prefill_attention: the head dimension must be contiguous");
  check_same_dtype(k, v, "prefill_attention");
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3), hkv = k.size(2);
  TORCH_CHECK(k.size(3) == d && hkv >= 1 && hq % hkv == 0, "prefill_attention: head shapes do not fit");
  TORCH_CHECK(t >= 1 && context >= t && window >= 0, "prefill_attention: needs 1 <= T <= context, window >= 0");
  TORCH_CHECK(scale > 0, "prefill_attention: the scale must be positive");
  cpk::PrefillArgs a{};
  torch::Tensor sl;
  if (slots.has_value()) {
    sl = slots->to(torch::kLong).contiguous();
    TORCH_CHECK(b == 1 && k.size(0) == 1 && sl.dim() == 1 && sl.size(0) == context,
                "prefill_attention: slots [context] for one sequence of a [1, S, Hkv, D] cache");
    const int64_t* sp = sl.data_ptr<int64_t>();
    for (int64_t i = 0; i < context; ++i)
      TORCH_CHECK(sp[i] >= 0 && sp[i] < k.size(1), "prefill_attention: slot ", sp[i], " outside the cache");
    a.slots = sp;
  } else {
    TORCH_CHECK(k.size(0) >= b && context <= k.size(1), "prefill_attention: the context exceeds the cache");
  }
  auto qf = q.to(torch::kFloat32).contiguous();
  auto out = torch::empty({b, t, hq, d}, torch::kFloat32);
  cache_format(k, k_scale, v_scale, "prefill_attention", a);
  a.q = qf.data_ptr<float>();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.b = b, a.t = t, a.hq = hq, a.hkv = hkv, a.d = d, a.kb = k.stride(0), a.ks = k.stride(1), a.kh = k.stride(2);
  a.context = context, a.window = window, a.q_bf16 = q.scalar_type() == torch::kBFloat16;
  a.scale = static_cast<float>(scale);
  a.out = out.data_ptr<float>();
  cpk::prefill_attention(variant, torch_parallel(), a);
  return q.scalar_type() == torch::kFloat32 ? out : out.to(q.scalar_type());
}

// The sampler's logprobs for the rows that ask: each row's chosen-token logprob, its rank (1 = most
// likely) and its k most likely tokens, in one pass over the raw logits after a vectorized logsumexp
// (ATen's). Rank and order are the logits' own (log_softmax subtracts one constant per row). The
// top-k is a min-heap of k: most elements fail one compare against its root. Ties go to the lower
// token id. Reference twin: cpuserve/model/ops.py token_logprobs_reference.
std::vector<torch::Tensor> token_logprobs(torch::Tensor logits, torch::Tensor chosen, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32, "logits: [N, V] float32");
  TORCH_CHECK(chosen.dim() == 1 && chosen.size(0) == logits.size(0) && chosen.scalar_type() == torch::kInt64,
              "chosen: [N] int64, one per row");
  logits = logits.contiguous();
  chosen = chosen.contiguous();
  const int64_t n = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(k >= 0 && k <= vocab, "k must be in [0, V]");
  const auto lse = at::logsumexp(logits, {1}).contiguous();
  auto chosen_lp = torch::empty({n}, logits.options());
  auto ranks = torch::empty({n}, chosen.options());
  auto top_ids = torch::empty({n, k}, chosen.options());
  auto top_lp = torch::empty({n, k}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* ch = chosen.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(ch[r] >= 0 && ch[r] < vocab, "chosen token out of range");
  }
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {  // a few rows: no thread hand-off
    std::vector<std::pair<float, int64_t>> heap;
    // "a before b" in the top-k order: larger value, then lower id. The heap keeps its worst on top.
    auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * vocab;
      const float c = row[ch[r]];
      int64_t above = 0;
      for (int64_t i = 0; i < vocab; ++i) above += row[i] > c;
      heap.clear();
      if (k > 0) {
        for (int64_t i = 0; i < k; ++i) heap.emplace_back(row[i], i);
        std::make_heap(heap.begin(), heap.end(), better);
        float worst = heap.front().first;
        for (int64_t i = k; i < vocab; ++i) {
          // Ids rise through the row, so an equal value never beats the heap's worst (tie: lower id).
          if (!(row[i] > worst)) continue;
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = {row[i], i};
          std::push_heap(heap.begin(), heap.end(), better);
          worst = heap.front().first;
        }
        std::sort_heap(heap.begin(), heap.end(), better);
      }
      const float l = lse.data_ptr<float>()[r];
      chosen_lp.data_ptr<float>()[r] = c - l;
      ranks.data_ptr<int64_t>()[r] = above + 1;
      for (int64_t j = 0; j < k; ++j) {
        top_ids.data_ptr<int64_t>()[r * k + j] = heap[j].second;
        top_lp.data_ptr<float>()[r * k + j] = heap[j].first - l;
      }
    }
  });
  return {chosen_lp, ranks, top_ids, top_lp};
}

void register_layer_ops(pybind11::module& mod) {
  // The GIL is let go while an op runs (no Python inside), so other threads are not held up.
  using nogil = pybind11::call_guard<pybind11::gil_scoped_release>;
  namespace py = pybind11;
  mod.def("rms_norm", &rms_norm, nogil(), "RMSNorm over the last dimension (unit_offset: Gemma's x * (1 + w))",
          py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("variant"), py::arg("unit_offset") = false);
  mod.def("add_rms_norm", &add_rms_norm, nogil(), "residual add (scaled) fused with the next RMSNorm: {sum, normed}",
          py::arg("h"), py::arg("delta"), py::arg("scale"), py::arg("weight"), py::arg("eps"), py::arg("variant"),
          py::arg("unit_offset") = false);
  mod.def("rope_", &rope_, nogil(), "rotary embedding in place, rotate-half layout");
  mod.def("silu_mul", &silu_mul, nogil(), "silu(gate) * up");
  mod.def("gelu_tanh_mul", &gelu_tanh_mul, nogil(), "gelu(gate) * up, gelu's tanh approximation");
  mod.def("decode_attention", &decode_attention, nogil(),
          "one query per sequence over the contiguous or paged KV cache (int8 with its row scales, or float)",
          pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("slots"), pybind11::arg("lengths"),
          pybind11::arg("scale"), pybind11::arg("variant"), pybind11::arg("k_scale") = pybind11::none(),
          pybind11::arg("v_scale") = pybind11::none());
  mod.def("prefill_attention", &prefill_attention, nogil(),
          "new tokens against every key they see (causal, optional sliding window) over the contiguous or paged KV "
          "cache (int8 with its row scales, or float)",
          pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("slots"), pybind11::arg("context"),
          pybind11::arg("window"), pybind11::arg("scale"), pybind11::arg("variant"),
          pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  mod.def("token_logprobs", &token_logprobs, nogil(),
          "per row: chosen token's logprob, its rank, the top-k ids and logprobs {chosen_lp, rank, ids, lps}");
}
