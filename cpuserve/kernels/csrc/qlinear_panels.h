// The panel layout and its AVX-512 VNNI kernels: W8A8 and W4A8 weights of 16 output columns
// interleaved by 4 inputs, so one 64-byte load is a vpdpbusd operand for 16 columns and each
// activation row enters as a 4-byte broadcast from memory. A block of R rows x P panels keeps R x P
// accumulators of 16 columns in registers: no horizontal sums, every weight load shared by R rows and
// every activation broadcast by 16 columns. One layout serves decode (R = 1: each panel is one
// contiguous stream) and prefill (R = 3: ~390 GMAC/s of the ~460 peak of 2 Zen 4 cores, against
// ~170 for the earlier per-column dot-product blocks; docs/kernels.md).
//
// Panel p holds columns [16p, 16p + w), w = min(16, N - 16p), starting at byte 16p * (bytes per column):
//   int8 (w + 128 as uint8, K padded to a multiple of 4 with 0): per quad j, 4w bytes; byte 4c + i is
//     column c, input 4j + i. A padded 0 multiplies whatever follows the activation row by zero.
//   int4 (offset nibbles w + 8): per 8 inputs j, 4w bytes; byte 4c + i holds column c's input 8j + i
//     in its low nibble and 8j + 4 + i in its high nibble.
// vpdpbusd multiplies the unsigned weight by the signed activation; the offsets come back as
// -128 * sum(a) (W8A8) or -8 * sum(a over the group) (W4A8) in every accumulator lane at the start.
// W8A8 integer sums are exact and its float epilogue is the twin's, so it is bit-identical to it;
// W4A8 folds each group's int32 sum into fp32 lanes (equal to the twin within float rounding).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cpk {

constexpr int64_t kPanel = 16;

inline int64_t panel_count(int64_t n) { return (n + kPanel - 1) / kPanel; }
inline int64_t panel_width(int64_t n, int64_t p) { return std::min<int64_t>(kPanel, n - p * kPanel); }
// K of an int8 panel weight: whole quads.
inline int64_t quad_k(int64_t k) { return (k + 3) / 4 * 4; }

// Panel p of an int4 weight [N, K] into dst (the whole [N, K / 2] buffer); nibble(c, i) gives column
// c's input i as an offset nibble (w + 8, 0..15). K a multiple of 8.
template <typename Nibble>
inline void pack_int4_panel(int64_t n, int64_t k, int64_t p, uint8_t* dst, const Nibble& nibble) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel;
  uint8_t* out = dst + c0 * (k / 2);
  for (int64_t j = 0; j < k / 8; ++j)
    for (int64_t c = 0; c < w; ++c)
      for (int64_t i = 0; i < 4; ++i)
        out[j * 4 * w + c * 4 + i] = uint8_t(nibble(c0 + c, 8 * j + i) | (nibble(c0 + c, 8 * j + 4 + i) << 4));
}

// Panel p of an int8 weight src [N, K] into dst (the whole [N, quad_k(K)] buffer).
inline void pack_int8_panel(const int8_t* src, int64_t n, int64_t k, int64_t p, uint8_t* dst) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel, kq = quad_k(k);
  uint8_t* out = dst + c0 * kq;
  for (int64_t j = 0; j < kq / 4; ++j)
    for (int64_t c = 0; c < w; ++c)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t kk = 4 * j + i;
        out[j * 4 * w + c * 4 + i] = kk < k ? uint8_t(uint8_t(src[(c0 + c) * k + kk]) ^ 0x80) : uint8_t(0);
      }
}

// W4A8 scales [N, groups] into panel order (the whole [N, groups] buffer dst): panel p at 16p * groups
// floats, then per group its w columns' scales, so each group's scales are one 16-float (masked) load.
inline void pack_scales_panel(const float* sw, int64_t n, int64_t groups, int64_t p, float* dst) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t c = 0; c < w; ++c) dst[c0 * groups + g * w + c] = sw[(c0 + c) * groups + g];
}

#if defined(__x86_64__)
#define CPK_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni"

