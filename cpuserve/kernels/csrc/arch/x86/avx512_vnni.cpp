// avx512_vnni: the panel kernels on zmm registers (vpdpbusd multiplies the unsigned weight by the
// signed activation; the offsets come back as -128 * sum(a) for W8A8 and -8 * sum(a over the group)
// for W4A8 in every accumulator lane at the start, (mid - 128) and (mid - 8) times the sum in a
// K-quant's integer fold) and the activation quantizer. Blocks of 3 tokens
// x 4 panels for prefill: ~390 GMAC/s of the ~460 peak of 2 Zen 4 cores (docs/kernels.md). Integer
// sums are exact and the epilogues are the panel twin's (panel_twin.h): bit-identical to it.
#if defined(__x86_64__)

#include <vector>

#include "../../quantize.h"
#include "../../scale_codes.h"
#include "kernels.h"
#include "panel_runs.h"

#define CPK_VNNI_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,f16c"

namespace cpk {
namespace {

// vbroadcastss from memory, a load-port operation (set1 of a loaded int went through a general
// register: a load, then a vpbroadcastd, per broadcast).
__attribute__((target(CPK_VNNI_TARGET))) inline __m512i broadcast4(const int8_t* p) {
  return _mm512_castps_si512(_mm512_broadcastss_ps(_mm_load_ss(reinterpret_cast<const float*>(p))));
}

// A run's P weight streams as pointers advanced a step at a time (no multiply per load; the
// compiler kept reloading run's fields and multiplying), each step's bytes prefetched a run ahead.
template <int P>
struct Streams {
  const uint8_t* at[P];
  __mmask64 load[P];
  int64_t step[P];
  int64_t ahead;
  __attribute__((target(CPK_VNNI_TARGET), always_inline)) explicit Streams(const PanelRun& run) : ahead(run.ahead) {
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      at[i] = run.base[i];
      load[i] = run.load[i];
      step[i] = run.step[i];
    }
  }
  __attribute__((target(CPK_VNNI_TARGET), always_inline)) __m512i next(int i) {
    const __m512i v = _mm512_maskz_loadu_epi8(load[i], at[i]);
    if (ahead != 0) prefetch_l2(at[i], ahead);
    at[i] += step[i];
    return v;
  }
};

template <int P>
__attribute__((target(CPK_VNNI_TARGET))) inline void store_panels(float* out, const __m512 (&v)[P], __mmask16 last) {
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i) {
    if (i == P - 1)
      _mm512_mask_storeu_ps(out + i * kPanel, last, v[i]);
    else
      _mm512_storeu_ps(out + i * kPanel, v[i]);
  }
}

// Panel i's scales s and offsets o (Stored with offsets) of group g, in super-blocks sb and ob
// (scale_codes::super_block, once a group: a division per panel cost as much as its weights).
template <typename Groups>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void group_values(const PanelRun& run,
                                                                                const Groups& src, int i,
                                                                                int64_t groups, int64_t g,
                                                                                int64_t sb, int64_t ob,
                                                                                __mmask16 live, __m512& s,
                                                                                __m512& o) {
  if constexpr (!Groups::kStored) {
    src.request_next(run, i, groups, g);
    s = _mm512_maskz_loadu_ps(live, src.group(run, i, groups, g));
  } else if (run.width[i] == kPanel) {
    scale_codes::group16(src.gs, src.at[i], g, sb, ob, s, o);
  } else {
    float sv[kPanel], ov[kPanel];
    scale_codes::narrow_group(src.gs, src.at[i], run.width[i], g, sv, ov);
    s = _mm512_loadu_ps(sv);
    o = _mm512_loadu_ps(ov);
  }
}

