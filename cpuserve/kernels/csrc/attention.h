// Decode attention without torch: one query token per sequence against its cached keys/values,
// softmax in fp32. The portable loops below are the scalar twin; each variant's row points at them
// compiled for its ISA (CPK_PORTABLE_ATTENTION) or at its own kernel (attention_blocks.h, instanced
// by arch/x86/attention_avx512.cpp, arch/x86/attention_avx2.cpp and arch/arm/attention_neon.cpp).
// Loops are written with independent partial sums so the compiler vectorizes them without
// reassociating float adds (-ffp-contract=off, no fast-math): the same floats at every ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "float_types.h"
#include "parallel.h"

namespace cpk {

// Sequence s reads positions 0 .. lengths[s]-1: without slots, from batch s of the cache; with
// slots [N, slot_stride], from batch 0 at slots[s, l] (the paged cache). Strides in elements.
// An int8 cache (k_scale set) holds each (position, KV head) row as int8 values times one fp32
// scale: k_scale[(slots ? 0 : s * sb) + position * ss + head * sh], v_scale alike.
struct AttentionArgs {
  const float* q;  // [N, Hq, D] fp32
  const void* k;   // [B, S, Hkv, D] in dtype (int8 when k_scale is set), D contiguous
  const void* v;
  DType dtype;
  const float* k_scale;  // [B, S, Hkv] for an int8 cache, else null
  const float* v_scale;
  int64_t sb, ss, sh;
  const int64_t* lengths;
  const int64_t* slots;
  int64_t slot_stride, n, hq, hkv, d, kb, ks, kh, longest;
  float scale;
  float* out;  // [N, Hq, D] fp32
};

template <typename T>
constexpr bool kInt8Cache = std::is_same<T, int8_t>::value;

// The scale of row (seq, position, head) of an int8 cache (1 for a float one: rows are read as stored).
template <typename T>
inline float row_scale(const float* scales, const AttentionArgs& a, int64_t seq, int64_t pos, int64_t head) {
  if constexpr (kInt8Cache<T>) return scales[(a.slots ? 0 : seq * a.sb) + pos * a.ss + head * a.sh];
  return 1.f;
}

constexpr int kDotLanes = 16;  // one AVX-512 vector, two AVX2 vectors

template <typename T>
inline float dot_lanes(const float* q, const T* k, int64_t d) {
  float part[kDotLanes] = {0.f};
  int64_t i = 0;
  for (; i + kDotLanes <= d; i += kDotLanes)
    for (int j = 0; j < kDotLanes; ++j) part[j] += q[i + j] * to_float(k[i + j]);
  for (int w = kDotLanes / 2; w > 0; w /= 2)  // a tree, not a chain of 16 dependent adds
    for (int j = 0; j < w; ++j) part[j] += part[j + w];
  float total = part[0];
  for (; i < d; ++i) total += q[i] * to_float(k[i]);
  return total;
}

// x[0..n) replaced by its softmax (the portable loops' exact two passes). Always inlined, as the
// loops that call it, so each ISA's copy is its own.
__attribute__((always_inline)) inline void softmax_in_place(float* x, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) top = std::max(top, x[l]);
  float total = 0.f;
  for (int64_t l = 0; l < n; ++l) {
    x[l] = std::exp(x[l] - top);
    total += x[l];
  }
  const float inv = 1.f / total;
  for (int64_t l = 0; l < n; ++l) x[l] *= inv;
}

// Jobs [begin, end) of (sequence, KV head). Always inlined into each ISA's copy, so its loops are
// compiled for that ISA.
template <typename T>
__attribute__((always_inline)) inline void attention_jobs(const AttentionArgs& a, int64_t begin, int64_t end) {
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
      const int64_t pos = slot ? slot[l] : l;
      const T* key = kp + base + pos * a.ks;
      if constexpr (kInt8Cache<T>) {
        const float s = row_scale<T>(a.k_scale, a, seq, pos, head);
        for (int64_t i = 0; i < d; ++i) row[i] = to_float(key[i]) * s;
      } else {
        for (int64_t i = 0; i < d; ++i) row[i] = to_float(key[i]);
      }
      for (int64_t g = 0; g < group; ++g) scores[g * a.longest + l] = dot_lanes(qs + g * d, row.data(), d) * a.scale;
    }
    for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * a.longest, length);
    float* o = a.out + (seq * a.hq + head * group) * d;
    for (int64_t i = 0; i < group * d; ++i) o[i] = 0.f;
    for (int64_t l = 0; l < length; ++l) {  // each value row converted once, added to every head's output
      const int64_t pos = slot ? slot[l] : l;
      const T* value = vp + base + pos * a.ks;
      if constexpr (kInt8Cache<T>) {
        const float s = row_scale<T>(a.v_scale, a, seq, pos, head);
        for (int64_t i = 0; i < d; ++i) row[i] = to_float(value[i]) * s;
      } else {
        for (int64_t i = 0; i < d; ++i) row[i] = to_float(value[i]);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * a.longest + l];
        float* og = o + g * d;
        for (int64_t i = 0; i < d; ++i) og[i] += p * row[i];
      }
    }
  }
}

// A variant's copy of the portable loops: NAME(args, parallel), compiled with ATTR (a target
// attribute, or nothing for the baseline).
#define CPK_PORTABLE_ATTENTION(NAME, ATTR)                                                                    \
  ATTR static void NAME##_f32(const AttentionArgs& a, int64_t b, int64_t e) { attention_jobs<float>(a, b, e); } \
  ATTR static void NAME##_bf16(const AttentionArgs& a, int64_t b, int64_t e) { attention_jobs<Bf16>(a, b, e); } \
  ATTR static void NAME##_f16(const AttentionArgs& a, int64_t b, int64_t e) { attention_jobs<F16>(a, b, e); }   \
  ATTR static void NAME##_i8(const AttentionArgs& a, int64_t b, int64_t e) { attention_jobs<int8_t>(a, b, e); } \
  void NAME(const AttentionArgs& a, const Parallel& par) {                                                    \
    auto jobs = a.k_scale            ? NAME##_i8                                                              \
                : a.dtype == DType::F32  ? NAME##_f32                                                         \
                : a.dtype == DType::Bf16 ? NAME##_bf16                                                        \
                                         : NAME##_f16;                                                        \
    par.for_range(0, a.n * a.hkv, 1, [&](int64_t begin, int64_t end) { jobs(a, begin, end); });               \
  }

}  // namespace cpk
