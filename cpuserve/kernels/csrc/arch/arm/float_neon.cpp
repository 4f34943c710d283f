// The float panel kernel (float_kernel.h) on Armv8 NEON: a panel step is four q registers of 4
// fp32, bf16 widened by a 16-bit shift-left-long, fp16 by fcvtl (both Armv8.0). 6 rows x 4 vectors
// of sums + 4 weights + 1 broadcast: 29 of the 32 q registers.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../float_kernel.h"
#include "kernels.h"

namespace cpk {
namespace {

struct Q {
  using Vec = float32x4_t;
  static constexpr int64_t kLanes = 4;
  static constexpr int kRows = 6;
  static Vec zero() { return vdupq_n_f32(0.f); }
  static Vec broadcast(float x) { return vdupq_n_f32(x); }
  static Vec fma(Vec a, Vec b, Vec c) { return vfmaq_f32(c, a, b); }
  static Vec add(Vec a, Vec b) { return vaddq_f32(a, b); }
  static void store(float* p, Vec v) { vst1q_f32(p, v); }
  static Vec load(const float* p) { return vld1q_f32(p); }
  static Vec load(const Bf16* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static Vec load(const F16* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)))); }
};

}  // namespace

void float_linear_neon(const FloatArgs& a, int64_t p0, int64_t p1) { float_kernel::linear<Q>(a, p0, p1); }

}  // namespace cpk
#endif