// The grouped blocks' float side (W4A8, grouped W8A8): group g's int32 sums folded into the float
// sums (times the token's group scale when activations are scaled per group: PG), and at the end the
// sums stored, times the token scale unless PG. The panel twin's fmas, in its order. With stored
// offsets, the offsets' term (offset * group sum of the activations, times the group scale if PG)
// summed per group and added at the end: the driver's offsets pass (linear_driver.cpp), same bits.
template <int R, int P, bool PG, typename Groups>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void fold_group(
    const PanelRun& run, const __m512i (&acc)[R][P], const Groups& src, const int32_t* gs, int64_t groups, int64_t g,
    const float* sa, __m512 (&facc)[R][P], __m512 (&oacc)[R][P]) {
  int64_t sb = 0, ob = 0;
  if constexpr (Groups::kStored) {
    sb = scale_codes::super_block(src.gs.scales, g);
    ob = scale_codes::super_block(src.gs.offsets, g);
    for (int i = 0; i < src.prefetch; ++i) scale_codes::prefetch_group(src.gs, src.next[i], g, sb, ob);
  }
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i) {
    __m512 s, o = _mm512_setzero_ps();
    group_values(run, src, i, groups, g, sb, ob, i == P - 1 ? run.store_last : __mmask16(0xFFFF), s, o);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 sr = PG ? _mm512_mul_ps(s, _mm512_set1_ps(sa[r * groups + g])) : s;
      facc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][i]), sr, facc[r][i]);
      if constexpr (Groups::kStored) {
        if (!src.offsets) continue;
        const float gsum = float(gs[r * groups + g]);  // the driver's offsets_weight, one fma
        oacc[r][i] = _mm512_fmadd_ps(o, _mm512_set1_ps(PG ? gsum * sa[r * groups + g] : gsum), oacc[r][i]);
      }
    }
  }
}

template <int R, int P, bool PG, typename Groups>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void store_group(const PanelRun& run,
                                                                               const Groups& src,
                                                                               const __m512 (&facc)[R][P],
                                                                               const __m512 (&oacc)[R][P],
                                                                               const float* sa, float* out,
                                                                               int64_t n) {
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512 v[P];
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      v[i] = PG ? facc[r][i] : _mm512_mul_ps(facc[r][i], _mm512_set1_ps(sa[r]));
      if constexpr (Groups::kStored) {
        if (src.offsets) v[i] = _mm512_add_ps(v[i], PG ? oacc[r][i] : _mm512_mul_ps(oacc[r][i], _mm512_set1_ps(sa[r])));
      }
    }
    store_panels<P>(out + r * n, v, run.store_last);
  }
}

// The integer fold (Acts kFold): group g's int32 sums acc times its codes into the super-block's
// integer sums iacc (and the offsets' codes times the group sums into macc); when g closes super-block
// b, t = float(iacc) * S (+ float(macc) * O, fused) and facc += t * sa_b (fused), then both restart.
// The panel twin's fold_output, lane for lane.
template <int R, int P>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void fold_int(
    const PanelRun& run, const __m512i (&acc)[R][P], const StoredGroups& src, const int32_t* gs, int64_t groups,
    int64_t g, FoldAt& at, const float* sa, __m512i (&iacc)[R][P], __m512i (&macc)[R][P], __m512 (&facc)[R][P]) {
  for (int i = 0; i < src.prefetch; ++i) scale_codes::prefetch_group(src.gs, src.next[i], g, at.b, at.b);
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i) {
    __m512i sc, oc;
    scale_codes::fold_codes16(src.gs, src.at[i], run.width[i], g, sc, oc);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      iacc[r][i] = _mm512_add_epi32(iacc[r][i], _mm512_mullo_epi32(acc[r][i], sc));
      if (src.offsets) macc[r][i] = _mm512_add_epi32(macc[r][i], _mm512_mullo_epi32(oc, _mm512_set1_epi32(gs[r * groups + g])));
    }
  }
  const int64_t b = at.b;
  if (!at.closes(src.per)) return;
  ++at.b;
  const int64_t blocks = groups / src.per;
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i) {
    __m512 S, O;
    scale_codes::fold_supers16(src.gs, src.at[i], run.width[i], b, S, O);
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r][i]), S);
      if (src.offsets) t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(macc[r][i]), O, t);
      facc[r][i] = _mm512_fmadd_ps(t, _mm512_set1_ps(sa[r * blocks + b]), facc[r][i]);
      iacc[r][i] = macc[r][i] = _mm512_setzero_si512();
    }
  }
}

// A grouped block's side per group (A: Acts): the float fold, or the integer fold.
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void end_group(
    const PanelRun& run, const __m512i (&acc)[R][P], const Groups& src, const int32_t* gs, int64_t groups, int64_t g,
    FoldAt& at, const float* sa, __m512i (&iacc)[R][P], __m512i (&macc)[R][P], __m512 (&facc)[R][P],
    __m512 (&oacc)[R][P]) {
  if constexpr (A == kFold) {
    if constexpr (Groups::kStored) fold_int<R, P>(run, acc, src, gs, groups, g, at, sa, iacc, macc, facc);
  } else {
    fold_group<R, P, A == kPerGroup>(run, acc, src, gs, groups, g, sa, facc, oacc);
  }
}

