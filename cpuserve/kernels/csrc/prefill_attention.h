// Prefill attention without torch: a block of new tokens (a prompt, or one chunk of it) against
// every key it sees in the contiguous or paged KV cache, read where it is stored; causal, with an
// optional sliding window; softmax in fp32. The portable loops below are the scalar twin (one
// query at a time, the exact two-pass softmax); each variant's row points at them compiled for its
// ISA (CPK_PORTABLE_PREFILL) or at the flash-style query and key blocks of prefill_blocks.h.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention.h"
#include "float_types.h"
#include "parallel.h"

namespace cpk {

// B sequences of T new tokens each, every one with `context` keys (the T new ones last). Key l of
// sequence b, KV head h is element b * kb + position(l) * ks + h * kh of k (and v), D contiguous,
// position(l) = slots ? slots[l] : l (slots: the paged cache, B == 1). Query i is key
// offset + i (offset = context - T) and sees keys lo(i) .. offset + i, lo(i) = 0 without a window,
// else max(0, offset + i - window + 1). An int8 cache (k_scale set) holds each (position, head) row
// as int8 values times k_scale[b * sb + position * ss + h * sh] (v_scale alike).
struct PrefillArgs {
  const float* q;  // [B, T, Hq, D] fp32, contiguous
  const void* k;
  const void* v;
  DType dtype;
  const float* k_scale;
  const float* v_scale;
  int64_t sb, ss, sh;
  const int64_t* slots;
  int64_t b, t, hq, hkv, d, kb, ks, kh;
  int64_t context, window;  // window 0: none
  float scale;
  float* out;  // [B, T, Hq, D] fp32
  bool q_bf16 = false;  // the queries are bf16 values (widened): a bf16 kernel may take them as they were
};

// The first and last key query i sees.
inline int64_t prefill_first_key(const PrefillArgs& a, int64_t i) {
  const int64_t last = a.context - a.t + i;
  return a.window > 0 ? std::max<int64_t>(0, last - a.window + 1) : 0;
}
inline int64_t prefill_last_key(const PrefillArgs& a, int64_t i) { return a.context - a.t + i; }

// Pointer to key or value l of (sequence, head) and its int8 row scale (1 for a float cache).
template <typename T>
inline const T* prefill_row(const PrefillArgs& a, const void* base, int64_t seq, int64_t head, int64_t l) {
  const int64_t pos = a.slots ? a.slots[l] : l;
  return static_cast<const T*>(base) + seq * a.kb + pos * a.ks + head * a.kh;
}
template <typename T>
inline float prefill_scale(const PrefillArgs& a, const float* scales, int64_t seq, int64_t head, int64_t l) {
  if constexpr (kInt8Cache<T>) return scales[seq * a.sb + (a.slots ? a.slots[l] : l) * a.ss + head * a.sh];
  return 1.f;
}

// Jobs [begin, end) of (sequence, query, KV head): every query head of the group, exactly.
template <typename T>
__attribute__((always_inline)) inline void prefill_jobs(const PrefillArgs& a, int64_t begin, int64_t end) {
  const int64_t group = a.hq / a.hkv, d = a.d;
  std::vector<float> scores(static_cast<size_t>(group * a.context)), row(static_cast<size_t>(d));
  for (int64_t job = begin; job < end; ++job) {
    const int64_t head = job % a.hkv, i = (job / a.hkv) % a.t, seq = job / (a.hkv * a.t);
    const int64_t lo = prefill_first_key(a, i), hi = prefill_last_key(a, i), count = hi - lo + 1;
    const float* qs = a.q + ((seq * a.t + i) * a.hq + head * group) * d;
    for (int64_t l = lo; l <= hi; ++l) {  // each key row converted once for the heads that share it
      const T* key = prefill_row<T>(a, a.k, seq, head, l);
      const float s = prefill_scale<T>(a, a.k_scale, seq, head, l);
      for (int64_t x = 0; x < d; ++x) row[x] = to_float(key[x]) * s;
      for (int64_t g = 0; g < group; ++g) scores[g * count + l - lo] = dot_lanes(qs + g * d, row.data(), d) * a.scale;
    }
    for (int64_t g = 0; g < group; ++g) softmax_in_place(scores.data() + g * count, count);
    float* o = a.out + ((seq * a.t + i) * a.hq + head * group) * d;
    for (int64_t x = 0; x < group * d; ++x) o[x] = 0.f;
    for (int64_t l = lo; l <= hi; ++l) {  // each value row converted once, added to every head's output
      const T* value = prefill_row<T>(a, a.v, seq, head, l);
      const float s = prefill_scale<T>(a, a.v_scale, seq, head, l);
      for (int64_t x = 0; x < d; ++x) row[x] = to_float(value[x]) * s;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * count + l - lo];
        float* og = o + g * d;
        for (int64_t x = 0; x < d; ++x) og[x] += p * row[x];
      }
    }
  }
}

// A variant's copy of the portable loops: NAME(args, parallel), compiled with ATTR.
#define CPK_PORTABLE_PREFILL(NAME, ATTR)                                                                         \
  ATTR static void NAME##_f32(const PrefillArgs& a, int64_t b, int64_t e) { prefill_jobs<float>(a, b, e); }     \
  ATTR static void NAME##_bf16(const PrefillArgs& a, int64_t b, int64_t e) { prefill_jobs<Bf16>(a, b, e); }     \
  ATTR static void NAME##_f16(const PrefillArgs& a, int64_t b, int64_t e) { prefill_jobs<F16>(a, b, e); }       \
  ATTR static void NAME##_i8(const PrefillArgs& a, int64_t b, int64_t e) { prefill_jobs<int8_t>(a, b, e); }     \
  void NAME(const PrefillArgs& a, const Parallel& par) {                                                       \
    auto jobs = a.k_scale                ? NAME##_i8                                                           \
                : a.dtype == DType::F32  ? NAME##_f32                                                          \
                : a.dtype == DType::Bf16 ? NAME##_bf16                                                         \
                                         : NAME##_f16;                                                         \
    par.for_range(0, a.b * a.t * a.hkv, 1, [&](int64_t begin, int64_t end) { jobs(a, begin, end); });          \
  }

}  // namespace cpk
