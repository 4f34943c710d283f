// The scalar twins' entries in the variant table: the row layouts (offset nibbles: the `generic`
// variant; two's-complement: the Arm variants' twin), the panel layouts (the x86 variants' twins) and
// decode attention at the baseline ISA.
#include "attention.h"
#include "prefill_attention.h"
#include "linear_rows.h"
#include "panel_twin.h"
#include "quantize.h"
#include "twins.h"

namespace cpk {

inline float row_u4_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  return row_generic<dot_u4_generic>(a, w, s, groups, group);
}
inline float row_s4_generic(const int8_t* a, const uint8_t* w, const float* s, int64_t groups, int64_t group) {
  return row_generic<dot_s4_generic>(a, w, s, groups, group);
}

void w8a8_generic(const LinearArgs& a, int64_t c0, int64_t c1) { w8a8_rows<dot_i8_generic>(a, c0, c1); }
void w4a8_generic(const LinearArgs& a, int64_t c0, int64_t c1) { w4a8_rows<row_u4_generic, nullptr, true>(a, c0, c1); }
void w4a8_generic_twos_complement(const LinearArgs& a, int64_t c0, int64_t c1) {
  w4a8_rows<row_s4_generic, nullptr, false>(a, c0, c1);
}
void w8a8_generic_offset_panels(const LinearArgs& a, int64_t p0, int64_t p1) { w8a8_panels_twin<true>(a, p0, p1); }
void w8a8_generic_signed_panels(const LinearArgs& a, int64_t p0, int64_t p1) { w8a8_panels_twin<false>(a, p0, p1); }
void w4a8_generic_panels(const LinearArgs& a, int64_t p0, int64_t p1) { w4a8_panels_twin(a, p0, p1); }

CPK_PORTABLE_ATTENTION(decode_attention_generic, )
CPK_PORTABLE_PREFILL(prefill_attention_generic, )

}  // namespace cpk
