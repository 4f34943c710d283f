// The panel layout (x86 variants): W8A8 and W4A8 weights of 16 output columns interleaved by 4
// inputs, so one 64-byte load (two 32-byte halves on AVX2) is a dot-product operand for 16 columns
// and each activation row enters as a 4-byte broadcast. One layout serves decode (1 token: each
// panel is one contiguous stream) and prefill (blocks of tokens x panels, docs/kernels.md).
//
// Panel p holds columns [16p, 16p + w), w = min(16, N - 16p), starting at byte 16p * (bytes per
// column), as a sequence of steps; a full panel's step is one PanelStep of 64 bytes, the last
// panel's (w < 16) the first 4w bytes of one:
//   int8 (K padded to a multiple of 4 with 0): per quad j of inputs, bytes[c][i] is column c, input
//     4j + i; stored as w + 128 (uint8, OffsetPanels) or as w (int8, SignedPanels). A padded 0
//     multiplies whatever follows the activation row by zero.
//   int4 (offset nibbles w + 8): per 8 inputs j, bytes[c][i] holds column c's input 8j + i in its
//     low nibble and 8j + 4 + i in its high nibble.
//   int6 (values w in [-32, 31] stored as w + 32: GGUF's Q6_K, Q5_K, Q5_0, Q5_1 exactly; N a
//     multiple of 16, K of 32): panel p at 16p * (3K / 4) bytes, first the int4 steps of the low
//     nibbles ((w + 32) & 15, as above), then per 8 inputs j a 32-byte plane step of the high two
//     bits: byte e holds lane e of the low-nibble vector (inputs 8j..8j+3) in bits 0-1, lane e + 32
//     in bits 2-3, lane e of the high-nibble vector (8j+4..8j+7) in bits 4-5, lane e + 32 in bits
//     6-7 (lane 4c + i: column c, input i). 6 bits a weight where int8 took 8; the kernels join
//     both parts in registers (one shift and mask a vector) before the same dot products.
// W4A8 scales [N, groups] are in panel order: panel p at 16p * groups floats, then per group its w
// columns' scales, so each group's scales are one 16-float (masked) load.
#pragma once

#include <algorithm>
#include <cstdint>

namespace cpk {

constexpr int64_t kPanel = 16;

struct PanelStep {
  uint8_t bytes[kPanel][4];  // [column][i]
};
static_assert(sizeof(PanelStep) == 64, "one step of a full panel is one 64-byte vector");
constexpr int64_t kInt8StepInputs = 4, kInt4StepInputs = 8;

inline int64_t panel_count(int64_t n) { return (n + kPanel - 1) / kPanel; }
inline int64_t panel_width(int64_t n, int64_t p) { return std::min<int64_t>(kPanel, n - p * kPanel); }
// K of an int8 panel weight: whole quads.
inline int64_t quad_k(int64_t k) { return (k + 3) / 4 * 4; }

// Step j of panel p (width w) of a weight with `bytes_per_column` bytes per column: its 4w bytes.
inline const uint8_t* panel_step(const uint8_t* w, int64_t bytes_per_column, int64_t n, int64_t p, int64_t j) {
  return w + p * kPanel * bytes_per_column + j * 4 * panel_width(n, p);
}

// Panel p of an int4 weight [N, K] into dst (the whole [N, K / 2] buffer); nibble(c, i) gives column
// c's input i as an offset nibble (w + 8, 0..15). K a multiple of 8.
template <typename Nibble>
inline void pack_int4_panel(int64_t n, int64_t k, int64_t p, uint8_t* dst, const Nibble& nibble) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel;
  for (int64_t j = 0; j < k / kInt4StepInputs; ++j) {
    uint8_t* step = dst + c0 * (k / 2) + j * 4 * w;
    for (int64_t c = 0; c < w; ++c)
      for (int64_t i = 0; i < 4; ++i)
        step[c * 4 + i] = uint8_t(nibble(c0 + c, 8 * j + i) | (nibble(c0 + c, 8 * j + 4 + i) << 4));
  }
}

// Panel p (full: N a multiple of 16) of an int6 weight [N, K] into dst (the whole [N, 3K / 4]
// buffer); value(c, i) gives column c's input i as w + 32 (0..63). K a multiple of 8.
constexpr int64_t kInt6PlaneStep = 32;
inline int64_t int6_bytes_per_column(int64_t k) { return k / 2 + k / 4; }
template <typename Value>
inline void pack_int6_panel(int64_t k, int64_t p, uint8_t* dst, const Value& value) {
  const int64_t c0 = p * kPanel;
  uint8_t* panel = dst + c0 * int6_bytes_per_column(k);
  uint8_t* plane = panel + kPanel * (k / 2);
  for (int64_t j = 0; j < k / kInt4StepInputs; ++j) {
    uint8_t* step = panel + j * 4 * kPanel;
    for (int64_t lane = 0; lane < 4 * kPanel; ++lane) {
      const int64_t c = c0 + lane / 4, i = lane % 4;
      step[lane] = uint8_t((value(c, 8 * j + i) & 15) | ((value(c, 8 * j + 4 + i) & 15) << 4));
    }
    uint8_t* high = plane + j * kInt6PlaneStep;
    for (int64_t e = 0; e < kInt6PlaneStep; ++e) {
      auto top = [&](int64_t lane, int64_t half) {  // the high two bits of a lane's value
        return (value(c0 + lane / 4, 8 * j + 4 * half + lane % 4) >> 4) & 3;
      };
      high[e] = uint8_t(top(e, 0) | (top(e + 32, 0) << 2) | (top(e, 1) << 4) | (top(e + 32, 1) << 6));
    }
  }
}

// Panel p of an int8 weight src [N, K] into dst (the whole [N, quad_k(K)] buffer): offset (w + 128,
// for vpdpbusd's unsigned operand) or signed (w itself, for AVX2's sign trick); padding is 0 either way.
inline void pack_int8_panel(const int8_t* src, int64_t n, int64_t k, int64_t p, uint8_t* dst, bool offset) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel, kq = quad_k(k);
  const uint8_t flip = offset ? 0x80 : 0;
  for (int64_t j = 0; j < kq / kInt8StepInputs; ++j) {
    uint8_t* step = dst + c0 * kq + j * 4 * w;
    for (int64_t c = 0; c < w; ++c)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t kk = 4 * j + i;
        step[c * 4 + i] = kk < k ? uint8_t(uint8_t(src[(c0 + c) * k + kk]) ^ flip) : uint8_t(0);
      }
  }
}

// W4A8 scales [N, groups] of panel p into panel order (the whole [N, groups] buffer dst); fp32 or the
// bits of codes of any width.
template <typename T>
inline void pack_scales_panel(const T* sw, int64_t n, int64_t groups, int64_t p, T* dst) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < w; ++c) dst[c0 * groups + g * w + c] = sw[(c0 + c) * groups + g];
}

}  // namespace cpk
