// The float panel kernel (float_panels.h's layout), written once over a vector type V that each
// arch file defines and compiles for its own ISA: include this after the arch's `#pragma GCC
// target` (x86) so every function here is compiled for it. V gives kLanes (fp32 lanes), kRows (rows
// per register block: accumulators + one weight step + a broadcast fit the register file), Vec,
// zero / broadcast / fma / store and load(const E*) widening kLanes weights of type E to fp32.
//
// Per step k: the panel's 16 weights widened once, then one broadcast and 16 / kLanes fused
// multiply-adds per row of the block. One- and two-row blocks (decode) keep two sets of sums, even
// and odd k, so the fma latency does not bound the weight stream. Rows go in blocks of kRowBlock
// whose activations stay in L2 while the thread's panels stream past.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "float_panels.h"

namespace cpk {
namespace float_kernel {

constexpr int64_t kRowBlock = 48;

template <class V, int R, typename E>
inline void block(const float* x, int64_t k, const E* panel, float* out, int64_t n, int64_t width) {
  constexpr int P = int(kPanel / V::kLanes);
  constexpr int S = R <= 2 ? 2 : 1;  // sets of sums over interleaved k
  typename V::Vec acc[S][R][P];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < P; ++i) acc[s][r][i] = V::zero();
  int64_t j = 0;
  auto step = [&](int s, int64_t jj) __attribute__((always_inline)) {
    typename V::Vec w[P];
    for (int i = 0; i < P; ++i) w[i] = V::load(panel + jj * kPanel + i * V::kLanes);
    for (int r = 0; r < R; ++r) {
      const typename V::Vec b = V::broadcast(x[r * k + jj]);
      for (int i = 0; i < P; ++i) acc[s][r][i] = V::fma(b, w[i], acc[s][r][i]);
    }
  };
  for (; j + S <= k; j += S)
    for (int s = 0; s < S; ++s) step(s, j + s);
  for (; j < k; ++j) step(0, j);
  for (int r = 0; r < R; ++r) {
    float lanes[kPanel];
    for (int i = 0; i < P; ++i) {
      typename V::Vec v = acc[0][r][i];
      if constexpr (S == 2) v = V::add(v, acc[1][r][i]);
      if (width == kPanel)
        V::store(out + r * n + i * V::kLanes, v);
      else
        V::store(lanes + i * V::kLanes, v);
    }
    if (width != kPanel) std::memcpy(out + r * n, lanes, width * sizeof(float));
  }
}

// The last rows of a row block (fewer than kRows): the block of exactly that many.
template <class V, int R, typename E>
inline void tail(int64_t rows, const float* x, int64_t k, const E* panel, float* out, int64_t n, int64_t width) {
  if constexpr (R > 0) {
    if (rows == R) return block<V, R, E>(x, k, panel, out, n, width);
    tail<V, R - 1, E>(rows, x, k, panel, out, n, width);
  }
}

template <class V, typename E>
void panels(const FloatArgs& a, int64_t p0, int64_t p1) {
  const E* w = static_cast<const E*>(a.w);
  for (int64_t r0 = 0; r0 < a.m; r0 += kRowBlock) {
    const int64_t r1 = std::min(a.m, r0 + kRowBlock);
    for (int64_t p = p0; p < p1; ++p) {
      const E* panel = w + p * a.k * kPanel;
      const int64_t width = panel_width(a.n, p);
      float* out = a.out + p * kPanel;
      int64_t r = r0;
      for (; r + V::kRows <= r1; r += V::kRows)
        block<V, V::kRows, E>(a.x + r * a.k, a.k, panel, out + r * a.n, a.n, width);
      if (r < r1) tail<V, V::kRows - 1, E>(r1 - r, a.x + r * a.k, a.k, panel, out + r * a.n, a.n, width);
    }
  }
}

// The kernel entry for V: panels [p0, p1) of the linear, whatever the weights' type.
template <class V>
void linear(const FloatArgs& a, int64_t p0, int64_t p1) {
  if (a.wtype == DType::F32) return panels<V, float>(a, p0, p1);
  if (a.wtype == DType::Bf16) return panels<V, Bf16>(a, p0, p1);
  panels<V, F16>(a, p0, p1);
}

}  // namespace float_kernel
}  // namespace cpk