// The end of a grouped block: the sums stored (the fold's already scaled and offset).
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_VNNI_TARGET), always_inline)) inline void end_block(const PanelRun& run,
                                                                             const Groups& src,
                                                                             const __m512 (&facc)[R][P],
                                                                             const __m512 (&oacc)[R][P],
                                                                             const float* sa, float* out, int64_t n) {
  if constexpr (A == kFold) {
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_panels<P>(out + r * n, facc[r], run.store_last);
  } else {
    store_group<R, P, A == kPerGroup>(run, src, facc, oacc, sa, out, n);
  }
}

// W8A8: R rows (qa [R, K], row sums asum) x P panels -> out rows (stride n), scaled by column scales sw
// (of the run's columns) and row scales sa: (float(dot) * sw[c]) * sa[r], the twin's epilogue.
template <int R, int P>
__attribute__((target(CPK_VNNI_TARGET))) inline void u8_panel_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* asum, int64_t k, const float* sw,
                                                                    const float* sa, float* out, int64_t n) {
  __m512i acc[R][P];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) acc[r][i] = _mm512_set1_epi32(-128 * asum[r]);
  const int64_t quads = quad_k(k) / 4;
  Streams<P> w(run);
  for (int64_t j = 0; j < quads; ++j) {
    __m512i a[R];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) a[r] = broadcast4(qa + r * k + 4 * j);
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      const __m512i v = w.next(i);
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], v, a[r]);
    }
  }
  __m512 s[P];
  #pragma GCC unroll 4
  for (int i = 0; i < P; ++i)
    s[i] = _mm512_maskz_loadu_ps(i == P - 1 ? run.store_last : __mmask16(0xFFFF), sw + i * kPanel);
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    __m512 v[P];
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i)
      v[i] = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][i]), s[i]), _mm512_set1_ps(sa[r]));
    store_panels<P>(out + r * n, v, run.store_last);
  }
}

// W8A8 in groups (groups > 1: K / groups inputs each, whole quads): R rows (group sums gs [R, groups])
// x P panels, scales from src; out = sa[r] * sum_g s_g * dot_g, the twin's fmas.
template <int R, int P, int A, typename Groups>
__attribute__((target(CPK_VNNI_TARGET))) inline void u8_group_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* gs, int64_t k, int64_t groups,
                                                                    const Groups& src, const float* sa, float* out,
                                                                    int64_t n) {
  const int64_t quads = k / groups / 4;  // quads per group
  const int32_t start = acc_start<A>(src, 128);
  __m512 facc[R][P], oacc[R][P];
  __m512i iacc[R][P], macc[R][P];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      facc[r][i] = oacc[r][i] = _mm512_setzero_ps();
      iacc[r][i] = macc[r][i] = _mm512_setzero_si512();
    }
  FoldAt at(A == kFold ? fold_per(src) : 1);
  Streams<P> w(run);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m512i acc[R][P];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i] = _mm512_set1_epi32(start * gs[r * groups + g]);
    for (int64_t j = g * quads; j < (g + 1) * quads; ++j) {
      __m512i a[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) a[r] = broadcast4(qa + r * k + 4 * j);
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        const __m512i v = w.next(i);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], v, a[r]);
      }
    }
    end_group<R, P, A>(run, acc, src, gs, groups, g, at, sa, iacc, macc, facc, oacc);
  }
  end_block<R, P, A>(run, src, facc, oacc, sa, out, n);
}

