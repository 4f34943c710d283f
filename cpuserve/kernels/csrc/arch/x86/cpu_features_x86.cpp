// The x86-64 feature detector. __builtin_cpu_supports reads cpuid and, for AVX and AVX-512, checks
// with xgetbv that the OS saves the vector state.
#if defined(__x86_64__)
#include "../../cpu_features.h"

namespace cpk {

uint32_t cpu_features() {
  static const uint32_t features = [] {
    __builtin_cpu_init();
    uint32_t f = 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= kAvx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
      f |= kAvx512Vnni;
    if (__builtin_cpu_supports("avxvnni")) f |= kAvxVnni;
    if ((f & kAvx512Vnni) && __builtin_cpu_supports("avx512bf16")) f |= kAvx512Bf16;
    return f;
  }();
  return features;
}

}  // namespace cpk
#endif
