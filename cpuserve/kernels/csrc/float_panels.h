// The float panel layout of unquantized weights and its scalar twin. torch's generic matmul is slow
// where it matters most on CPUs without native 16-bit dot products (AVX2: a bf16 linear of 16 rows
// ran at ~1 GB/s of weights, docs/benchmarks.md), and an fp32 copy of a bf16 checkpoint doubles the
// bytes every decode step reads. So the weights stay in their own 16-bit type (or fp32) and are
// widened in registers; activations and sums are fp32.
//
// Panel p holds columns [16p, 16p + 16) of a weight [N, K] as K steps of 16 values (step k: the 16
// columns' input k), columns past N zero: one panel is one contiguous stream for a decode step, and
// a step is one (AVX-512), two (AVX2) or four (NEON) fp32 vectors once widened. [panels, K, 16].
#pragma once

#include <cstdint>

#include "float_types.h"
#include "panel_layout.h"
#include "variant.h"

namespace cpk {

inline int64_t float_panel_elements(int64_t n, int64_t k) { return panel_count(n) * k * kPanel; }

// Panel p of src [N, K] (row-major) into dst (the whole [panels, K, 16] buffer).
template <typename E>
void pack_float_panel(const E* src, int64_t n, int64_t k, int64_t p, E* dst) {
  E* panel = dst + p * k * kPanel;
  const int64_t width = panel_width(n, p), c0 = p * kPanel;
  for (int64_t j = 0; j < k; ++j)
    for (int64_t c = 0; c < kPanel; ++c) panel[j * kPanel + c] = c < width ? src[(c0 + c) * k + j] : E{};
}

// The twin: each output one fp32 sum over k in order, products rounded before each add (no fused
// multiply-add: -ffp-contract=off). Panels [p0, p1).
template <typename E>
void float_panels_twin_of(const FloatArgs& a, int64_t p0, int64_t p1) {
  const E* w = static_cast<const E*>(a.w);
  for (int64_t p = p0; p < p1; ++p) {
    const E* panel = w + p * a.k * kPanel;
    const int64_t width = panel_width(a.n, p);
    for (int64_t r = 0; r < a.m; ++r)
      for (int64_t c = 0; c < width; ++c) {
        float sum = 0.f;
        for (int64_t j = 0; j < a.k; ++j) sum += a.x[r * a.k + j] * to_float(panel[j * kPanel + c]);
        a.out[r * a.n + p * kPanel + c] = sum;
      }
  }
}

inline void float_panels_twin(const FloatArgs& a, int64_t p0, int64_t p1) {
  if (a.wtype == DType::F32) return float_panels_twin_of<float>(a, p0, p1);
  if (a.wtype == DType::Bf16) return float_panels_twin_of<Bf16>(a, p0, p1);
  float_panels_twin_of<F16>(a, p0, p1);
}

}  // namespace cpk
