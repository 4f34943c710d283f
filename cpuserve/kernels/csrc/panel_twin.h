// The scalar twin of the panel layout (panel_layout.h): the panel kernels' own arithmetic, one
// output at a time, read from the same panel bytes. Integer sums start at the offset correction as
// the SIMD accumulators do (-128 * sum(a) for offset int8, -8 * sum(group) for offset nibbles, -32
// for int6);
// W4A8 folds each group's int32 into the output with one fused multiply-add in group order, the
// vector lanes' fmadd. So every panel variant is bit-identical to this twin, W4A8 included.
#pragma once

#include <cmath>
#include <cstdint>

#include "linear_driver.h"
#include "panel_layout.h"
#include "scale_codes.h"
#include "variant.h"

namespace cpk {

// The integer fold (LinearArgs::sa_per: a K-quant's integer codes, read where they are stored,
// activations scaled per super-block): output column c of panel p for token r. dot(g): group g's
// exact sum of the stored weight bytes times the activations; layout_offset: what those bytes add
// to each weight (128, 8, 32 for int6, or 0), replaced by the fold's mid. Per super-block b, in int32 (in range:
// GroupScales::fold_per), I = sum_g code_g * acc_g and M = sum_g ocode_g * gsum_g; then
// t = float(I) * S_b, t = fma(float(M), O_b, t), y = fma(t, sa_b, y): the SIMD lanes' operations.
template <typename Dot>
inline float fold_output(const LinearArgs& a, int64_t p, int64_t width, int64_t c, int64_t r, int32_t layout_offset,
                         const Dot& dot) {
  const GroupScales& gs = *a.direct;
  const scale_codes::PanelAt at = scale_codes::panel_at(gs, a.groups, p);
  const bool offsets = gs.offsets.values != nullptr;
  const int32_t lift = gs.fold_mid() - layout_offset;
  const int64_t per = a.sa_per, blocks = a.groups / per;
  const int32_t* sums = a.sums + r * a.groups;
  float y = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t total = 0, mins = 0;
    for (int64_t g = b * per; g < (b + 1) * per; ++g) {
      total += scale_codes::int_code(gs.scales, at.values + g * width + c) * (dot(g) + lift * sums[g]);
      if (offsets) mins += scale_codes::int_code(gs.offsets, at.values + g * width + c) * sums[g];
    }
    float t = float(total) * gs.scales.super_at(at.scale_supers + b * width + c);
    if (offsets) t = std::fma(float(mins), gs.offsets.super_at(at.offset_supers + b * width + c), t);
    y = std::fma(t, a.sa[r * blocks + b], y);
  }
  return y;
}

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
        auto dot = [&](int64_t g) {  // the stored bytes times the activations
          int32_t acc = 0;
          for (int64_t j = g * quads; j < (g + 1) * quads; ++j) {
            const uint8_t* step = panel_step(w, kq, n, p, j) + 4 * c;
            for (int64_t i = 0; i < 4 && 4 * j + i < k; ++i)  // padded weights are 0: nothing to add
              acc += (Offset ? int32_t(step[i]) : int32_t(int8_t(step[i]))) * int32_t(x[4 * j + i]);
          }
          return acc;
        };
        if (a.sa_per != 0) {
          a.out[r * n + c0 + c] = fold_output(a, p, width, c, r, Offset ? 128 : 0, dot);
          continue;
        }
        float y = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int32_t acc = (Offset ? -128 * a.sums[r * groups + g] : 0) + dot(g);
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

// W4A8 panels [p0, p1): offset nibbles (or int6: the nibbles joined with their plane's two high
// bits, LinearArgs::high_bits), scales in panel order, group sums [M, groups].
inline void w4a8_panels_twin(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* w = static_cast<const uint8_t*>(a.w);
  const int64_t k = a.k, n = a.n, groups = a.groups, steps = k / groups / kInt4StepInputs;
  const bool int6 = a.high_bits != 0;
  const int64_t per_column = int6 ? int6_bytes_per_column(k) : k / 2;
  const int32_t layout_offset = int6 ? 32 : 8;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t width = panel_width(n, p), c0 = p * kPanel;
    const float* sp = a.sw + c0 * groups;
    const uint8_t* plane = w + c0 * per_column + kPanel * (k / 2);  // int6 (full panels only)
    for (int64_t r = 0; r < a.m; ++r) {
      const int8_t* x = a.qa + r * k;
      for (int64_t c = 0; c < width; ++c) {
        auto dot = [&](int64_t g) {  // the stored values times the activations
          int32_t acc = 0;
          for (int64_t j = g * steps; j < (g + 1) * steps; ++j) {
            const uint8_t* step = panel_step(w, per_column, n, p, j) + 4 * c;
            for (int64_t i = 0; i < 4; ++i) {
              int32_t lo = step[i] & 0x0F, hi = step[i] >> 4;
              if (int6) {  // lane 4c + i: byte (lane % 32) of the plane step, two bits by lane / 32
                const int64_t lane = 4 * c + i;
                const uint8_t b = plane[j * kInt6PlaneStep + lane % 32];
                lo |= ((b >> (2 * (lane / 32))) & 3) << 4;
                hi |= ((b >> (4 + 2 * (lane / 32))) & 3) << 4;
              }
              acc += lo * x[8 * j + i] + hi * x[8 * j + 4 + i];
            }
          }
          return acc;
        };
        if (a.sa_per != 0) {
          a.out[r * n + c0 + c] = fold_output(a, p, width, c, r, layout_offset, dot);
          continue;
        }
        float y = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const int32_t acc = -layout_offset * a.sums[r * groups + g] + dot(g);
          y = std::fma(float(acc), a.sa_groups ? sp[g * width + c] * a.sa[r * groups + g] : sp[g * width + c], y);
        }
        a.out[r * n + c0 + c] = a.sa_groups ? y : y * a.sa[r];
      }
    }
  }
}

}  // namespace cpk
