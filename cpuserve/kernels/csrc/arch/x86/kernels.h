// The x86-64 variants' table entries, one set of names per variant (<op>_<variant>); each is
// defined in the arch file of its variant.
#pragma once

#include "../../variant.h"

namespace cpk {

// avx2.cpp: AVX2 + FMA, signed int8 panels, offset nibble panels.
void w8a8_avx2(const LinearArgs& a, int64_t p0, int64_t p1);
void w4a8_avx2(const LinearArgs& a, int64_t p0, int64_t p1);
void quantize_row_avx2(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums);
// attention_avx2.cpp: decode attention in key blocks of 8 (attention_blocks.h).
void decode_attention_avx2(const AttentionArgs& a, const Parallel& par);
// ... and prefill attention in query and key blocks (prefill_blocks.h).
void prefill_attention_avx2(const PrefillArgs& a, const Parallel& par);
// float_avx2.cpp: the float panel kernel on ymm (FMA, F16C widening), also avx_vnni's.
void float_linear_avx2(const FloatArgs& a, int64_t p0, int64_t p1);

// avx_vnni.cpp: AVX-VNNI (vpdpbusd on ymm), the VNNI panel bytes; AVX2's quantizer and attention.
void w8a8_avx_vnni(const LinearArgs& a, int64_t p0, int64_t p1);
void w4a8_avx_vnni(const LinearArgs& a, int64_t p0, int64_t p1);

// avx512_vnni.cpp: AVX-512 F/BW/VL/VNNI, offset int8 and nibble panels; attention_avx512.cpp: decode
// attention in key blocks of 16 (attention_blocks.h).
void w8a8_avx512_vnni(const LinearArgs& a, int64_t p0, int64_t p1);
void w4a8_avx512_vnni(const LinearArgs& a, int64_t p0, int64_t p1);
void quantize_row_avx512_vnni(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums);
void decode_attention_avx512_vnni(const AttentionArgs& a, const Parallel& par);
// ... and prefill attention in query and key blocks (prefill_blocks.h; bf16 pairs with AVX512_BF16).
void prefill_attention_avx512_vnni(const PrefillArgs& a, const Parallel& par);
// float_avx512.cpp: the float panel kernel on zmm.
void float_linear_avx512(const FloatArgs& a, int64_t p0, int64_t p1);

// amx.cpp: avx512_vnni's linears on AMX tiles for kAmxRows rows and more, where the CPU and the OS
// allow them (amx_usable) and set_amx has not turned them off. Each takes a thread's panels [p0, p1)
// and returns the first it did not do (p0 when the tiles do not take the linear; the rest is VNNI's).
constexpr int64_t kAmxRows = 16;
bool amx_usable();
bool amx_enabled();  // usable and switched on
bool amx_switched_on();  // the switch alone (no probe)
bool set_amx(bool on);  // returns the previous setting
uint64_t amx_tile_calls();  // kernel calls (a thread's panels) that ran on the tiles
int64_t w8a8_amx(const LinearArgs& a, int64_t p0, int64_t p1);
int64_t w4a8_amx(const LinearArgs& a, int64_t p0, int64_t p1);

// dot_peak_x86.cpp: each variant's dot-peak loop (dot_peak.h) and its multiply-adds per round.
int64_t dot_peak_avx2(int64_t rounds);
int64_t dot_peak_avx_vnni(int64_t rounds);
int64_t dot_peak_avx512_vnni(int64_t rounds);
constexpr int64_t kDotPeakAvx2Macs = 8 * 64, kDotPeakAvxVnniMacs = 12 * 32, kDotPeakAvx512VnniMacs = 12 * 64;

}  // namespace cpk
