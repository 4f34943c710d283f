// Native W8A8 / W4A8 linear kernels: per-token int8 activations times int8 or int4 weights.
//
// Each inner product has a scalar "generic" twin; SIMD variants (AVX2, AVX-512 VNNI) are compiled
// with function-level target attributes and chosen at run time by name. The integer accumulation is
// exact in every variant; W8A8's float epilogue is shared (bit-identical across variants), W4A8's
// SIMD variants sum the per-group products in vector lanes (equal to the twin within float rounding). Work is split over output channels with at::parallel_for: torch's own
// (pinned) thread pool, no second runtime.
//
// Int4 layout (repacked at load): per row, per 32-element block, 16 bytes; byte j holds
// w[k0 + j] + 8 in its low nibble and w[k0 + 16 + j] + 8 in its high nibble. The dot product uses the
// unsigned nibbles directly (u8 x s8 multiply-add) and subtracts 8 * sum(activations of the group),
// which the activation quantizer computes once per token and group.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using DotI8 = int32_t (*)(const int8_t*, const int8_t*, int64_t);

// ---------------------------------------------------------------- generic (scalar) twins
int32_t dot_i8_generic(const int8_t* a, const int8_t* w, int64_t k) {
  int32_t acc = 0;
  for (int64_t i = 0; i < k; ++i) acc += int32_t(a[i]) * int32_t(w[i]);
  return acc;
}

// sum over one group of len values (len a multiple of 32) of (nibble) * a; nibbles unsigned 0..15.
int32_t dot_u4_generic(const int8_t* a, const uint8_t* w, int64_t len) {
  int32_t acc = 0;
  for (int64_t b = 0; b < len / 32; ++b) {
    const uint8_t* wb = w + b * 16;
    const int8_t* ab = a + b * 32;
    for (int j = 0; j < 16; ++j) {
      acc += int32_t(wb[j] & 0x0F) * int32_t(ab[j]);
      acc += int32_t(wb[j] >> 4) * int32_t(ab[16 + j]);
    }
  }
  return acc;
}

#if defined(__x86_64__)
// ---------------------------------------------------------------- AVX2
__attribute__((target("avx2,fma"))) inline int32_t hsum_i32_avx2(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

__attribute__((target("avx2,fma"))) int32_t dot_i8_avx2(const int8_t* a, const int8_t* w, int64_t k) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i));
    __m256i vw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i));
    // |w| (unsigned) x (a with w's sign): maddubs cannot saturate because |a| <= 127.
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(vw, vw), _mm256_sign_epi8(va, vw));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  int32_t total = hsum_i32_avx2(acc);
  for (; i < k; ++i) total += int32_t(a[i]) * int32_t(w[i]);
  return total;
}

// ---------------------------------------------------------------- AVX-512 VNNI
#define VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"
__attribute__((target(VNNI_TARGET))) int32_t dot_i8_vnni(const int8_t* a, const int8_t* w, int64_t k) {
  __m512i acc = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    __m512i va = _mm512_loadu_si512(a + i);
    __m512i vw = _mm512_loadu_si512(w + i);
    __mmask64 neg = _mm512_movepi8_mask(vw);
    __m512i aw = _mm512_abs_epi8(vw);
    __m512i sa = _mm512_mask_sub_epi8(va, neg, _mm512_setzero_si512(), va);
    acc = _mm512_dpbusd_epi32(acc, aw, sa);
  }
  int32_t total = _mm512_reduce_add_epi32(acc);
  for (; i < k; ++i) total += int32_t(a[i]) * int32_t(w[i]);
  return total;
}

#endif

// One output of W4A8 before the -8 correction and the activation scale: sum_g s_g * dot_g(u, a).
using RowU4 = float (*)(const int8_t*, const uint8_t*, const float*, int64_t, int64_t);

float row_u4_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  float y = 0.f;
  for (int64_t g = 0; g < groups; ++g) y += float(dot_u4_generic(a + g * group, w + g * group / 2, group)) * s[g];
  return y;
}