// Up to 4 panels side by side: where each starts, bytes per step (4 * width), its load mask, its
// width, and the last panel's column mask (only the last panel of a weight can be narrower than 16).
struct PanelRun {
  const uint8_t* base[4];
  int64_t step[4];
  __mmask64 load[4];
  int64_t width[4];
  __mmask16 store_last;
  int64_t c0;  // first column
  int64_t np;  // panels in this run
};

inline PanelRun panel_run(const uint8_t* pw, int64_t bytes_per_column, int64_t n, int64_t p, int64_t np) {
  PanelRun run{};
  run.c0 = p * kPanel;
  run.np = np;
  for (int64_t i = 0; i < np; ++i) {
    const int64_t w = panel_width(n, p + i);
    run.base[i] = pw + (p + i) * kPanel * bytes_per_column;
    run.step[i] = 4 * w;
    run.load[i] = w == kPanel ? ~__mmask64(0) : (__mmask64(1) << (4 * w)) - 1;
    run.width[i] = w;
    if (i == np - 1) run.store_last = __mmask16((1u << w) - 1);
  }
  return run;
}



__attribute__((target(CPK_VNNI_TARGET))) inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int P>
__attribute__((target(CPK_VNNI_TARGET))) inline void store_panels(float* out, const __m512 (&v)[P], __mmask16 last) {
  for (int i = 0; i < P; ++i) {
    if (i == P - 1)
      _mm512_mask_storeu_ps(out + i * kPanel, last, v[i]);
    else
      _mm512_storeu_ps(out + i * kPanel, v[i]);
  }
}

// W8A8: R rows (qa [R, K], row sums asum) x P panels -> out rows (stride n), scaled by column scales sw
// (of the run's columns) and row scales sa: (float(dot) * sw[c]) * sa[r], the twin's epilogue.
template <int R, int P>
__attribute__((target(CPK_VNNI_TARGET))) inline void u8_panel_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* asum, int64_t k, const float* sw,
                                                                    const float* sa, float* out, int64_t n) {
  __m512i acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) acc[r][i] = _mm512_set1_epi32(-128 * asum[r]);
  const int64_t quads = quad_k(k) / 4;
  for (int64_t j = 0; j < quads; ++j)
    for (int i = 0; i < P; ++i) {
      const __m512i w = _mm512_maskz_loadu_epi8(run.load[i], run.base[i] + j * run.step[i]);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], w, broadcast4(qa + r * k + 4 * j));
    }
  __m512 s[P];
  for (int i = 0; i < P; ++i)
    s[i] = _mm512_maskz_loadu_ps(i == P - 1 ? run.store_last : __mmask16(0xFFFF), sw + i * kPanel);
  for (int r = 0; r < R; ++r) {
    __m512 v[P];
    for (int i = 0; i < P; ++i)
      v[i] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][i]), s[i]), _mm512_set1_ps(sa[r]));
    store_panels<P>(out + r * n, v, run.store_last);
  }
}

// W4A8: R rows (qa [R, K], group sums gs [R, groups]) x P panels; sp: the run's scales in panel
// order (pack_scales_panel, from the run's first column). out = sa[r] * sum_g s_g * dot_g.
template <int R, int P>
__attribute__((target(CPK_VNNI_TARGET))) inline void u4_panel_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* gs, int64_t k, int64_t groups,
                                                                    const float* sp, const float* sa, float* out,
                                                                    int64_t n) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t steps = k / groups / 8;  // 8-input steps per group
  __m512 facc[R][P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) facc[r][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < P; ++i) acc[r][i] = _mm512_set1_epi32(-8 * gs[r * groups + g]);
    for (int64_t j = g * steps; j < (g + 1) * steps; ++j)
      for (int i = 0; i < P; ++i) {
        const __m512i v = _mm512_maskz_loadu_epi8(run.load[i], run.base[i] + j * run.step[i]);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], lo, broadcast4(qa + r * k + 8 * j));
          acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], hi, broadcast4(qa + r * k + 8 * j + 4));
        }
      }
    for (int i = 0; i < P; ++i) {
      const __m512 s = _mm512_maskz_loadu_ps(i == P - 1 ? run.store_last : __mmask16(0xFFFF),
                                             sp + i * kPanel * groups + g * run.width[i]);
      for (int r = 0; r < R; ++r) facc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][i]), s, facc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 v[P];
    for (int i = 0; i < P; ++i) v[i] = _mm512_mul_ps(facc[r][i], _mm512_set1_ps(sa[r]));
    store_panels<P>(out + r * n, v, run.store_last);
  }
}

