// avx_vnni: AVX-VNNI (VEX-encoded vpdpbusd on ymm) for CPUs that have it without AVX-512 (Alder
// Lake and later client cores, Zen 5 client parts). The AVX-512 VNNI panel bytes (uint8 w + 128 for
// W8A8, offset nibbles for W4A8, int6 panels too) in AVX2's structure of two 8-column halves, with one vpdpbusd where
// AVX2 needs vpmaddubsw + vpmaddwd (and the sign trick): the accumulators start at the offset
// correction, as avx512_vnni's do. Exact integers and the panel twin's epilogues: bit-identical to it.
// Its quantizer and attention are AVX2's (the table row points at them).
#if defined(__x86_64__)
#include <vector>

#include "kernels.h"
#include "panel_halves.h"

#define CPK_AVX_VNNI_TARGET "avx2,fma,f16c,avxvnni"

namespace cpk {
namespace {

template <int R, int P>
__attribute__((target(CPK_AVX_VNNI_TARGET))) inline void u8_panel_block(const PanelRun& run, const int8_t* qa,
                                                                        const int32_t* asum, int64_t k,
                                                                        const float* sw, const float* sa, float* out,
                                                                        int64_t n) {
  __m256i acc[R][P][2];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(-128 * asum[r]);
  const int64_t quads = quad_k(k) / 4;
  for (int64_t j = 0; j < quads; ++j)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i)
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i w = load_half(run, i, h, j);
        if (h == 0) prefetch_ahead(run, i, j);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          acc[r][i][h] = _mm256_dpbusd_avx_epi32(acc[r][i][h], w, broadcast4_ymm(qa + r * k + 4 * j));
      }
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i)
    #pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 s = load_scales_half(run, i, h, sw + i * kPanel + 8 * h);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        store_half(run, i, h, out + r * n + i * kPanel + 8 * h,
                   _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][i][h]), s), _mm256_set1_ps(sa[r])));
    }
}

// W8A8 in groups (groups > 1), avx512_vnni's u8_group_block on two halves; float sums in memory.
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_AVX_VNNI_TARGET))) inline void u8_group_block(const PanelRun& run, const int8_t* qa,
                                                                        const int32_t* gs, int64_t k, int64_t groups,
                                                                        const Groups& src, const float* sa, float* out,
                                                                        int64_t n) {
  const int64_t quads = k / groups / 4;
  HalfSums<R, P, A> sums;
  FoldAt at(A == kFold ? fold_per(src) : 1);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m256i acc[R][P][2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(acc_start<A>(src, 128) * gs[r * groups + g]);
    for (int64_t j = g * quads; j < (g + 1) * quads; ++j)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i)
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i w = load_half(run, i, h, j);
          if (h == 0) prefetch_ahead(run, i, j);
          #pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
            acc[r][i][h] = _mm256_dpbusd_avx_epi32(acc[r][i][h], w, broadcast4_ymm(qa + r * k + 4 * j));
        }
    end_group_halves<R, P, A>(run, acc, src, gs, groups, g, at, sa, sums);
  }
  end_block_halves<R, P, A>(run, src, sums, sa, out, n);
}

template <int R, int P, int A, typename Groups, int HB = 0>  // HB 2: int6 panels (join_plane_half)
__attribute__((target(CPK_AVX_VNNI_TARGET))) inline void u4_panel_block(const PanelRun& run, const int8_t* qa,
                                                                        const int32_t* gs, int64_t k, int64_t groups,
                                                                        const Groups& src, const float* sa, float* out,
                                                                        int64_t n) {
  const int64_t steps = k / groups / 8;
  HalfSums<R, P, A> sums;
  FoldAt at(A == kFold ? fold_per(src) : 1);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m256i acc[R][P][2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(acc_start<A>(src, 8 << HB) * gs[r * groups + g]);
    for (int64_t j = g * steps; j < (g + 1) * steps; ++j)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        __m256i bits = _mm256_setzero_si256();
        if constexpr (HB != 0) bits = plane_step(run, i, k, j);
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = load_half(run, i, h, j);
          if (h == 0) prefetch_ahead(run, i, j);
          __m256i lo, hi;
          nibble_halves<HB>(v, bits, h, lo, hi);
          #pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            acc[r][i][h] = _mm256_dpbusd_avx_epi32(acc[r][i][h], lo, broadcast4_ymm(qa + r * k + 8 * j));
            acc[r][i][h] = _mm256_dpbusd_avx_epi32(acc[r][i][h], hi, broadcast4_ymm(qa + r * k + 8 * j + 4));
          }
        }
      }
    end_group_halves<R, P, A>(run, acc, src, gs, groups, g, at, sa, sums);
  }
  end_block_halves<R, P, A>(run, src, sums, sa, out, n);
}

struct U8Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_AVX_VNNI_TARGET))) void go(int64_t r) const {
    if (a.groups == 1)
      u8_panel_block<R, P>(run, a.qa + r * a.k, a.sums + r, a.k, a.sw + run.c0, a.sa + r, a.out + r * a.n + run.c0,
                           a.n);
    else
      with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
        u8_group_block<R, P, decltype(acts)::value>(run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src, sa, a.out + r * a.n + run.c0, a.n);
      });
  }
};

struct U4Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_AVX_VNNI_TARGET))) void go(int64_t r) const {
    with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
      with_high_bits(a, [&](auto hb) {
        u4_panel_block<R, P, decltype(acts)::value, std::decay_t<decltype(src)>, decltype(hb)::value>(
            run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src, sa, a.out + r * a.n + run.c0, a.n);
      });
    });
  }
};


// Decode (one row) streams one panel at a time: 2B Q4_0 +9.5% over two panels at once, the bundled
// model's engine +11%, as avx512_vnni's kStreamRows (panel_runs.h); at 4 and 8 rows the 2-panel
// blocks were 1-3% faster.
// Prefill blocks of 2 tokens x 2 panels (8 accumulators: the 16 ymm registers also hold 4 weight
// halves and the broadcasts).
template <typename Make>
__attribute__((always_inline)) inline void blocks(const LinearArgs& a, int64_t p0, int64_t p1, const Make& make) {
  if (a.m == 1)
    for_each_run<1, 1>(a.m, p0, p1, make);
  else
    for_each_run<2, 2>(a.m, p0, p1, make);
}

}  // namespace

__attribute__((target(CPK_AVX_VNNI_TARGET))) void w8a8_avx_vnni(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  blocks(a, p0, p1, [&](int64_t p, int64_t np) { return U8Panels{panel_run(pw, quad_k(a.k), a.n, p, np, a.m <= kPrefetchRows), a}; });
}

__attribute__((target(CPK_AVX_VNNI_TARGET))) void w4a8_avx_vnni(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  const int64_t per_column = a.high_bits != 0 ? int6_bytes_per_column(a.k) : a.k / 2;
  if (a.high_bits != 0 && a.m > kPrefetchRows) {  // prefill: each run widened once, offset int8
    thread_local std::vector<uint8_t> wide;
    wide.resize(2 * kPanel * a.k);
    blocks(a, p0, p1, [&](int64_t p, int64_t np) {
      return U8Panels{widen_int6_run_halves(panel_run(pw, per_column, a.n, p, np), np, a.k, wide.data(), 96), a};
    });
    return;
  }
  blocks(a, p0, p1, [&](int64_t p, int64_t np) { return U4Panels{panel_run(pw, per_column, a.n, p, np, a.m <= kPrefetchRows), a}; });
}

}  // namespace cpk
#endif  // __x86_64__
