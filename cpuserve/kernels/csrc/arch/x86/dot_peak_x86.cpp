// The x86 dot-peak loops (dot_peak.h): each the fastest int8 step its variant's kernels use, in
// independent chains. avx2 has no int8 dot instruction: its W4A8 step, two vpmaddubsw summed in 16
// bits (vpaddw), then vpmaddwd by ones and vpaddd (64 multiply-adds per ymm step; W8A8's step adds a
// vpsignb and sums 32), in 8 chains. Since session 43 the avx2 4-bit block widens with vpmaddwd once
// every four such steps (docs/benchmarks.md), so its percentages of this loop can exceed 100; the
// loop stays as it was, so the figures stay comparable across sessions (only the 1-cycle add is loop-carried; 8 accumulators, the
// operands and two temporaries fit the 16 ymm registers). The VNNI variants: one vpdpbusd (32 per
// ymm, 64 per zmm) in 12 chains, enough to cover its latency at its throughput. Each step is one
// volatile asm statement on a local accumulator: exactly the named instructions, none merged or
// dropped, no spills or register copies (GCC keeps an accumulator array in memory, and copies around
// intrinsic vpdpbusd in a loop).
#if defined(__x86_64__)
#include <immintrin.h>

#include <cstring>
#include <initializer_list>

#include "kernels.h"

namespace cpk {
namespace {

template <typename V>
int64_t lane_sum(std::initializer_list<V> acc) {
  int64_t sum = 0;
  for (const V& c : acc) {
    int32_t lanes[sizeof(V) / 4];
    std::memcpy(lanes, &c, sizeof(V));
    for (int32_t v : lanes) sum += v;
  }
  return sum;
}

}  // namespace

#define CPK_AVX2_STEP(acc)                                                                             \
  do {                                                                                                 \
    __m256i t, u;                                                                                      \
    asm volatile(                                                                                      \
        "vpmaddubsw %[a], %[a], %[t]\n\tvpmaddubsw %[a], %[a], %[u]\n\tvpaddw %[u], %[t], %[t]\n\t" \
        "vpmaddwd %[ones], %[t], %[t]\n\tvpaddd %[t], %[c], %[c]"                                      \
        : [c] "+x"(acc), [t] "=&x"(t), [u] "=&x"(u)                                                    \
        : [a] "x"(a), [ones] "x"(ones));                                                               \
  } while (0)

__attribute__((target("avx2,fma"))) int64_t dot_peak_avx2(int64_t rounds) {
  const __m256i a = _mm256_set1_epi8(1), ones = _mm256_set1_epi16(1), z = _mm256_setzero_si256();
  __m256i c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z;
  for (int64_t r = 0; r < rounds; ++r) {
    CPK_AVX2_STEP(c0);
    CPK_AVX2_STEP(c1);
    CPK_AVX2_STEP(c2);
    CPK_AVX2_STEP(c3);
    CPK_AVX2_STEP(c4);
    CPK_AVX2_STEP(c5);
    CPK_AVX2_STEP(c6);
    CPK_AVX2_STEP(c7);
  }
  return lane_sum({c0, c1, c2, c3, c4, c5, c6, c7});
}

// `insn` on twelve local accumulators per round (V: the register type, R: its asm constraint).
#define CPK_DOT_PEAK_12(V, zero, a, R, insn)                                                             \
  V c0 = zero, c1 = zero, c2 = zero, c3 = zero, c4 = zero, c5 = zero, c6 = zero, c7 = zero, c8 = zero,  \
    c9 = zero, c10 = zero, c11 = zero;                                                                   \
  for (int64_t r = 0; r < rounds; ++r) {                                                                 \
    asm volatile(insn : [c] "+" R(c0) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c1) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c2) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c3) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c4) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c5) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c6) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c7) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c8) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c9) : [a] R(a));                                                       \
    asm volatile(insn : [c] "+" R(c10) : [a] R(a));                                                      \
    asm volatile(insn : [c] "+" R(c11) : [a] R(a));                                                      \
  }                                                                                                      \
  return lane_sum({c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11})

__attribute__((target("avx2,fma,avxvnni"))) int64_t dot_peak_avx_vnni(int64_t rounds) {
  const __m256i a = _mm256_set1_epi8(1);
  CPK_DOT_PEAK_12(__m256i, _mm256_setzero_si256(), a, "x", "%{vex%} vpdpbusd %[a], %[a], %[c]");
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int64_t dot_peak_avx512_vnni(int64_t rounds) {
  const __m512i a = _mm512_set1_epi8(1);
  CPK_DOT_PEAK_12(__m512i, _mm512_setzero_si512(), a, "v", "vpdpbusd %[a], %[a], %[c]");
}

}  // namespace cpk
#endif
