// The variant table's row type: everything that differs between ISAs, resolved once (by name, in
// Python) to a row that every native op then receives. One row per variant in variants.cpp; the
// kernels behind the pointers live in arch/x86/, arch/arm/ and (the scalar twins) generic.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "dot_peak.h"
#include "float_types.h"
#include "parallel.h"

namespace cpk {

// How a variant stores W8A8 and W4A8 weights (row_layout.h, panel_layout.h).
enum class Int8Layout { SignedRows, SignedPanels, OffsetPanels };
enum class Int4Layout { OffsetRows, TwosComplementRows, OffsetPanels };

inline bool is_panels(Int8Layout l) { return l != Int8Layout::SignedRows; }
inline bool is_panels(Int4Layout l) { return l == Int4Layout::OffsetPanels; }

// One matmul's quantized operands. qa [M, K] int8 (rows readable 4 bytes past the last), sa [M]
// per-token scales; sums: the per-token per-group sums [M, groups] (the offset layouts' correction
// and the offsets' term; a channel-wise W8A8 has one group). w: the weight in the variant's layout,
// sw its scales [N, groups] in the layout's order (panel order for panel layouts; one group: [N]).
// offsets: per-group per-column additive terms, groups x N (w = s * q + offset, the GGUF formats
// with a minimum) in column chunks: [N / 16][groups][16], then [groups][N % 16] (a group's term for
// 16 neighbouring columns one vector, a chunk's terms one contiguous run), or null;
// the driver adds sa * sum_g offset * sums after the kernel.
// sa_groups (only with groups > 1): sa is [M, groups], one activation scale per token and group (as
// llama.cpp's Q8 activation blocks), folded into each group's weight scales. out [M, N] fp32.
struct GroupScales;  // linear_driver.h
struct LinearArgs {
  const int8_t* qa;
  const float* sa;
  const int32_t* sums;
  int64_t m, k;
  const void* w;
  const float* sw;
  int64_t groups, n;
  float* out;
  const float* offsets = nullptr;
  bool sa_groups = false;
  // Set (by the driver, for m <= the variant's direct_rows): the kernel reads the group scales and
  // offsets where they are stored, coded or not, and adds the offsets' term itself; sw and offsets
  // are then unused. A decode step's expanded copies and second pass cost as much as its weights.
  const GroupScales* direct = nullptr;
  // Set (with direct, by the driver on the panel layouts) for a K-quant's integer codes
  // (GroupScales::fold_per): sa is [M, groups / sa_per], one activation scale per super-block of
  // sa_per groups, and the grouped kernels fold each super-block's integer sums: out =
  // sum_b sa_b * (S_b * sum_g code_g * (dot_g + mid * gsum_g) + O_b * sum_g ocode_g * gsum_g).
  int64_t sa_per = 0;
  // 2: the W4A8 weight is int6 (panel_layout.h: the nibbles plus a 2-bit plane per panel, stored
  // w + 32); 0: int4. Only on variants with Variant::int6.
  int64_t high_bits = 0;
};

// One unquantized matmul: x [M, K] fp32, w float panels [panels, K, 16] of wtype (float_panels.h),
// out [M, N] fp32.
struct FloatArgs {
  const float* x;
  int64_t m, k;
  const void* w;
  DType wtype;
  int64_t n;
  float* out;
};

struct AttentionArgs;  // attention.h
struct PrefillArgs;    // prefill_attention.h

// Output columns [begin, end) (row layouts) or panels [begin, end) (panel layouts) of a linear.
using LinearKernel = void (*)(const LinearArgs&, int64_t begin, int64_t end);
// One token: scale, int8 values and per-group sums (group 0: none), bit-identical to the twin.
using QuantizeRow = void (*)(const float* x, int64_t k, int64_t group, int8_t* q, float* scale, int32_t* sums);
using DecodeAttention = void (*)(const AttentionArgs&, const Parallel&);
using PrefillAttention = void (*)(const PrefillArgs&, const Parallel&);
// Float panels [begin, end) of an unquantized linear.
using FloatKernel = void (*)(const FloatArgs&, int64_t begin, int64_t end);

struct Variant {
  const char* name;
  int index;       // its row in the dispatch counters
  uint32_t needs;  // cpu_features.h bits the CPU must have
  Int8Layout int8;
  Int4Layout int4;
  LinearKernel w8a8, w4a8;
  QuantizeRow quantize_row;
  DecodeAttention decode_attention;
  PrefillAttention prefill_attention;
  const Variant* twin;  // the scalar twin of its layouts (itself for a twin)
  bool w4_exact;        // W4A8 bit-identical to the twin (else within kernel_check's budget)
  FloatKernel float_linear;  // unquantized linears (float_panels.h; the twin: float_panels_twin)
  DotPeak dot_peak = nullptr;  // its dot instructions' peak loop (dot_peak.h); the twins have none
  int64_t dot_peak_macs = 0;   // multiply-adds per round of that loop
  int64_t direct_rows = 0;     // its grouped panel kernels read LinearArgs::direct for up to this many rows
  bool int6 = false;           // its W4A8 kernel reads int6 panels (LinearArgs::high_bits)
};

// The ops counted per variant: one relaxed atomic increment per call, so a test can show which
// row served every native op.
enum Op { kW8A8, kW4A8, kQuantize, kDecodeAttention, kRmsNorm, kAddRmsNorm, kRope, kSiluMul, kFloatLinear, kGeluMul, kPrefillAttention, kOpCount };
inline const char* op_name(int op) {
  static const char* names[kOpCount] = {"w8a8_linear", "w4a8_linear", "quantize_rows",  "decode_attention",
                                        "rms_norm",    "add_rms_norm", "rope",          "silu_mul",     "float_linear",
                                        "gelu_tanh_mul", "prefill_attention"};
  return names[op];
}

constexpr int kMaxVariants = 16;
extern std::atomic<uint64_t> dispatch_counts[kMaxVariants][kOpCount];
inline void count(const Variant& v, Op op) { dispatch_counts[v.index][op].fetch_add(1, std::memory_order_relaxed); }
void reset_dispatch_counts();

// The selectable variants compiled for this architecture, generic first, then best last.
const std::vector<const Variant*>& compiled_variants();
// Every row, the twins included (for lookups and the counters).
const std::vector<const Variant*>& all_variants();
const Variant* variant_by_name(const std::string& name);
bool runs_here(const Variant& v);
// The best selectable variant this CPU runs.
const Variant& best_variant();

}  // namespace cpk
