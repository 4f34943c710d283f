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

// W8A8: w in the variant's int8 layout, scales [N, groups] in the layout's order (groups = 1:
// per channel; else groups of K / groups inputs, a multiple of 4). out [M, N] fp32.
void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets = nullptr, bool act_groups = false);
// W4A8: w in the variant's int4 layout, scales [N, groups] in the layout's order. out [M, N] fp32.
// offsets (both): fp32 groups x N in column chunks (variant.h), or null.
void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets = nullptr, bool act_groups = false);
// act_groups: activations quantized per group of the weight's (one int8 scale per token and group,
// as llama.cpp's Q8 activation blocks) instead of per token; only with groups > 1.
// Unquantized: w float panels [panels, K, 16] of wtype (float_panels.h), x widened to fp32 once.
// out [M, N] fp32.
void float_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, DType wtype, int64_t n,
                  float* out);
void decode_attention(const Variant& v, const Parallel& par, const AttentionArgs& a);

}  // namespace cpk