// An int6 weight's 2-bit planes (panel_layout.h), one 32-byte step a panel per 8 inputs, joined into
// the nibble vectors: lo's lanes take bits 0-1 (lanes 0-31) and 2-3 (32-63) of their byte, hi's
// bits 4-5 and 6-7, each moved to bits 4-5 by a per-16-bit-lane shift and masked.
template <int P>
struct Planes {
  const uint8_t* at[P];
  int64_t ahead;
  __attribute__((target(CPK_VNNI_TARGET), always_inline)) Planes(const PanelRun& run, int64_t k) : ahead(run.ahead) {
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) at[i] = run.base[i] + kPanel * (k / 2);
  }
  __attribute__((target(CPK_VNNI_TARGET), always_inline)) void join(int i, __m512i& lo, __m512i& hi) {
    const __m512i bits = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at[i])));
    if (ahead != 0) prefetch_l2(at[i], ahead);
    at[i] += kInt6PlaneStep;
    constexpr long long kBy4 = 0x0004000400040004LL, kBy2 = 0x0002000200020002LL;  // per 16-bit lane
    const __m512i two = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_set_epi64(kBy2, kBy2, kBy2, kBy2, kBy4, kBy4, kBy4, kBy4);  // bytes 0-31: 4
    const __m512i down = _mm512_set_epi64(kBy2, kBy2, kBy2, kBy2, 0, 0, 0, 0);
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(bits, up), two));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(bits, down), two));
  }
};

// W4A8: R rows (qa [R, K], group sums gs [R, groups]) x P panels, scales from src. out = sa[r] *
// sum_g s_g * dot_g. HB 2: int6 panels (the nibbles plus their planes, stored w + 32).
template <int R, int P, int A, typename Groups, int HB = 0>
__attribute__((target(CPK_VNNI_TARGET))) inline void u4_panel_block(const PanelRun& run, const int8_t* qa,
                                                                    const int32_t* gs, int64_t k, int64_t groups,
                                                                    const Groups& src, const float* sa, float* out,
                                                                    int64_t n) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t steps = k / groups / 8;  // 8-input steps per group
  const int32_t start = acc_start<A>(src, 8 << HB);
  Planes<P> planes(run, k);
  __m512 facc[R][P], oacc[R][P];
  __m512i iacc[R][P], macc[R][P];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      facc[r][i] = oacc[r][i] = _mm512_setzero_ps();
      iacc[r][i] = macc[r][i] = _mm512_setzero_si512();
    }
  FoldAt at(A == kFold ? fold_per(src) : 1);
  Streams<P> w(run);
  for (int64_t g = 0; g < groups; ++g) {
    request_group<P>(run, src, groups, g + 1);
    __m512i acc[R][P];
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) acc[r][i] = _mm512_set1_epi32(start * gs[r * groups + g]);
    for (int64_t j = g * steps; j < (g + 1) * steps; ++j) {
      __m512i alo[R], ahi[R];
      #pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        alo[r] = broadcast4(qa + r * k + 8 * j);
        ahi[r] = broadcast4(qa + r * k + 8 * j + 4);
      }
      #pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        const __m512i v = w.next(i);
        __m512i lo = _mm512_and_si512(v, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (HB != 0) planes.join(i, lo, hi);
        #pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], lo, alo[r]);
          acc[r][i] = _mm512_dpbusd_epi32(acc[r][i], hi, ahi[r]);
        }
      }
    }
    end_group<R, P, A>(run, acc, src, gs, groups, g, at, sa, iacc, macc, facc, oacc);
  }
  end_block<R, P, A>(run, src, facc, oacc, sa, out, n);
}

struct U8Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_VNNI_TARGET))) void go(int64_t r) const {
    if (a.groups == 1)
      u8_panel_block<R, P>(run, a.qa + r * a.k, a.sums + r, a.k, a.sw + run.c0, a.sa + r, a.out + r * a.n + run.c0,
                           a.n);
    else
      with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
        u8_group_block<R, P, decltype(acts)::value>(run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src,
                                                    sa, a.out + r * a.n + run.c0, a.n);
      });
  }
};

struct U4Panels {
  PanelRun run;
  const LinearArgs& a;
  template <int R, int P>
  __attribute__((target(CPK_VNNI_TARGET))) void go(int64_t r) const {
    with_acts(a, run, P, r, [&](const auto& src, const float* sa, auto acts) {
      with_high_bits(a, [&](auto hb) {
        u4_panel_block<R, P, decltype(acts)::value, std::decay_t<decltype(src)>, decltype(hb)::value>(
            run, a.qa + r * a.k, a.sums + r * a.groups, a.k, a.groups, src, sa, a.out + r * a.n + run.c0, a.n);
      });
    });
  }
};

