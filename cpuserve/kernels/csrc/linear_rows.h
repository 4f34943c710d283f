// The row layouts' inner products (scalar twins) and the column loop every row variant runs (the
// generic twins and the Arm variants instantiate it with their own dot-product and tile kernels).
// Integer accumulation is exact everywhere; the float epilogue is the twin's, so W8A8 is
// bit-identical across row variants, and W4A8 too where a variant reduces each group to one int32
// before the twin's scalar float update (all Arm variants do).
#pragma once

#include <cstdint>
#include <vector>

#include "row_layout.h"
#include "variant.h"

namespace cpk {

// dot_i8: sum a*w over k. row: sum_g s_g * sum_{group g} nibble * a (before the offset layout's
// -8 correction and the activation scale). tile_*: the same for 2 activation rows x 2 weight rows
// at once (out = [r0c0, r0c1, r1c0, r1c1]).
using DotI8 = int32_t (*)(const int8_t*, const int8_t*, int64_t);
using RowI4 = float (*)(const int8_t*, const uint8_t*, const float*, int64_t, int64_t);
using TileI8 = void (*)(const int8_t*, const int8_t*, const int8_t*, const int8_t*, int64_t, int32_t*);
using TileI4 = void (*)(const int8_t*, const int8_t*, const uint8_t*, const uint8_t*, const float*, const float*,
                        int64_t, int64_t, float*);

inline int32_t dot_i8_generic(const int8_t* a, const int8_t* w, int64_t k) {
  int32_t acc = 0;
  for (int64_t i = 0; i < k; ++i) acc += int32_t(a[i]) * int32_t(w[i]);
  return acc;
}

// One group of len values (a multiple of 32): sum of value(nibble) * a, `value` reading a nibble as
// the layout stores it.
template <typename Value>
inline int32_t dot_nibbles_generic(const int8_t* a, const uint8_t* w, int64_t len, Value value) {
  int32_t acc = 0;
  for (int64_t b = 0; b < len / 32; ++b) {
    const uint8_t* wb = w + b * 16;
    const int8_t* ab = a + b * 32;
    for (int j = 0; j < 16; ++j) {
      acc += value(wb[j] & 0x0F) * int32_t(ab[j]);
      acc += value(wb[j] >> 4) * int32_t(ab[16 + j]);
    }
  }
  return acc;
}

// Offset nibbles as stored (0..15; the caller subtracts 8 * sum(a)) and two's-complement nibbles
// as their signed value.
inline int32_t dot_u4_generic(const int8_t* a, const uint8_t* w, int64_t len) {
  return dot_nibbles_generic(a, w, len, [](int n) { return int32_t(n); });
}
inline int32_t dot_s4_generic(const int8_t* a, const uint8_t* w, int64_t len) {
  return dot_nibbles_generic(a, w, len, [](int n) { return int32_t(n >= 8 ? n - 16 : n); });
}

// The twin's float update: groups in order, one float product and sum each.
template <int32_t (*Dot)(const int8_t*, const uint8_t*, int64_t)>
inline float row_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  float y = 0.f;
  for (int64_t g = 0; g < groups; ++g) y += float(Dot(a + g * group, w + g * group / 2, group)) * s[g];
  return y;
}