#if defined(__x86_64__)
// Per group: integer multiply-adds into one vector, converted and FMA'd with the group scale into a
// float vector; a single horizontal sum per output.
__attribute__((target("avx2,fma"))) float row_u4_avx2(const int8_t* a, const uint8_t* w, const float* s,
                                                      int64_t groups, int64_t group) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i low = _mm_set1_epi8(0x0F);
  __m256 facc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc = _mm256_setzero_si256();
    const uint8_t* wg = w + g * group / 2;
    const int8_t* ag = a + g * group;
    for (int64_t b = 0; b < group / 32; ++b) {
      __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + b * 16));
      __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low), _mm_and_si128(packed, low));
      __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ag + b * 32));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, va), ones));
    }
    facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(s[g]), facc);
  }
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(facc), _mm256_extractf128_ps(facc, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

__attribute__((target(VNNI_TARGET))) float row_u4_vnni(const int8_t* a, const uint8_t* w, const float* s,
                                                       int64_t groups, int64_t group) {
  if (group % 64) return row_u4_avx2(a, w, s, groups, group);
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m512 facc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc = _mm512_setzero_si512();
    const uint8_t* wg = w + g * group / 2;
    const int8_t* ag = a + g * group;
    for (int64_t b = 0; b < group / 32; b += 2) {
      __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + b * 16));
      __m256i lo = _mm256_and_si256(packed, low);
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                     _mm256_permute2x128_si256(lo, hi, 0x31), 1);
      acc = _mm512_dpbusd_epi32(acc, u, _mm512_loadu_si512(ag + b * 32));
    }
    facc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(s[g]), facc);
  }
  return _mm512_reduce_add_ps(facc);
}
#endif

struct Variant {
  DotI8 dot_i8;
  RowU4 row_u4;
};

Variant variant_by_name(const std::string& name) {
  if (name == "generic") return {dot_i8_generic, row_u4_generic};
#if defined(__x86_64__)
  if (name == "avx2") return {dot_i8_avx2, row_u4_avx2};
  if (name == "avx512_vnni") return {dot_i8_vnni, row_u4_vnni};
#endif
  TORCH_CHECK(false, "cpuserve kernels: unknown or unsupported variant '", name, "'");
}

// ---------------------------------------------------------------- activation quantization
// Per token: s = max(amax, 1e-8) / 127, q = round-half-even(x / s) in [-127, 127]; group sums.
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t group, int8_t* q, float* scales, int32_t* sums) {
  const int64_t groups = group > 0 ? k / group : 0;
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * k;
      float amax = 0.f;
      for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(xr[i]));
      const float s = std::fmax(amax, 1e-8f) / 127.0f;
      scales[r] = s;
      int8_t* qr = q + r * k;
      for (int64_t i = 0; i < k; ++i) {
        float v = std::nearbyint(xr[i] / s);
        qr[i] = int8_t(std::fmin(127.f, std::fmax(-127.f, v)));
      }
      for (int64_t g = 0; g < groups; ++g) {
        int32_t total = 0;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) total += qr[i];
        sums[r * groups + g] = total;
      }
    }
  });
}

torch::Tensor finish(torch::Tensor out, const c10::optional<torch::Tensor>& bias, c10::ScalarType dtype) {
  if (bias.has_value()) out.add_(bias->to(torch::kFloat32));
  return dtype == torch::kFloat32 ? out : out.to(dtype);
}

}  // namespace

// x [M, K] (fp32 or bf16), qweight int8 [N, K], scales fp32 [N]: out [M, N] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant) {
  const Variant v = variant_by_name(variant);
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), n = qweight.size(0);
  TORCH_CHECK(qweight.size(1) == k && qweight.scalar_type() == torch::kInt8, "w8a8_linear: bad weight");
  auto q = torch::empty({m, k}, torch::kInt8);
  auto sa = torch::empty({m}, torch::kFloat32);
  quantize_rows(xf.data_ptr<float>(), m, k, 0, q.data_ptr<int8_t>(), sa.data_ptr<float>(), nullptr);
  auto out = torch::empty({m, n}, torch::kFloat32);
  const int8_t* qa = q.data_ptr<int8_t>();
  const int8_t* qw = qweight.data_ptr<int8_t>();
  const float* sw = scales.data_ptr<float>();
  const float* sap = sa.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      for (int64_t r = 0; r < m; ++r) {
        const int32_t acc = v.dot_i8(qa + r * k, qw + c * k, k);
        o[r * n + c] = (float(acc) * sw[c]) * sap[r];
      }
    }
  });
  return finish(out, bias, x.scalar_type());
}

