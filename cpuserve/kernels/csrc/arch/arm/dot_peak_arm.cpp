// The Arm dot-peak loops (dot_peak.h): each the int8 step its variant's kernels use, in 12
// independent chains. neon has no int8 dot instruction: smull + smlal + sadalp, as its kernels (16
// multiply-adds per step); dotprod one sdot (16); i8mm one smmla (a 2x8 by 8x2 tile: 32). Each step is one volatile asm statement on a local
// accumulator: exactly the named instructions, none merged or dropped (as the x86 loops).
#if defined(__aarch64__)
#include <arm_neon.h>

#include "dotprod.h"
#include "kernels.h"

namespace cpk {

// `insn` on twelve local accumulators per round (operands %[c] the accumulator, %[a] the ones).
#define CPK_ARM_PEAK_12(insn, ...)                                                                       \
  const int8x16_t a = vdupq_n_s8(1);                                                                     \
  const int32x4_t z = vdupq_n_s32(0);                                                                    \
  int32x4_t c0 = z, c1 = z, c2 = z, c3 = z, c4 = z, c5 = z, c6 = z, c7 = z, c8 = z, c9 = z, c10 = z,     \
            c11 = z;                                                                                     \
  for (int64_t r = 0; r < rounds; ++r) {                                                                 \
    asm volatile(insn : [c] "+w"(c0) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c1) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c2) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c3) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c4) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c5) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c6) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c7) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c8) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c9) __VA_ARGS__ : [a] "w"(a));                                          \
    asm volatile(insn : [c] "+w"(c10) __VA_ARGS__ : [a] "w"(a));                                         \
    asm volatile(insn : [c] "+w"(c11) __VA_ARGS__ : [a] "w"(a));                                         \
  }                                                                                                      \
  int64_t sum = 0;                                                                                       \
  for (int32x4_t c : {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11}) sum += vaddvq_s32(c);          \
  return sum

int64_t dot_peak_neon(int64_t rounds) {
  int16x8_t t;
  CPK_ARM_PEAK_12("smull %[t].8h, %[a].8b, %[a].8b\n\tsmlal2 %[t].8h, %[a].16b, %[a].16b\n\tsadalp %[c].4s, %[t].8h", ,
                  [t] "=&w"(t));
}

__attribute__((target(CPK_DOTPROD_TARGET))) int64_t dot_peak_neon_dotprod(int64_t rounds) {
  CPK_ARM_PEAK_12("sdot %[c].4s, %[a].16b, %[a].16b");
}

__attribute__((target(CPK_I8MM_TARGET))) int64_t dot_peak_neon_i8mm(int64_t rounds) {
  CPK_ARM_PEAK_12("smmla %[c].4s, %[a].16b, %[a].16b");
}

}  // namespace cpk
#endif
