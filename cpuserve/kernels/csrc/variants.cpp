// THE variant table: one row per variant (its linear kernels, activation quantizer, decode
// attention, weight layouts, what the CPU must have, its scalar twin), and the lookups. A new ISA
// is one arch file, one row here and one feature bit (cpu_features.h and its arch's detector).
#include "float_panels.h"
#include "prefill_attention.h"
#include "quantize.h"
#include "twins.h"
#include "variant.h"
#if defined(__x86_64__)
#include "arch/x86/kernels.h"
#endif
#if defined(__aarch64__)
#include "arch/arm/kernels.h"
#endif
#include "cpu_features.h"

namespace cpk {

std::atomic<uint64_t> dispatch_counts[kMaxVariants][kOpCount];

void reset_dispatch_counts() {
  for (auto& row : dispatch_counts)
    for (auto& c : row) c.store(0, std::memory_order_relaxed);
}

namespace {

using I8 = Int8Layout;
using I4 = Int4Layout;
using QR = QuantizeRow;

// The scalar twins, one per layout. `generic` is also the variant every CPU runs.
extern const Variant kGeneric, kTwosComplementTwin, kOffsetPanelsTwin, kSignedPanelsTwin;
const Variant kGeneric{"generic", 0, 0, I8::SignedRows, I4::OffsetRows, w8a8_generic, w4a8_generic,
                       quantize_row_generic, decode_attention_generic, prefill_attention_generic, &kGeneric, true, float_panels_twin,
                       dot_peak_generic, kDotPeakGenericMacs};
const Variant kTwosComplementTwin{"generic_twos_complement", 1, 0, I8::SignedRows, I4::TwosComplementRows,
                                  w8a8_generic, w4a8_generic_twos_complement, quantize_row_generic,
                                  decode_attention_generic, prefill_attention_generic, &kTwosComplementTwin, true, float_panels_twin};
const Variant kOffsetPanelsTwin{"generic_offset_panels", 2, 0, I8::OffsetPanels, I4::OffsetPanels,
                                w8a8_generic_offset_panels, w4a8_generic_panels, quantize_row_generic,
                                decode_attention_generic, prefill_attention_generic, &kOffsetPanelsTwin, true, float_panels_twin,
                                nullptr, 0, 0, true};
const Variant kSignedPanelsTwin{"generic_signed_panels", 3, 0, I8::SignedPanels, I4::OffsetPanels,
                                w8a8_generic_signed_panels, w4a8_generic_panels, quantize_row_generic,
                                decode_attention_generic, prefill_attention_generic, &kSignedPanelsTwin, true, float_panels_twin,
                                nullptr, 0, 0, true};

// name, index, needs, int8 layout, int4 layout, w8a8, w4a8, quantizer, decode and prefill attention, twin, W4A8 exact,
// float linear, dot-peak loop and its multiply-adds per round, rows up to which the grouped kernels
// read scales and offsets as stored, whether its W4A8 kernel reads int6 panels
#if defined(__x86_64__)
const Variant kArch[] = {
    {"avx2", 4, kAvx2, I8::SignedPanels, I4::OffsetPanels, w8a8_avx2, w4a8_avx2, quantize_row_avx2,
     decode_attention_avx2, prefill_attention_avx2, &kSignedPanelsTwin, true, float_linear_avx2, dot_peak_avx2, kDotPeakAvx2Macs, 2, true},
    {"avx_vnni", 5, kAvx2 | kAvxVnni, I8::OffsetPanels, I4::OffsetPanels, w8a8_avx_vnni, w4a8_avx_vnni,
     quantize_row_avx2, decode_attention_avx2, prefill_attention_avx2, &kOffsetPanelsTwin, true, float_linear_avx2, dot_peak_avx_vnni,
     kDotPeakAvxVnniMacs, 2, true},
    {"avx512_vnni", 6, kAvx2 | kAvx512Vnni, I8::OffsetPanels, I4::OffsetPanels, w8a8_avx512_vnni, w4a8_avx512_vnni,
     quantize_row_avx512_vnni, decode_attention_avx512_vnni, prefill_attention_avx512_vnni, &kOffsetPanelsTwin, true, float_linear_avx512,
     dot_peak_avx512_vnni, kDotPeakAvx512VnniMacs, 2, true},
};
#elif defined(__aarch64__)
const Variant kArch[] = {
    {"neon", 4, 0, I8::SignedRows, I4::TwosComplementRows, w8a8_neon, w4a8_neon, QR(quantize_row_generic),
     decode_attention_neon, prefill_attention_neon, &kTwosComplementTwin, true, float_linear_neon, dot_peak_neon, kDotPeakNeonMacs},
    {"neon_dotprod", 5, kArmDotprod, I8::SignedRows, I4::TwosComplementRows, w8a8_neon_dotprod, w4a8_neon_dotprod,
     QR(quantize_row_generic), decode_attention_neon, prefill_attention_neon, &kTwosComplementTwin, true, float_linear_neon,
     dot_peak_neon_dotprod, kDotPeakDotprodMacs},
    {"neon_i8mm", 6, kArmDotprod | kArmI8mm, I8::SignedRows, I4::TwosComplementRows, w8a8_neon_i8mm, w4a8_neon_i8mm,
     QR(quantize_row_generic), decode_attention_neon, prefill_attention_neon, &kTwosComplementTwin, true, float_linear_neon,
     dot_peak_neon_i8mm, kDotPeakI8mmMacs},
};
#endif

}  // namespace

const std::vector<const Variant*>& compiled_variants() {
  static const std::vector<const Variant*> rows = [] {
    std::vector<const Variant*> v{&kGeneric};
#if defined(__x86_64__) || defined(__aarch64__)
    for (const Variant& row : kArch) v.push_back(&row);
#endif
    return v;
  }();
  return rows;
}

const std::vector<const Variant*>& all_variants() {
  static const std::vector<const Variant*> rows = [] {
    std::vector<const Variant*> v = compiled_variants();
    for (const Variant* twin : {&kTwosComplementTwin, &kOffsetPanelsTwin, &kSignedPanelsTwin}) v.push_back(twin);
    return v;
  }();
  return rows;
}

const Variant* variant_by_name(const std::string& name) {
  for (const Variant* v : all_variants())
    if (name == v->name) return v;
  return nullptr;
}

bool runs_here(const Variant& v) { return (v.needs & ~cpu_features()) == 0; }

const Variant& best_variant() {
  const Variant* best = &kGeneric;
  for (const Variant* v : compiled_variants())
    if (runs_here(*v)) best = v;
  return *best;
}

}  // namespace cpk
