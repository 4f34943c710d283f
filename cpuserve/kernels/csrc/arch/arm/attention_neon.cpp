// Every Armv8 variant's attention. Prefill: the query and key blocks of prefill_blocks.h on q
// registers (fp32). Decode: the key blocks of attention_blocks.h on q registers (4
// keys a block, the exp's power of two built in the exponent bits; all Armv8.0 instructions, so
// neon, neon_dotprod and neon_i8mm share it). Shapes it does not fit (head dimension not a multiple
// of 4 or over 256, over 16 query heads per KV head) run the portable loops.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "../../attention.h"
#include "../../attention_blocks.h"
#include "../../prefill_attention.h"
#include "../../prefill_blocks.h"
#include "kernels.h"
#include "neon_lanes.h"

namespace cpk {
namespace {

struct Neon : NeonLanes {
  // A block's live lanes: all ones in the first `live`, and their count, so the tails' loads and
  // stores touch only those (NEON has no masked load).
  struct Mask {
    uint32x4_t bits;
    int live;
  };
  using NeonLanes::load;
  static Vec sub(Vec a, Vec b) { return vsubq_f32(a, b); }
  static Vec mul(Vec a, Vec b) { return vmulq_f32(a, b); }
  static Vec max(Vec a, Vec b) { return vmaxq_f32(a, b); }
  static Vec load(const int8_t* p) {
    int32_t four;
    std::memcpy(&four, p, sizeof four);
    const int16x8_t wide = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four)));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide)));
  }
  static Mask first(int64_t n) {
    const int live = int(std::min<int64_t>(n, 4));
    static const uint32_t kIndex[4] = {0, 1, 2, 3};
    return {vcltq_u32(vld1q_u32(kIndex), vdupq_n_u32(uint32_t(live))), live};
  }
  static Vec load_first(const float* p, Mask m, float fill) {
    if (m.live == 4) return vld1q_f32(p);
    float lanes[4] = {fill, fill, fill, fill};
    std::memcpy(lanes, p, sizeof(float) * size_t(m.live));
    return vld1q_f32(lanes);
  }
  static void store_first(float* p, Mask m, Vec v) {
    if (m.live == 4) return vst1q_f32(p, v);
    float lanes[4];
    vst1q_f32(lanes, v);
    std::memcpy(p, lanes, sizeof(float) * size_t(m.live));
  }
  static Vec keep(Mask m, Vec v) { return vreinterpretq_f32_u32(vandq_u32(m.bits, vreinterpretq_u32_f32(v))); }
  static float reduce_max(Vec v) { return vmaxvq_f32(v); }
  static float reduce_add(Vec v) { return vaddvq_f32(v); }
  static Vec sum_lanes(const float (&rows)[4][4]) {  // pairwise adds: lane l = row l's sum
    const Vec low = vpaddq_f32(vld1q_f32(rows[0]), vld1q_f32(rows[1]));
    const Vec high = vpaddq_f32(vld1q_f32(rows[2]), vld1q_f32(rows[3]));
    return vpaddq_f32(low, high);
  }
  // e^x, ~2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p the x86 kernels' degree-6 Taylor
  // polynomial; 2^n written into a float's exponent bits, so x is held to [-87.3, 88] (n in
  // [-126, 127]), and anything below -87.3 (the softmax's -inf shifted scores included) gives 0, as
  // does NaN, like the x86 exps.
  static Vec exp(Vec x) {
    const uint32x4_t kept = vcgeq_f32(x, vdupq_n_f32(-87.3f));  // false for NaN
    x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3f)), vdupq_n_f32(88.f));
    const Vec n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    Vec r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
    r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187045e-06f));
    Vec p = vdupq_n_f32(1.f / 720.f);
    p = vfmaq_f32(vdupq_n_f32(1.f / 120.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 24.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f / 6.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
    const int32x4_t bias = vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127));
    const Vec power = vreinterpretq_f32_s32(vshlq_n_s32(bias, 23));
    return vreinterpretq_f32_u32(vandq_u32(kept, vreinterpretq_u32_f32(vmulq_f32(p, power))));
  }
};

CPK_PORTABLE_ATTENTION(portable_neon, )
CPK_PORTABLE_PREFILL(portable_prefill_neon, )

}  // namespace

void decode_attention_neon(const AttentionArgs& a, const Parallel& par) {
  attention_blocks::dispatch<Neon>(a, par, portable_neon);
}

void prefill_attention_neon(const PrefillArgs& a, const Parallel& par) {
  prefill_blocks::dispatch<Neon>(a, par, portable_prefill_neon);
}

}  // namespace cpk
#endif  // __aarch64__
