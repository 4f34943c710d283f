// neon_dotprod (Armv8.2 sdot): 16 int8 products summed into 4 lanes per instruction (dotprod.h).
#if defined(__aarch64__)
#include "../../linear_rows.h"
#include "dotprod.h"
#include "kernels.h"

namespace cpk {

void w8a8_neon_dotprod(const LinearArgs& a, int64_t c0, int64_t c1) { w8a8_rows<dot_i8_dotprod>(a, c0, c1); }
void w4a8_neon_dotprod(const LinearArgs& a, int64_t c0, int64_t c1) {
  w4a8_rows<row_s4_dotprod, nullptr, false>(a, c0, c1);
}

}  // namespace cpk
#endif  // __aarch64__
