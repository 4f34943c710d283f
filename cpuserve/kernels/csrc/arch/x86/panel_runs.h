// How the x86 panel kernels walk a thread's panels: runs of up to P panels side by side, blocks of
// R token rows x the run's panels (R x P accumulators of 16 columns in registers: no horizontal
// sums, every weight load shared by R rows and every activation broadcast by 16 columns), rows in
// passes that stay in L2 while the panels stream. Shared by every x86 variant (the block kernels are
// each ISA's own).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../../panel_layout.h"

namespace cpk {

// Up to 4 panels side by side: where each starts, bytes per step (4 * width), its AVX-512 load mask,
// its width, and the last panel's column mask (only the last panel of a weight can be narrower).
struct PanelRun {
  const uint8_t* base[4];
  int64_t step[4];
  __mmask64 load[4];
  int64_t width[4];
  __mmask16 store_last;
  int64_t c0;  // first column
};

inline PanelRun panel_run(const uint8_t* pw, int64_t bytes_per_column, int64_t n, int64_t p, int64_t np) {
  PanelRun run{};
  run.c0 = p * kPanel;
  for (int64_t i = 0; i < np; ++i) {
    const int64_t w = panel_width(n, p + i);
    run.base[i] = pw + (p + i) * kPanel * bytes_per_column;
    run.step[i] = 4 * w;
    run.load[i] = w == kPanel ? ~__mmask64(0) : (__mmask64(1) << (4 * w)) - 1;
    run.width[i] = w;
    if (i == np - 1) run.store_last = __mmask16((1u << w) - 1);
  }
  return run;
}

// One block of R rows and the run's np panels (np <= P): block.template go<R, np>(r). Generic and
// always inlined, so the ISA-specific blocks inline into each ISA's driver.
template <int R, int P, typename Block>
__attribute__((always_inline)) inline void panel_block(const Block& block, int64_t np, int64_t r) {
  if constexpr (P > 1) {
    if (np < P) return panel_block<R, P - 1>(block, np, r);
  }
  block.template go<R, P>(r);
}

// Rows [r0, r1) of one run in blocks of R rows, the rest in smaller blocks.
template <int R, int P, typename Block>
__attribute__((always_inline)) inline void panel_rows(const Block& block, int64_t np, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + R <= r1; r += R) panel_block<R, P>(block, np, r);
  if constexpr (R > 1) {
    if (r < r1) panel_rows<R - 1, P>(block, np, r, r1);
  }
}

// Rows per pass over a thread's panels: the activations of a pass stay in L2 while the panels stream.
constexpr int64_t kPanelRows = 192;

// Every run of up to P panels of [p0, p1) in blocks of up to R rows, rows in passes of kPanelRows;
// make(p, np) gives the run's block.
template <int R, int P, typename Make>
__attribute__((always_inline)) inline void for_each_run(int64_t m, int64_t p0, int64_t p1, const Make& make) {
  for (int64_t r0 = 0; r0 < m; r0 += kPanelRows)
    for (int64_t p = p0; p < p1; p += P) {
      const int64_t np = std::min<int64_t>(P, p1 - p);
      panel_rows<R, P>(make(p, np), np, r0, std::min(m, r0 + kPanelRows));
    }
}

}  // namespace cpk
