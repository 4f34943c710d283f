// The float panel kernel (float_kernel.h) on Armv8 NEON: a panel step is four q registers of 4
// fp32 (neon_lanes.h). 6 rows x 4 vectors of sums + 4 weights + 1 broadcast: 29 of the 32 q
// registers.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../float_kernel.h"
#include "kernels.h"
#include "neon_lanes.h"

namespace cpk {
namespace {

struct Q : NeonLanes {
  static constexpr int kRows = 6;
  static Vec broadcast(float x) { return set1(x); }
};

}  // namespace

void float_linear_neon(const FloatArgs& a, int64_t p0, int64_t p1) { float_kernel::linear<Q>(a, p0, p1); }

}  // namespace cpk
#endif