// Rows [r0, r1) of one run in blocks of 3 rows (then 2 or 1): block.template go<R, P>(r).
template <int R, typename Block>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void panel_block(const Block& block, int64_t np,
                                                                               int64_t r) {
  switch (np) {
    case 4: block.template go<R, 4>(r); break;
    case 3: block.template go<R, 3>(r); break;
    case 2: block.template go<R, 2>(r); break;
    default: block.template go<R, 1>(r); break;
  }
}

template <typename Block>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void panel_rows(const Block& block, int64_t np,
                                                                              int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + 3 <= r1; r += 3) panel_block<3>(block, np, r);
  if (r1 - r == 2) panel_block<2>(block, np, r);
  if (r1 - r == 1) panel_block<1>(block, np, r);
}

// Rows per pass over a thread's panels: the activations of a pass stay in L2 while the panels stream.
constexpr int64_t kPanelRows = 192;

struct U8Panels {
  PanelRun run;
  const int8_t* qa;
  const int32_t* asum;
  const float *sw, *sa;
  int64_t k, n;
  float* out;
  template <int R, int P>
  __attribute__((target(CPK_VNNI_TARGET))) void go(int64_t r) const {
    u8_panel_block<R, P>(run, qa + r * k, asum + r, k, sw + run.c0, sa + r, out + r * n + run.c0, n);
  }
};

// W8A8 panels [p0, p1) of pw (pack_int8_panel) for all M rows of qa (each row readable 4 bytes past
// its end): out [M, N] fp32.
__attribute__((target(CPK_VNNI_TARGET))) inline void w8a8_panels(const int8_t* qa, const float* sa,
                                                                 const int32_t* asum, int64_t m, int64_t k,
                                                                 const uint8_t* pw, const float* sw, int64_t n,
                                                                 int64_t p0, int64_t p1, float* out) {
  for (int64_t r0 = 0; r0 < m; r0 += kPanelRows)
    for (int64_t p = p0; p < p1; p += 4) {
      const int64_t np = std::min<int64_t>(4, p1 - p);
      const U8Panels block{panel_run(pw, quad_k(k), n, p, np), qa, asum, sw, sa, k, n, out};
      panel_rows(block, np, r0, std::min(m, r0 + kPanelRows));
    }
}

struct U4Panels {
  PanelRun run;
  const int8_t* qa;
  const int32_t* gs;
  const float *sp, *sa;
  int64_t k, groups, n;
  float* out;
  template <int R, int P>
  __attribute__((target(CPK_VNNI_TARGET))) void go(int64_t r) const {
    u4_panel_block<R, P>(run, qa + r * k, gs + r * groups, k, groups, sp + run.c0 * groups, sa + r,
                         out + r * n + run.c0, n);
  }
};

// W4A8 panels [p0, p1) of pw (pack_int4_panel) with scales sp [N, groups] in panel order
// (pack_scales_panel), for all M rows: out [M, N].
__attribute__((target(CPK_VNNI_TARGET))) inline void w4a8_panels(const int8_t* qa, const float* sa, const int32_t* gs,
                                                                 int64_t m, int64_t k, const uint8_t* pw,
                                                                 const float* sp, int64_t groups, int64_t n,
                                                                 int64_t p0, int64_t p1, float* out) {
  for (int64_t r0 = 0; r0 < m; r0 += kPanelRows)
    for (int64_t p = p0; p < p1; p += 4) {
      const int64_t np = std::min<int64_t>(4, p1 - p);
      const U4Panels block{panel_run(pw, k / 2, n, p, np), qa, gs, sp, sa, k, groups, n, out};
      panel_rows(block, np, r0, std::min(m, r0 + kPanelRows));
    }
}
#endif  // __x86_64__

}  // namespace cpk
