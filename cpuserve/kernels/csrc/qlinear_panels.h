// The panel layout and its kernels (AVX-512 VNNI, AVX2): W8A8 and W4A8 weights of 16 output columns
// interleaved by 4 inputs, so one 64-byte load (two 32-byte halves on AVX2) is a dot-product operand
// for 16 columns and each activation row enters as a 4-byte broadcast. A block of R rows x P panels
// keeps R x P accumulators of 16 columns in registers: no horizontal sums, every weight load shared by
// R rows and every activation broadcast by 16 columns. One layout serves decode (R = 1: each panel is
// one contiguous stream) and prefill (VNNI R = 3: ~390 GMAC/s of the ~460 peak of 2 Zen 4 cores,
// against ~170 for the earlier per-column dot-product blocks; docs/kernels.md).
//
// Panel p holds columns [16p, 16p + w), w = min(16, N - 16p), starting at byte 16p * (bytes per column):
//   int8 (K padded to a multiple of 4 with 0): per quad j, 4w bytes; byte 4c + i is column c, input
//     4j + i; stored as w + 128 (uint8, VNNI) or as w (int8, AVX2). A padded 0 multiplies whatever
//     follows the activation row by zero.
//   int4 (offset nibbles w + 8, both ISAs): per 8 inputs j, 4w bytes; byte 4c + i holds column c's
//     input 8j + i in its low nibble and 8j + 4 + i in its high nibble.
// vpdpbusd multiplies the unsigned weight by the signed activation; the offsets come back as
// -128 * sum(a) (W8A8) or -8 * sum(a over the group) (W4A8) in every accumulator lane at the start.
// Integer sums are exact and W8A8's float epilogue is the twin's, so W8A8 is bit-identical to it;
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

