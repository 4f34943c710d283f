// avx2: the panels as two 8-column halves (panel_halves.h). W8A8 weights signed (SignedPanels):
// vpmaddubsw multiplies |w| (unsigned, <= 128) by a with w's sign (vpsignb), so a pair sums to at
// most 2 * 128 * 127 < 2^15: no saturation; vpmaddwd by ones widens to int32. W4A8 reads the VNNI
// panels' bytes as they are (offset nibbles <= 15: pairs <= 3810, the two nibble halves' sum
// <= 7620, four steps' sums <= 30480, added in int16 before one vpmaddwd; int6 values <= 63: pairs
// <= 16002, the sum <= 32004, widened every step). Exact integers and the panel twin's epilogues:
// bit-identical to it. Also the AVX2 activation quantizer (decode attention: attention_avx2.cpp).
#if defined(__x86_64__)
#include <vector>

#include "../../quantize.h"
#include "kernels.h"
#include "panel_halves.h"

namespace cpk {
namespace {

template <int R, int P>
__attribute__((target(CPK_AVX2_TARGET))) inline void s8_panel_block(const PanelRun& run, const int8_t* qa, int64_t k,
                                                                    const float* sw, const float* sa, float* out,
                                                                    int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][P][2];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_si256();
  const int64_t quads = quad_k(k) / 4;
  HalfStreams<P> ws(run);
  for (int64_t j = 0; j < quads; ++j) {
    __m256i a[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = broadcast4_ymm(qa + r * k + 4 * j);
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      #pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i w = ws.half(i, h);
        const __m256i magnitude = _mm256_abs_epi8(w);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i signed_a = _mm256_sign_epi8(a[r], w);
          acc[r][i][h] = _mm256_add_epi32(acc[r][i][h],
                                          _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), ones));
        }
      }
      ws.advance(i);
    }
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

// W8A8 in groups (groups > 1): s8_panel_block's sign trick per group, float sums in memory.
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_AVX2_TARGET))) inline void s8_group_block(const PanelRun& run, const int8_t* qa, const int32_t* gs, int64_t k,
                                                                    int64_t groups, const Groups& src, const float* sa,
                                                                    float* out, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t quads = k / groups / 4;
  HalfSums<R, P, A> sums;
  FoldAt at(A == kFold ? fold_per(src) : 1);
  HalfStreams<P> ws(run);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m256i acc[R][P][2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(acc_start<A>(src, 0) * gs[r * groups + g]);
    for (int64_t j = g * quads; j < (g + 1) * quads; ++j) {
      __m256i a[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r] = broadcast4_ymm(qa + r * k + 4 * j);
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i w = ws.half(i, h);
          const __m256i magnitude = _mm256_abs_epi8(w);
          #pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i signed_a = _mm256_sign_epi8(a[r], w);
            acc[r][i][h] = _mm256_add_epi32(acc[r][i][h],
                                            _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_a), ones));
          }
        }
        ws.advance(i);
      }
    }
    end_group_halves<R, P, A>(run, acc, src, gs, groups, g, at, sa, sums);
  }
  end_block_halves<R, P, A>(run, src, sums, sa, out, n);
}

template <int R, int P, int A, typename Groups, int HB = 0>  // HB 2: int6 panels (join_plane_half)
__attribute__((target(CPK_AVX2_TARGET))) inline void u4_panel_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* gs, int64_t k, int64_t groups,
                                                                    const Groups& src, const float* sa, float* out,
                                                                    int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t steps = k / groups / 8;
  // Offset nibbles' int16 pair sums add up over kChunk steps before one vpmaddwd widens them: 4 x
  // 7620 < 2^15 (a group is a multiple of 32 inputs: 4 steps). Int6 values fill int16 in one step.
  constexpr int64_t kChunk = HB == 0 ? 4 : 1;
  // The float sums live in memory (touched once per group): the 16 ymm registers hold the int16
  // partial sums and the inner loop's operands (spilled accumulators cost 3-5x in a first version);
  // the int32 sums, touched once per chunk, may live in memory too.
  HalfSums<R, P, A> sums;
  FoldAt at(A == kFold ? fold_per(src) : 1);
  HalfStreams<P> ws(run);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m256i acc[R][P][2];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i][0] = acc[r][i][1] = _mm256_set1_epi32(acc_start<A>(src, 8 << HB) * gs[r * groups + g]);
    for (int64_t j0 = g * steps; j0 < (g + 1) * steps; j0 += kChunk) {
      __m256i part[R][P][2];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int i = 0; i < P; ++i) part[r][i][0] = part[r][i][1] = _mm256_setzero_si256();
      #pragma GCC unroll 4
      for (int64_t j = j0; j < j0 + kChunk; ++j) {
        __m256i alo[R], ahi[R];
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          alo[r] = broadcast4_ymm(qa + r * k + 8 * j);
          ahi[r] = broadcast4_ymm(qa + r * k + 8 * j + 4);
        }
        #pragma GCC unroll 4
        for (int i = 0; i < P; ++i) {
          __m256i bits = _mm256_setzero_si256();
          if constexpr (HB != 0) bits = plane_step(run, i, k, j);
          #pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m256i v = ws.half(i, h);
            __m256i lo, hi;
            nibble_halves<HB>(v, bits, h, lo, hi);  // int6 values <= 63: pairs <= 32004
            #pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
              part[r][i][h] = _mm256_add_epi16(
                  part[r][i][h], _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo[r]), _mm256_maddubs_epi16(hi, ahi[r])));
          }
          ws.advance(i);
        }
      }
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        #pragma GCC unroll 4
        for (int i = 0; i < P; ++i)
          #pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm256_add_epi32(acc[r][i][h], _mm256_madd_epi16(part[r][i][h], ones));
    }
    end_group_halves<R, P, A>(run, acc, src, gs, groups, g, at, sa, sums);
  }
  end_block_halves<R, P, A>(run, src, sums, sa, out, n);
}

