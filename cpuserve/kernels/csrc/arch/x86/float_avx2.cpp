// The float panel kernel (float_kernel.h) on AVX2 + FMA: a panel step is two ymm of 8 fp32, bf16
// widened by a zero-extend and a 16-bit shift, fp16 by F16C (every AVX2 CPU has it). 6 rows x 2
// vectors of sums + 2 weights + 1 broadcast: 15 of the 16 ymm registers.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../float_panels.h"
#include "kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

#include "../../float_kernel.h"
#include "ymm_lanes.h"

namespace cpk {
namespace {

struct Ymm : YmmLanes {
  static constexpr int kRows = 6;
  static Vec broadcast(float x) { return set1(x); }
};

}  // namespace

void float_linear_avx2(const FloatArgs& a, int64_t p0, int64_t p1) { float_kernel::linear<Ymm>(a, p0, p1); }

}  // namespace cpk

#pragma GCC pop_options
#endif