// Int6 panels in prefill: a run's panels widened once to int8 offset panels (w + 128 = the stored
// w + 32, plus 96) in a thread buffer, then the W8A8 blocks over them (U8Panels). Joining the planes in
// every block cost as many vector operations as its dot products (2B Q5_K_M prefill -25%);
// widened, they are paid once per run and pass of rows. The same integers, folded by the same code:
// the same bits.
__attribute__((target(CPK_VNNI_TARGET))) PanelRun widen_int6_run(const PanelRun& run, int64_t np, int64_t k,
                                                                  uint8_t* dst) {
  const __m512i low = _mm512_set1_epi8(0x0F), lift = _mm512_set1_epi8(96);
  PanelRun wide = run;
  wide.ahead = 0;
  Planes<4> planes(wide, k);  // no prefetching: the run is read once, now
  for (int64_t i = 0; i < np; ++i) {
    uint8_t* out = dst + i * kPanel * k;
    for (int64_t j = 0; j < k / kInt4StepInputs; ++j) {
      const __m512i v = _mm512_loadu_si512(run.base[i] + j * 4 * kPanel);
      __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      planes.join(int(i), lo, hi);
      _mm512_storeu_si512(out + j * 8 * kPanel, _mm512_add_epi8(lo, lift));  // quad 2j
      _mm512_storeu_si512(out + j * 8 * kPanel + 4 * kPanel, _mm512_add_epi8(hi, lift));  // quad 2j + 1
    }
    wide.base[i] = out;
    wide.step[i] = 4 * kPanel;
  }
  return wide;
}


}  // namespace

// W8A8 panels [p0, p1) (offset panels) for all M rows.
__attribute__((target(CPK_VNNI_TARGET))) void w8a8_avx512_vnni(const LinearArgs& a, int64_t p0, int64_t p1) {
  if ((p0 = w8a8_amx(a, p0, p1)) == p1) return;  // AMX tiles where they take it (amx.cpp)
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  auto make = [&](int64_t p, int64_t np) { return U8Panels{panel_run(pw, quad_k(a.k), a.n, p, np, a.m <= kPrefetchRows), a}; };
  if (a.m <= kStreamRows)
    for_each_run<3, 1>(a.m, p0, p1, make);  // one contiguous stream (panel_runs.h)
  else
    for_each_run<3, 4>(a.m, p0, p1, make);
}

// W4A8 panels [p0, p1) with scales in panel order, for all M rows.
__attribute__((target(CPK_VNNI_TARGET))) void w4a8_avx512_vnni(const LinearArgs& a, int64_t p0, int64_t p1) {
  if ((p0 = w4a8_amx(a, p0, p1)) == p1) return;  // AMX tiles where they take it (amx.cpp)
  const uint8_t* pw = static_cast<const uint8_t*>(a.w);
  const int64_t per_column = a.high_bits != 0 ? int6_bytes_per_column(a.k) : a.k / 2;
  if (a.high_bits != 0 && a.m > kPrefetchRows) {  // prefill: each run widened once (widen_int6_run)
    thread_local std::vector<uint8_t> wide;
    wide.resize(4 * kPanel * a.k);
    for_each_run<3, 4>(a.m, p0, p1, [&](int64_t p, int64_t np) {
      return U8Panels{widen_int6_run(panel_run(pw, per_column, a.n, p, np), np, a.k, wide.data()), a};
    });
    return;
  }
  auto make = [&](int64_t p, int64_t np) { return U4Panels{panel_run(pw, per_column, a.n, p, np, a.m <= kPrefetchRows), a}; };
  if (a.m <= kStreamRows)
    for_each_run<3, 1>(a.m, p0, p1, make);  // one contiguous stream (panel_runs.h)
  else
    for_each_run<3, 4>(a.m, p0, p1, make);
}

// max_ps(a, b) returns b when a is NaN: with the running maximum (or the clamp bound) second, NaN
// inputs are skipped (amax) or become -127 (clamp), as in the twin.
__attribute__((target("avx512f,avx512bw"))) void quantize_row_avx512_vnni(const float* x, int64_t k, int64_t group,
                                                                          int8_t* q, float* scale, int32_t* sums) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) vmax = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), vmax);
  float amax = _mm512_reduce_max_ps(vmax);
  for (; i < k; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float s = std::fmax(amax, 1e-8f) / 127.0f;
  *scale = s;
  const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (i = 0; i + 16 <= k; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
  for (; i < k; ++i) q[i] = quantize_value(x[i], s);
  group_sums(q, k, group, sums);
}

}  // namespace cpk
#endif  // __x86_64__
