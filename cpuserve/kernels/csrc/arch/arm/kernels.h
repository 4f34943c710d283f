// The aarch64 variants' table entries, one set of names per variant (<op>_<variant>); each is
// defined in the arch file of its variant. All read the two's-complement row layout (row_layout.h).
#pragma once

#include "../../variant.h"

namespace cpk {

void w8a8_neon(const LinearArgs& a, int64_t c0, int64_t c1);
void w4a8_neon(const LinearArgs& a, int64_t c0, int64_t c1);
void w8a8_neon_dotprod(const LinearArgs& a, int64_t c0, int64_t c1);
void w4a8_neon_dotprod(const LinearArgs& a, int64_t c0, int64_t c1);
void w8a8_neon_i8mm(const LinearArgs& a, int64_t c0, int64_t c1);
void w4a8_neon_i8mm(const LinearArgs& a, int64_t c0, int64_t c1);
// float_neon.cpp: the float panel kernel on q registers (every Armv8 variant's).
void float_linear_neon(const FloatArgs& a, int64_t p0, int64_t p1);
// attention_neon.cpp: decode attention in key blocks of 4 (attention_blocks.h), every Armv8 variant's.
void decode_attention_neon(const AttentionArgs& a, const Parallel& par);
// ... and prefill attention in query and key blocks (prefill_blocks.h).
void prefill_attention_neon(const PrefillArgs& a, const Parallel& par);
// dot_peak_arm.cpp: each variant's dot-peak loop (dot_peak.h) and its multiply-adds per round.
int64_t dot_peak_neon(int64_t rounds);
int64_t dot_peak_neon_dotprod(int64_t rounds);
int64_t dot_peak_neon_i8mm(int64_t rounds);
constexpr int64_t kDotPeakNeonMacs = 12 * 16, kDotPeakDotprodMacs = 12 * 16, kDotPeakI8mmMacs = 12 * 32;

}  // namespace cpk
