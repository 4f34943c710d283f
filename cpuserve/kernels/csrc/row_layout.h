// The row layouts of the int4 weights (generic and Arm variants; W8A8 rows are the int8 weights as
// they are), repacked at load. Per row, per 32 inputs, one Int4RowBlock of 16 bytes: byte j holds
// input j in its low nibble and input 16 + j in its high nibble, as
//   OffsetRows (generic): w + 8, unsigned 0..15. Dot products use the unsigned nibble and subtract
//     8 * sum(activations of the group), which the activation quantizer computes once per token and group.
//   TwosComplementRows (aarch64 NEON): w & 0xF. `shl #4` of the byte and `and #0xF0` give 16 * w as
//     int8 with no correction; the group's int32 sum is divided by 16 (exact) before the float update.
#pragma once

#include <cstdint>

#include "variant.h"

namespace cpk {

struct Int4RowBlock {
  uint8_t nibbles[16];  // inputs j (low) and 16 + j (high)
};
static_assert(sizeof(Int4RowBlock) == 16, "32 int4 weights in 16 bytes");
constexpr int64_t kRowBlockInputs = 32;

// One nibble of value v in [-8, 7] in a row layout.
inline uint8_t nibble_of(int v, Int4Layout layout) {
  return layout == Int4Layout::OffsetRows ? uint8_t(v + 8) : uint8_t(v & 0x0F);
}

// int8 values in [-8, 7], one row of K -> the layout (K / 2 bytes).
inline void pack_int4_row(const int8_t* src, int64_t k, uint8_t* dst, Int4Layout layout) {
  Int4RowBlock* out = reinterpret_cast<Int4RowBlock*>(dst);
  for (int64_t b = 0; b < k / kRowBlockInputs; ++b)
    for (int j = 0; j < 16; ++j)
      out[b].nibbles[j] =
          uint8_t(nibble_of(src[b * 32 + j], layout) | (nibble_of(src[b * 32 + 16 + j], layout) << 4));
}

// compressed-tensors pack-quantized int4 (int32 words; word j holds k = 8j..8j+7, value + 8 at bits
// 4i), one row -> the layout, without an int8 intermediate (value + 8 xor 8 is the value's
// two's-complement nibble).
inline void words_to_nibbles_row(const uint32_t* row, int64_t k, uint8_t* dst, Int4Layout layout) {
  const uint8_t flip = layout == Int4Layout::OffsetRows ? 0 : 0x8;
  auto nibble = [&](int64_t i) { return uint8_t(((row[i / 8] >> (4 * (i % 8))) & 0x0F) ^ flip); };
  Int4RowBlock* out = reinterpret_cast<Int4RowBlock*>(dst);
  for (int64_t b = 0; b < k / kRowBlockInputs; ++b)
    for (int j = 0; j < 16; ++j) out[b].nibbles[j] = uint8_t(nibble(b * 32 + j) | (nibble(b * 32 + 16 + j) << 4));
}

}  // namespace cpk
