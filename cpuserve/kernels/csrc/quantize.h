// Per-token activation quantization, the scalar twin: s = max(amax, 1e-8) / 127,
// q = round-half-even(x / s) in [-127, 127] (NaN -> -127); per-group sums (group 0: none). Each
// variant's quantize_row gives the same bytes (IEEE division and round-to-nearest-even are exact
// operations; max ignores NaN the way fmax does), checked against this one by kernel_check. Without
// the SIMD copies the twin's nearbyint (a libm call at the baseline ISA) cost ~4 ns per value: ~20%
// of a 2B prefill.
#pragma once

#include <cmath>
#include <cstdint>

namespace cpk {

inline void group_sums(const int8_t* q, int64_t k, int64_t group, int32_t* sums) {
  if (group <= 0) return;
  for (int64_t g = 0; g < k / group; ++g) {
    int32_t total = 0;
    for (int64_t i = g * group; i < (g + 1) * group; ++i) total += q[i];
    sums[g] = total;
  }
}

// The scalar tail every SIMD copy shares: the same expression as the twin's loop.
inline int8_t quantize_value(float x, float s) { return int8_t(std::fmin(127.f, std::fmax(-127.f, std::nearbyint(x / s)))); }

inline void quantize_row_generic(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  for (int64_t i = 0; i < k; ++i) q[i] = quantize_value(x[i], s);
  group_sums(q, k, group, sums);
}

}  // namespace cpk