// Output columns [c0, c1): out[r, c] = (float(dot) * sw[c]) * sa[r]; 2x2 tiles first where the
// variant has them. In groups (scales [N, groups], K / groups inputs each): the same dot products
// and tiles over each group, folded in as row_generic does (groups in order, one product and sum).
template <DotI8 Dot, TileI8 Tile = nullptr>
inline void w8a8_rows(const LinearArgs& a, int64_t c0, int64_t c1) {
  const int8_t* qa = a.qa;
  const int8_t* qw = static_cast<const int8_t*>(a.w);
  const int64_t k = a.k, n = a.n, m = a.m, groups = a.groups, group = k / groups;
  auto put = [&](int64_t r, int64_t c, int32_t acc) { a.out[r * n + c] = (float(acc) * a.sw[c]) * a.sa[r]; };
  // sw[c, g], times the token's group scale when activations are scaled per group.
  auto scale = [&](int64_t r, int64_t c, int64_t g) {
    return a.sa_groups ? a.sw[c * groups + g] * a.sa[r * groups + g] : a.sw[c * groups + g];
  };
  auto finish = [&](int64_t r, float y) { return a.sa_groups ? y : y * a.sa[r]; };
  auto dot = [&](int64_t r, int64_t c) -> float {  // sum_g s_g * dot_g
    float y = 0.f;
    for (int64_t g = 0; g < groups; ++g)
      y += float(Dot(qa + r * k + g * group, qw + c * k + g * group, group)) * scale(r, c, g);
    return y;
  };
  if (groups > 1) {
    int64_t r = 0;
    if constexpr (Tile != nullptr) {
      for (; r + 2 <= m; r += 2) {
        int64_t c = c0;
        for (; c + 2 <= c1; c += 2) {
          float y[4] = {0.f, 0.f, 0.f, 0.f};
          for (int64_t g = 0; g < groups; ++g) {
            int32_t t[4];
            const int64_t o = g * group;
            Tile(qa + r * k + o, qa + (r + 1) * k + o, qw + c * k + o, qw + (c + 1) * k + o, group, t);
            y[0] += float(t[0]) * scale(r, c, g);
            y[1] += float(t[1]) * scale(r, c + 1, g);
            y[2] += float(t[2]) * scale(r + 1, c, g);
            y[3] += float(t[3]) * scale(r + 1, c + 1, g);
          }
          a.out[r * n + c] = finish(r, y[0]);
          a.out[r * n + c + 1] = finish(r, y[1]);
          a.out[(r + 1) * n + c] = finish(r + 1, y[2]);
          a.out[(r + 1) * n + c + 1] = finish(r + 1, y[3]);
        }
        for (; c < c1; ++c) {
          a.out[r * n + c] = finish(r, dot(r, c));
          a.out[(r + 1) * n + c] = finish(r + 1, dot(r + 1, c));
        }
      }
    }
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t rr = r; rr < m; ++rr) a.out[rr * n + c] = finish(rr, dot(rr, c));
    return;
  }
  int64_t r = 0;
  if constexpr (Tile != nullptr) {
    for (; r + 2 <= m; r += 2) {
      int64_t c = c0;
      for (; c + 2 <= c1; c += 2) {
        int32_t t[4];
        Tile(qa + r * k, qa + (r + 1) * k, qw + c * k, qw + (c + 1) * k, k, t);
        put(r, c, t[0]);
        put(r, c + 1, t[1]);
        put(r + 1, c, t[2]);
        put(r + 1, c + 1, t[3]);
      }
      for (; c < c1; ++c) {
        put(r, c, Dot(qa + r * k, qw + c * k, k));
        put(r + 1, c, Dot(qa + (r + 1) * k, qw + c * k, k));
      }
    }
  }
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t rr = r; rr < m; ++rr) put(rr, c, Dot(qa + rr * k, qw + c * k, k));
}

// W4A8 columns [c0, c1): packed nibbles [N, K/2], scales [N, groups]. Offset nibbles:
// sum_g s_g * (dot_g(u, a) - 8 * sum_g(a)), the correction a short scalar dot product.
template <RowI4 Row, TileI4 Tile, bool Offset>
inline void w4a8_rows(const LinearArgs& a, int64_t c0, int64_t c1) {
  const int64_t k = a.k, n = a.n, m = a.m, groups = a.groups, group = k / groups;
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  const float* sw = a.sw;
  // Activations scaled per group: each (token, column)'s group scales are sw * sa, made in a
  // per-thread row (no tiles: a tile's two tokens share one scale row).
  thread_local std::vector<float> scaled;
  auto scales_of = [&](int64_t r, int64_t c) -> const float* {
    if (!a.sa_groups) return sw + c * groups;
    scaled.resize(groups);
    for (int64_t g = 0; g < groups; ++g) scaled[g] = sw[c * groups + g] * a.sa[r * groups + g];
    return scaled.data();
  };
  auto put = [&](int64_t r, int64_t c, float dot) {
    float correction = 0.f;
    if constexpr (Offset) {
      const float* srow = scales_of(r, c);
      for (int64_t g = 0; g < groups; ++g) correction += srow[g] * float(a.sums[r * groups + g]);
    }
    a.out[r * n + c] = a.sa_groups ? dot - 8.f * correction : (dot - 8.f * correction) * a.sa[r];
  };
  auto row = [&](int64_t r, int64_t c) { return Row(a.qa + r * k, pw + c * (k / 2), scales_of(r, c), groups, group); };
  int64_t r = 0;
  if constexpr (Tile != nullptr) {
    for (; r + 2 <= m && !a.sa_groups; r += 2) {
      int64_t c = c0;
      for (; c + 2 <= c1; c += 2) {
        float t[4];
        Tile(a.qa + r * k, a.qa + (r + 1) * k, pw + c * (k / 2), pw + (c + 1) * (k / 2), sw + c * groups,
             sw + (c + 1) * groups, groups, group, t);
        put(r, c, t[0]);
        put(r, c + 1, t[1]);
        put(r + 1, c, t[2]);
        put(r + 1, c + 1, t[3]);
      }
      for (; c < c1; ++c) {
        put(r, c, row(r, c));
        put(r + 1, c, row(r + 1, c));
      }
    }
  }
  for (int64_t c = c0; c < c1; ++c)
    for (int64_t rr = r; rr < m; ++rr) put(rr, c, row(rr, c));
}

}  // namespace cpk
