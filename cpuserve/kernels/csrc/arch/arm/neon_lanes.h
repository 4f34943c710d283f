// 4 fp32 lanes of a q register and the loads that widen the cache's and weights' element types into
// them (bf16 by a 16-bit shift-left-long, fp16 by fcvtl; both Armv8.0): shared by the float panel
// kernel (float_neon.cpp) and decode attention (attention_neon.cpp).
#pragma once

#include <arm_neon.h>

#include <cstdint>

#include "../../float_types.h"

namespace cpk {

struct NeonLanes {
  using Vec = float32x4_t;
  static constexpr int64_t kLanes = 4;
  static constexpr int64_t kRegisters = 32;  // v0-v31
  static Vec zero() { return vdupq_n_f32(0.f); }
  static Vec set1(float x) { return vdupq_n_f32(x); }
  static Vec add(Vec a, Vec b) { return vaddq_f32(a, b); }
  static Vec fma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
  static void store(float* p, Vec v) { vst1q_f32(p, v); }
  static Vec load(const float* p) { return vld1q_f32(p); }
  static Vec load(const Bf16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static Vec load(const F16* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)))); }
};

}  // namespace cpk
