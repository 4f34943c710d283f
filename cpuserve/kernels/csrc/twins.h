// The scalar twins' table entries (generic.cpp): what every variant's kernels are checked against.
#pragma once

#include "variant.h"

namespace cpk {

void w8a8_generic(const LinearArgs& a, int64_t c0, int64_t c1);
void w4a8_generic(const LinearArgs& a, int64_t c0, int64_t c1);
void w4a8_generic_twos_complement(const LinearArgs& a, int64_t c0, int64_t c1);
void w8a8_generic_offset_panels(const LinearArgs& a, int64_t p0, int64_t p1);
void w8a8_generic_signed_panels(const LinearArgs& a, int64_t p0, int64_t p1);
void w4a8_generic_panels(const LinearArgs& a, int64_t p0, int64_t p1);
void decode_attention_generic(const AttentionArgs& a, const Parallel& par);
void prefill_attention_generic(const PrefillArgs& a, const Parallel& par);

}  // namespace cpk