// Panel p of an int8 weight src [N, K] into dst (the whole [N, quad_k(K)] buffer): offset (w + 128,
// for vpdpbusd's unsigned operand) or signed (w itself, for AVX2's sign trick); padding is 0 either way.
inline void pack_int8_panel(const int8_t* src, int64_t n, int64_t k, int64_t p, uint8_t* dst, bool offset) {
  const int64_t w = panel_width(n, p), c0 = p * kPanel, kq = quad_k(k);
  const uint8_t flip = offset ? 0x80 : 0;
  uint8_t* out = dst + c0 * kq;
  for (int64_t j = 0; j < kq / 4; ++j)
    for (int64_t c = 0; c < w; ++c)
      for (int64_t i = 0; i < 4; ++i) {
        const int64_t kk = 4 * j + i;
        out[j * 4 * w + c * 4 + i] = kk < k ? uint8_t(uint8_t(src[(c0 + c) * k + kk]) ^ flip) : uint8_t(0);
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
};

inline PanelRun panel_run(const uint8_t* pw, int64_t bytes_per_column, int64_t n, int64_t p, int64_t np) {
  PanelRun run{};
  run.c0 = p * kPanel;
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

// One block of R rows and the run's np panels (np <= P): block.template go<R, np>(r). Generic and
// always inlined, so the ISA-specific blocks inline into each ISA's driver below.
template <int R, int P, typename Block>
__attribute__((always_inline)) inline void panel_block(const Block& block, int64_t np, int64_t r) {
  if constexpr (P > 1) {
    if (np < P) return panel_block<R, P - 1>(block, np, r);
  }
  block.template go<R, P>(r);
}

// Rows [r0, r1) of one run in blocks of R rows, the rest in smaller blocks.
template <int R, int P, typename Block>
__attribute__((always_inline)) inline void panel_rows(const Block& block, int64_t np, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) panel_block<R, P>(block, np, r);
  if constexpr (R > 1) {
    if (r < r1) panel_rows<R - 1, P>(block, np, r, r1);
  }
}

// Rows per pass over a thread's panels: the activations of a pass stay in L2 while the panels stream.
constexpr int64_t kPanelRows = 192;

// Every run of up to P panels of [p0, p1) in blocks of up to R rows, rows in passes of kPanelRows;
// make(p, np) gives the run's block.
template <int R, int P, typename Make>
__attribute__((always_inline)) inline void for_each_run(int64_t m, int64_t p0, int64_t p1, const Make& make) {
  for (int64_t r0 = 0; r0 < m; r0 += kPanelRows)
    for (int64_t p = p0; p < p1; p += P) {
      const int64_t np = std::min<int64_t>(P, p1 - p);
      panel_rows<R, P>(make(p, np), np, r0, std::min(m, r0 + kPanelRows));
    }
}

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

// W8A8 panels [p0, p1) of pw (pack_int8_panel, offset) for all M rows of qa (each row readable 4
// bytes past its end): out [M, N] fp32.
__attribute__((target(CPK_VNNI_TARGET))) inline void w8a8_panels_vnni(const int8_t* qa, const float* sa,
                                                                      const int32_t* asum, int64_t m, int64_t k,
                                                                      const uint8_t* pw, const float* sw, int64_t n,
                                                                      int64_t p0, int64_t p1, float* out) {
  for_each_run<3, 4>(m, p0, p1, [&](int64_t p, int64_t np) {
    return U8Panels{panel_run(pw, quad_k(k), n, p, np), qa, asum, sw, sa, k, n, out};
  });
}

// What a W4A8 block reads and writes, whichever ISA's block kernel runs it.
struct U4Operands {
  PanelRun run;
  const int8_t* qa;
  const int32_t* gs;
  const float *sp, *sa;
  int64_t k, groups, n;
  float* out;
};

struct U4Panels : U4Operands {
  template <int R, int P>
  __attribute__((target(CPK_VNNI_TARGET))) void go(int64_t r) const {
    u4_panel_block<R, P>(run, qa + r * k, gs + r * groups, k, groups, sp + run.c0 * groups, sa + r,
                         out + r * n + run.c0, n);
  }
};

// W4A8 panels [p0, p1) of pw (pack_int4_panel) with scales sp [N, groups] in panel order
// (pack_scales_panel), for all M rows: out [M, N].
__attribute__((target(CPK_VNNI_TARGET))) inline void w4a8_panels_vnni(const int8_t* qa, const float* sa,
                                                                      const int32_t* gs, int64_t m, int64_t k,
                                                                      const uint8_t* pw, const float* sp,
                                                                      int64_t groups, int64_t n, int64_t p0,
                                                                      int64_t p1, float* out) {
  for_each_run<3, 4>(m, p0, p1, [&](int64_t p, int64_t np) {
    return U4Panels{{panel_run(pw, k / 2, n, p, np), qa, gs, sp, sa, k, groups, n, out}};
  });
}

// ---------------------------------------------------------------- AVX2 (+FMA)
// The same panels as two 8-column halves, one ymm each. W8A8 weights signed (pack_int8_panel with
// offset false): vpmaddubsw multiplies |w| (unsigned, <= 128) by a with w's sign (vpsignb), so a pair
// sums to at most 2 * 128 * 127 < 2^15: no saturation; vpmaddwd by ones widens to int32. W4A8 uses the
// VNNI panels' bytes as they are (offset nibbles <= 15: pairs <= 3810, the two nibble halves' sum
// <= 7620). Exact integers, the same epilogues: W8A8 bit-identical to the twin.
#define CPK_AVX2_TARGET "avx2,fma"

__attribute__((target(CPK_AVX2_TARGET))) inline __m256i lanes_below(int64_t live) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(live)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Half h (columns 8h .. 8h + 7) of panel i's step j; lanes past the panel's width read as zero.
__attribute__((target(CPK_AVX2_TARGET))) inline __m256i load_half(const PanelRun& run, int i, int h, int64_t j) {
  const uint8_t* p = run.base[i] + j * run.step[i] + 32 * h;
  if (run.width[i] == kPanel) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), lanes_below(run.width[i] - 8 * h));
}

// vbroadcastss from memory: a load-port operation (set1 of a loaded int went through a general
// register, movd and vpbroadcastd: three ALU operations per broadcast, the inner loop's bottleneck).
__attribute__((target(CPK_AVX2_TARGET))) inline __m256i broadcast4_avx2(const int8_t* p) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
}

// Stores (or masked stores) 8 results of half h of panel i.
__attribute__((target(CPK_AVX2_TARGET))) inline void store_half(const PanelRun& run, int i, int h, float* out,
                                                                 __m256 v) {
  if (run.width[i] == kPanel)
    _mm256_storeu_ps(out, v);
  else
    _mm256_maskstore_ps(out, lanes_below(run.width[i] - 8 * h), v);
}

template <int R, int P>
__attribute__((target(CPK_AVX2_TARGET))) inline void s8_panel_block_avx2(const PanelRun& run, const int8_t* qa,
                                                                         int64_t k, const float* sw, const float* sa,
                                                                         float* out, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_si256();
  const int64_t quads = quad_k(k) / 4;
  for (int64_t j = 0; j < quads; ++j)
    for (int i = 0; i < P; ++i)
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load_half(run, i, h, j);
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i signed_a = _mm256_sign_epi8(broadcast4_avx2(qa + r * k + 4 * j), w);
          acc[r][i][h] = _mm256_add_epi32(acc[r][i][h],
                                          _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), ones));
        }
      }
  for (int i = 0; i < P; ++i)
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_maskload_ps(sw + i * kPanel + 8 * h, lanes_below(run.width[i] - 8 * h));
      for (int r = 0; r < R; ++r)
        store_half(run, i, h, out + r * n + i * kPanel + 8 * h,
                   _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][i][h]), s), _mm256_set1_ps(sa[r])));
    }
}

