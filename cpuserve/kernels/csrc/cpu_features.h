// The CPU features the variants need, as the kernel sees them: one detector per architecture
// (arch/x86/cpu_features_x86.cpp: cpuid, OS support of the vector state included; arch/arm/
// cpu_features_arm.cpp: HWCAPs). The platform layer reads the same facts from /proc/cpuinfo
// (platform/plan.py); a test checks that both choose the same variant.
#pragma once

#include <cstdint>

namespace cpk {

enum Feature : uint32_t {
  kAvx2 = 1u << 0,  // with FMA
  kAvx512Vnni = 1u << 1,  // AVX-512 F, BW, VL and VNNI
  kAvxVnni = 1u << 2,  // VEX-encoded VNNI (vpdpbusd on ymm)
  kAvx512Bf16 = 1u << 3,  // vdpbf16ps (no variant needs it: prefill attention's bf16 pairs use it where present)
  kArmDotprod = 1u << 8,  // sdot
  kArmI8mm = 1u << 9,  // smmla
};

// The features of this CPU (detected once).
uint32_t cpu_features();

}  // namespace cpk