// x [M, K], packed uint8 [N, K / 2] (layout above), scales fp32 [N, G]: out [M, N] in x's dtype.
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant) {
  const Variant v = variant_by_name(variant);
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), n = packed.size(0), groups = scales.size(1);
  const int64_t group = k / groups;
  TORCH_CHECK(packed.size(1) * 2 == k && group % 32 == 0 && groups * group == k, "w4a8_linear: bad shapes");
  auto q = torch::empty({m, k}, torch::kInt8);
  auto sa = torch::empty({m}, torch::kFloat32);
  auto sums = torch::empty({m, groups}, torch::kInt32);
  quantize_rows(xf.data_ptr<float>(), m, k, group, q.data_ptr<int8_t>(), sa.data_ptr<float>(),
                sums.data_ptr<int32_t>());
  auto out = torch::empty({m, n}, torch::kFloat32);
  const int8_t* qa = q.data_ptr<int8_t>();
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const float* sw = scales.data_ptr<float>();
  const float* sap = sa.data_ptr<float>();
  const int32_t* gs = sums.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const uint8_t* row = pw + c * (k / 2);
      const float* srow = sw + c * groups;
      for (int64_t r = 0; r < m; ++r) {
        // sum_g s_g * (dot_g(u, a) - 8 * sum_g(a)): the correction is a short scalar dot product.
        float correction = 0.f;
        for (int64_t g = 0; g < groups; ++g) correction += srow[g] * float(gs[r * groups + g]);
        o[r * n + c] = (v.row_u4(qa + r * k, row, srow, groups, group) - 8.f * correction) * sap[r];
      }
    }
  });
  return finish(out, bias, x.scalar_type());
}

// int8 values in [-8, 7], [N, K] -> the nibble layout above, uint8 [N, K / 2].
torch::Tensor pack_int4(torch::Tensor q) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % 32 == 0, "pack_int4: K must be a multiple of 32");
  auto out = torch::empty({n, k / 2}, torch::kUInt8);
  const int8_t* src = q.contiguous().data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < k / 32; ++b)
        for (int j = 0; j < 16; ++j) {
          const uint8_t lo = uint8_t(src[r * k + b * 32 + j] + 8), hi = uint8_t(src[r * k + b * 32 + 16 + j] + 8);
          dst[r * (k / 2) + b * 16 + j] = uint8_t(lo | (hi << 4));
        }
  });
  return out;
}

// compressed-tensors pack-quantized int4 (int32 words; word j holds k = 8j..8j+7, value + 8 at bits
// 4i) -> the nibble layout above, without an int8 intermediate.
torch::Tensor words_to_nibbles(torch::Tensor words, int64_t k) {
  const int64_t n = words.size(0), w = words.size(1);
  TORCH_CHECK(k % 32 == 0 && w * 8 >= k, "words_to_nibbles: K must be a multiple of 32 and fit the words");
  auto src_t = words.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(src_t.data_ptr<int32_t>());
  auto out = torch::empty({n, k / 2}, torch::kUInt8);
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t* row = src + r * w;
      auto nibble = [&](int64_t i) { return uint8_t((row[i / 8] >> (4 * (i % 8))) & 0x0F); };
      for (int64_t b = 0; b < k / 32; ++b)
        for (int j = 0; j < 16; ++j)
          dst[r * (k / 2) + b * 16 + j] = uint8_t(nibble(b * 32 + j) | (nibble(b * 32 + 16 + j) << 4));
    }
  });
  return out;
}

std::vector<std::string> variants() {
  std::vector<std::string> names{"generic"};
#if defined(__x86_64__)
  names.push_back("avx2");
  names.push_back("avx512_vnni");
#endif
  return names;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("w8a8_linear", &w8a8_linear, "W8A8 channel-wise linear");
  mod.def("w4a8_linear", &w4a8_linear, "W4A8 group-wise linear");
  mod.def("pack_int4", &pack_int4, "repack int4 values into the kernel's nibble layout");
  mod.def("words_to_nibbles", &words_to_nibbles, "pack-quantized int32 words -> the kernel's nibble layout");
  mod.def("variants", &variants, "variants compiled in (the CPU decides which can run)");
}
