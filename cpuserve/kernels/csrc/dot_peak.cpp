// The portable dot-peak loop (dot_peak.h): what the generic variant's scalar code can reach.
#include "dot_peak.h"

namespace cpk {

int64_t dot_peak_generic(int64_t rounds) {
  volatile int8_t one = 1;  // operands the compiler cannot see, so it cannot fold the loop away
  int8_t a[256], b[256];
  for (int i = 0; i < 256; ++i) a[i] = b[i] = one;
  int32_t acc[64] = {};
  for (int64_t r = 0; r < rounds; ++r) {
    asm volatile("" ::: "memory");  // every round reads its operands again
    for (int l = 0; l < 64; ++l)
      for (int j = 0; j < 4; ++j) acc[l] += int32_t(a[4 * l + j]) * int32_t(b[4 * l + j]);
  }
  int64_t sum = 0;
  for (int32_t v : acc) sum += v;
  return sum;
}

}  // namespace cpk