// Decode (one row) reads a thread's panels one at a time, as one contiguous stream (avx512_vnni's
// kStreamRows, panel_runs.h), when the groups are per channel or of 128 inputs or more; with
// smaller groups, two panels side by side. One panel against two, in one process alternated (the
// AVX2 case, Zen 5 host, medians of 7-11): 2B W4A8-G128 +8.7%, W8A8 +7.3% (its int8 head too), 2B
// Q4_0 GGUF (groups of 32) +0.6%, the bundled Q4_1 GGUF (groups of 32, offsets) -7%: each group's
// epilogue, the same work a panel whatever the run, weighs more there than the stream gains.
// Groups of 64 keep two panels too: SmolLM2 W4A8-G64 -4.4% with one (docs/benchmarks.md, session 40).
constexpr int64_t kStreamGroup = 128;
inline bool one_stream(const LinearArgs& a) { return a.groups == 1 || a.k / a.groups >= kStreamGroup; }

// W8A8 per channel (groups == 1) only: what the 3-row blocks run, without instancing grouped blocks
// no call reaches.
struct S8ChannelPanels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_AVX2_TARGET))) void go(int64_t r) const {
    s8_panel_block<R, P>(run, a.qa + r * a.k, a.k, a.sw + run.c0, a.sa + r, a.out + r * a.n + run.c0, a.n);
  }
};

struct S8Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_AVX2_TARGET))) void go(int64_t r) const {
    if (a.groups == 1)
      S8ChannelPanels{run, a}.template go<R, P>(r);
    else
      with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
        s8_group_block<R, P, decltype(acts)::value>(run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src, sa, a.out + r * a.n + run.c0, a.n);
      });
  }
};

struct U4Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_AVX2_TARGET))) void go(int64_t r) const {
    with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
      with_high_bits(a, [&](auto hb) {
        u4_panel_block<R, P, decltype(acts)::value, std::decay_t<decltype(src)>, decltype(hb)::value>(
            run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src, sa, a.out + r * a.n + run.c0, a.n);
      });
    });
  }
};


}  // namespace

__attribute__((target(CPK_AVX2_TARGET))) void w8a8_avx2(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  auto make = [&](int64_t p, int64_t np) { return S8Panels{panel_run(pw, quad_k(a.k), a.n, p, np, a.m <= kPrefetchRows), a}; };
  if (a.m == 1 && one_stream(a))
    for_each_run<1, 1>(a.m, p0, p1, make);
  else if (a.m == 1)
    for_each_run<1, 2>(a.m, p0, p1, make);
  else if (a.groups == 1)
    // Blocks of 3 rows per channel (each weight vector's |w| shared by one more row): +5-7% at M =
    // 512 and 16 on the 2B shape's linears, +1-4% at 8, against 2 rows; 4 rows measured as 2 (the
    // 16 ymm registers spill). In groups, 3 rows measured -1% to +3%: they keep 2 (the AVX2 case,
    // Zen 5 host, alternated in one process; docs/benchmarks.md, session 40).
    for_each_run<3, 1>(a.m, p0, p1, [&](int64_t p, int64_t np) { return S8ChannelPanels{make(p, np).run, a}; });
  else
    for_each_run<2, 1>(a.m, p0, p1, make);
}

__attribute__((target(CPK_AVX2_TARGET))) void w4a8_avx2(const LinearArgs& a, int64_t p0, int64_t p1) {
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  const int64_t per_column = a.high_bits != 0 ? int6_bytes_per_column(a.k) : a.k / 2;
  if (a.high_bits != 0 && a.m > kPrefetchRows) {  // prefill: each run widened once, signed int8
    thread_local std::vector<uint8_t> wide;
    wide.resize(kPanel * a.k);
    for_each_run<2, 1>(a.m, p0, p1, [&](int64_t p, int64_t np) {
      return S8Panels{widen_int6_run_halves(panel_run(pw, per_column, a.n, p, np), np, a.k, wide.data(), -32), a};
    });
    return;
  }
  auto make = [&](int64_t p, int64_t np) { return U4Panels{panel_run(pw, per_column, a.n, p, np, a.m <= kPrefetchRows), a}; };
  if (a.m == 1 && one_stream(a))
    for_each_run<1, 1>(a.m, p0, p1, make);
  else if (a.m == 1)
    for_each_run<1, 2>(a.m, p0, p1, make);
  else
    for_each_run<2, 1>(a.m, p0, p1, make);
}

__attribute__((target(CPK_AVX2_TARGET))) void quantize_row_avx2(const float* x, int64_t k, int64_t group, int8_t* q,
                                                                float* scale, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) vmax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), vmax);
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (float e : lanes) amax = std::fmax(amax, e);
  for (; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (i = 0; i + 8 <= k; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i n = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
  }
  for (; i < k; ++i) q[i] = quantize_value(x[i], s);
  group_sums(q, k, group, sums);
}

}  // namespace cpk
#endif  // __x86_64__