template <int R, int P>
__attribute__((target(CPK_AVX2_TARGET))) inline void u4_panel_block_avx2(const PanelRun& run, const int8_t* qa,
                                                                         const int32_t* gs, int64_t k, int64_t groups,
                                                                         const float* sp, const float* sa, float* out,
                                                                         int64_t n) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t steps = k / groups / 8;
  // The float sums live in memory (touched once per group): the 16 ymm registers hold the integer
  // accumulators and the inner loop's operands (spilled accumulators cost 3-5x in a first version).
  alignas(32) float facc[R][P][2][8] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][P][2];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(-8 * gs[r * groups + g]);
    for (int64_t j = g * steps; j < (g + 1) * steps; ++j)
      for (int i = 0; i < P; ++i)
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load_half(run, i, h, j);
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4_avx2(qa + r * k + 8 * j)),
                                                   _mm256_maddubs_epi16(hi, broadcast4_avx2(qa + r * k + 8 * j + 4)));
            acc[r][i][h] = _mm256_add_epi32(acc[r][i][h], _mm256_madd_epi16(pairs, ones));
          }
        }
    for (int i = 0; i < P; ++i)
      for (int h = 0; h < 2; ++h) {
        const __m256 s = _mm256_maskload_ps(sp + i * kPanel * groups + g * run.width[i] + 8 * h,
                                            lanes_below(run.width[i] - 8 * h));
        for (int r = 0; r < R; ++r)
          _mm256_store_ps(facc[r][i][h],
                          _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][i][h]), s, _mm256_load_ps(facc[r][i][h])));
      }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < P; ++i)
      for (int h = 0; h < 2; ++h)
        store_half(run, i, h, out + r * n + i * kPanel + 8 * h,
                   _mm256_mul_ps(_mm256_load_ps(facc[r][i][h]), _mm256_set1_ps(sa[r])));
}

struct S8PanelsAvx2 {
  PanelRun run;
  const int8_t* qa;
  const float *sw, *sa;
  int64_t k, n;
  float* out;
  template <int R, int P>
  __attribute__((target(CPK_AVX2_TARGET))) void go(int64_t r) const {
    s8_panel_block_avx2<R, P>(run, qa + r * k, k, sw + run.c0, sa + r, out + r * n + run.c0, n);
  }
};

struct U4PanelsAvx2 : U4Operands {
  template <int R, int P>
  __attribute__((target(CPK_AVX2_TARGET))) void go(int64_t r) const {
    u4_panel_block_avx2<R, P>(run, qa + r * k, gs + r * groups, k, groups, sp + run.c0 * groups, sa + r,
                              out + r * n + run.c0, n);
  }
};

// As w8a8_panels_vnni, signed panels.
__attribute__((target(CPK_AVX2_TARGET))) inline void w8a8_panels_avx2(const int8_t* qa, const float* sa, int64_t m,
                                                                      int64_t k, const uint8_t* pw, const float* sw,
                                                                      int64_t n, int64_t p0, int64_t p1, float* out) {
  auto make = [&](int64_t p, int64_t np) {
    return S8PanelsAvx2{panel_run(pw, quad_k(k), n, p, np), qa, sw, sa, k, n, out};
  };
  if (m == 1)
    for_each_run<1, 2>(m, p0, p1, make);  // decode: two panels' streams interleaved
  else
    for_each_run<2, 1>(m, p0, p1, make);
}

// As w4a8_panels_vnni.
__attribute__((target(CPK_AVX2_TARGET))) inline void w4a8_panels_avx2(const int8_t* qa, const float* sa,
                                                                      const int32_t* gs, int64_t m, int64_t k,
                                                                      const uint8_t* pw, const float* sp,
                                                                      int64_t groups, int64_t n, int64_t p0,
                                                                      int64_t p1, float* out) {
  auto make = [&](int64_t p, int64_t np) {
    return U4PanelsAvx2{{panel_run(pw, k / 2, n, p, np), qa, gs, sp, sa, k, groups, n, out}};
  };
  if (m == 1)
    for_each_run<1, 2>(m, p0, p1, make);
  else
    for_each_run<2, 1>(m, p0, p1, make);
}
#endif  // __x86_64__

}  // namespace cpk
