// The torch-free driver of the quantized linears and decode attention: quantize the activations with
// the variant's quantizer, share the outputs (panels or columns) over the caller's threads, call the
// variant's kernels, count the call. The torch binding (qlinear.cpp) and kernel_check.cpp both run
// it, so what the check proves is what serves.
#pragma once

#include <cstdint>

#include "attention.h"
#include "float_types.h"
#include "variant.h"

namespace cpk {

// x [M, K] row-major in dtype.
struct LinearInput {
  const void* x;
  DType dtype;
  int64_t m, k;
};

// Where offset (group g, column c) of a linear with n outputs is: chunks of 16 columns [chunk][G][16],
// then the last n % 16 columns [G][tail] (variant.h; Python: quant/offsets_layout.py).
constexpr int kOffsetColumns = 16;
inline int64_t offsets_index(int64_t n, int64_t groups, int64_t g, int64_t c) {
  const int64_t full = n / kOffsetColumns * kOffsetColumns;
  if (c < full) return (c / kOffsetColumns) * kOffsetColumns * groups + g * kOffsetColumns + c % kOffsetColumns;
  return full * groups + g * (n - full) + (c - full);
}

// A linear's group scales or offsets as stored. F32: as the kernels read them. Coded (GGUF's blocks as
// the file holds them): an 8- or 16-bit code per group times an fp16 factor per super-block of `per`
// groups (super null: 1; the file's d, or -dmin, so fp16 loses nothing), in the same order as the
// fp32 values (supers: the same order over G / per groups). The driver expands them for a few panels
// at a time just before the kernels read them: bit-identical to fp32 storage (each product of an
// fp16 and an 8-bit integer is exact in fp32): a byte a code and 2 bytes a factor per 8 or 16 groups
// instead of 4 bytes a group (Q4_K from 6 to 4.625 bits a weight, Q6_K as int6 panels 6.56, the
// file's; an fp16 code, the simple types', 2 bytes).
enum class Code { F32, U8, I8, F16 };
struct GroupValues {
  const void* values = nullptr;  // null: none (offsets only)
  Code code = Code::F32;
  const F16* super = nullptr;  // fp16, as the file holds them (GGUF's d and -dmin: exact)
  int64_t per = 0;
  float super_at(int64_t i) const { return to_float(super[i]); }
  bool coded() const { return code != Code::F32 || super != nullptr; }
};
// scales in the layout's order; offsets in column chunks (offsets_index). A coded offset is
// mid * its group's scale + its coded value (GGUF's w = d sc (q - mid) + (mid d sc - dmin m)).
struct GroupScales {
  GroupValues scales, offsets;
  float mid = 0.f;
  // Groups per activation block (> 0) when these are a K-quant's integer codes (8-bit codes under a
  // factor per super-block, offsets the same or none, an integral mid): activations are then quantized
  // per super-block (llama.cpp's Q8_K), and the panel kernels fold each super-block's integer sums
  // in int32 (sum_g code_g * dot_g, sum_g ocode_g * gsum_g: group * per <= 256 keeps them below
  // 2^31 for any 8-bit codes) with one fma per super-block, not one float fold per group. 0: none.
  int64_t fold_per(int64_t group) const {
    auto integer = [](Code c) { return c == Code::U8 || c == Code::I8; };
    if (!integer(scales.code) || scales.super == nullptr || scales.per < 1 || group * scales.per > 256) return 0;
    if (offsets.values != nullptr &&
        (!integer(offsets.code) || offsets.super == nullptr || offsets.per != scales.per || !(mid >= 0.f) ||
         mid > 128.f || mid != float(int(mid))))
      return 0;
    return scales.per;
  }
  // The integer the folded sums add per activation of a group: mid with offsets, else 0.
  int32_t fold_mid() const { return offsets.values != nullptr ? int32_t(mid) : 0; }
};

// W8A8: w in the variant's int8 layout, scales [N, groups] in the layout's order (groups = 1:
// per channel; else groups of K / groups inputs, a multiple of 4). out [M, N] fp32.
void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets = nullptr, bool act_groups = false);
// W4A8: w in the variant's int4 layout, scales [N, groups] in the layout's order, groups of a
// multiple of 32 inputs (the avx2 block sums four 8-input steps in int16; the torch binding checks
// it). out [M, N] fp32.
// offsets (both): fp32 groups x N in column chunks (variant.h), or null.
void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets = nullptr, bool act_groups = false);
// The same with scales and offsets as GroupScales (coded or fp32).
void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const GroupScales& s,
                 int64_t groups, int64_t n, float* out, bool act_groups);
void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const GroupScales& s,
                 int64_t groups, int64_t n, float* out, bool act_groups, int64_t high_bits = 0);
// high_bits 2: w is int6 panels (panel_layout.h; Variant::int6), values in [-32, 31], groups of a
// multiple of 8 inputs.
// act_groups: activations quantized per group of the weight's (one int8 scale per token and group,
// as llama.cpp's Q8 activation blocks) instead of per token; only with groups > 1. A K-quant's
// integer codes (GroupScales::fold_per): one scale per token and super-block instead (Q8_K's).
// Unquantized: w float panels [panels, K, 16] of wtype (float_panels.h), x widened to fp32 once.
// out [M, N] fp32.
void float_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, DType wtype, int64_t n,
                  float* out);
void decode_attention(const Variant& v, const Parallel& par, const AttentionArgs& a);
void prefill_attention(const Variant& v, const Parallel& par, const PrefillArgs& a);

}  // namespace cpk
