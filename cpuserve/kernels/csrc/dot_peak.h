// The int8 multiply-add peak of each variant's fastest dot step (the instruction sequence its linear
// kernels are built on), measured rather than taken from a datasheet: a loop of independent steps on
// all-ones operands, so every multiply-add adds exactly 1 to some accumulator lane and the
// lanes' sum is the number of multiply-adds done (checked by the tests and kernel_check). The
// benchmark divides a linear's multiply-adds per second by this loop's (bench/peak.py).
#pragma once

#include <cstdint>

namespace cpk {

// `rounds` rounds of a variant's dot steps on one thread; returns the sum of every accumulator lane.
using DotPeak = int64_t (*)(int64_t rounds);

// The portable loop (generic and the twins' rows): 64 int32 lanes, 4 products each per round.
int64_t dot_peak_generic(int64_t rounds);
constexpr int64_t kDotPeakGenericMacs = 256;

}  // namespace cpk
