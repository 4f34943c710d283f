// The aarch64 feature detector: the kernel's HWCAPs (Advanced SIMD is mandatory in Armv8-A).
#if defined(__aarch64__)
#include <sys/auxv.h>

#include "../../cpu_features.h"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#ifndef HWCAP2_I8MM
#define HWCAP2_I8MM (1 << 13)
#endif

namespace cpk {

uint32_t cpu_features() {
  static const uint32_t features = [] {
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    uint32_t f = 0;
    if (hw & HWCAP_ASIMDDP) f |= kArmDotprod;
    if (hw2 & HWCAP2_I8MM) f |= kArmI8mm;
    return f;
  }();
  return features;
}

}  // namespace cpk
#endif
