// The scalar twin of the panel layout (panel_layout.h): the panel kernels' own arithmetic, one
// output at a time, read from the same panel bytes. Integer sums start at the offset correction as
// the SIMD accumulators do (-128 * sum(a) for offset int8, -8 * sum(group) for offset nibbles);
// W4A8 folds each group's int32 into the output with one fused multiply-add in group order, the
// vector lanes' fmadd. So every panel variant is bit-identical to this twin, W4A8 included.
#pragma once

#include <cmath>
#include <cstdint>

#include "panel_layout.h"
#include "variant.h"

namespace cpk {

// W8A8 panels [p0, p1); Offset: uint8 w + 128 (sums: per-token per-group sums), else int8 w. One
// group: (float(dot) * sw[c]) * sa[r]; groups: each group's int32 folded in with one fma in group
// order (scales in panel order), as the grouped SIMD blocks do.
template <bool Offset>
inline void w8a8_panels_twin(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  const int64_t k = a.k, kq = quad_k(k), n = a.n, groups = a.groups;
  const int64_t quads = groups == 1 ? kq / kInt8StepInputs : k / groups / kInt8StepInputs;  // per group
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t width = panel_width(n, p), c0 = p * kPanel;
    const float* sp = a.sw + c0 * groups;
    for (int64_t r = 0; r < a.m; ++r) {
      const int8_t* x = a.qa + r * k;
      for (int64_t c = 0; c < width; ++c) {
        float y = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t acc = Offset ? -128 * a.sums[r * groups + g] : 0;
          for (int64_t j = g * quads; j < (g + 1) * quads; ++j) {
            const uint8_t* step = panel_step(w, kq, n, p, j) + 4 * c;
            for (int64_t i = 0; i < 4 && 4 * j + i < k; ++i)  // padded weights are 0: nothing to add
              acc += (Offset ? int32_t(step[i]) : int32_t(int8_t(step[i]))) * int32_t(x[4 * j + i]);
          }
          if (groups == 1)
            y = float(acc) * sp[c];
          else
            y = std::fma(float(acc), a.sa_groups ? sp[g * width + c] * a.sa[r * groups + g] : sp[g * width + c], y);
        }
        a.out[r * n + c0 + c] = a.sa_groups && groups > 1 ? y : y * a.sa[r];
      }
    }
  }
}

// W4A8 panels [p0, p1): offset nibbles, scales in panel order, group sums [M, groups].
inline void w4a8_panels_twin(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  const int64_t k = a.k, n = a.n, groups = a.groups, steps = k / groups / kInt4StepInputs;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t width = panel_width(n, p), c0 = p * kPanel;
    const float* sp = a.sw + c0 * groups;
    for (int64_t r = 0; r < a.m; ++r) {
      const int8_t* x = a.qa + r * k;
      for (int64_t c = 0; c < width; ++c) {
        float y = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          int32_t acc = -8 * a.sums[r * groups + g];
          for (int64_t j = g * steps; j < (g + 1) * steps; ++j) {
            const uint8_t* step = panel_step(w, k / 2, n, p, j) + 4 * c;
            for (int64_t i = 0; i < 4; ++i)
              acc += int32_t(step[i] & 0x0F) * x[8 * j + i] + int32_t(step[i] >> 4) * x[8 * j + 4 + i];
          }
          y = std::fma(float(acc), a.sa_groups ? sp[g * width + c] * a.sa[r * groups + g] : sp[g * width + c], y);
        }
        a.out[r * n + c0 + c] = a.sa_groups ? y : y * a.sa[r];
      }
    }
  }
}

}  // namespace cpk
