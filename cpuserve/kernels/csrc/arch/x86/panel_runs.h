// How the x86 panel kernels walk a thread's panels: runs of up to P panels side by side, blocks of
// R token rows x the run's panels (R x P accumulators of 16 columns in registers: no horizontal
// sums, every weight load shared by R rows and every activation broadcast by 16 columns), rows in
// passes that stay in L2 while the panels stream. Shared by every x86 variant (the block kernels are
// each ISA's own).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../../linear_driver.h"
#include "../../panel_layout.h"
#include "../../scale_codes.h"

namespace cpk {

// Up to 4 panels side by side: where each starts, bytes per step (4 * width), its AVX-512 load mask,
// its width, and the last panel's column mask (only the last panel of a weight can be narrower).
struct PanelRun {
  const uint8_t* base[4];
  int64_t step[4];
  __mmask64 load[4];
  int64_t width[4];
  __mmask16 store_last;
  int64_t c0;     // first column
  int64_t ahead;  // bytes from a panel to the same panel of the next run (0: no prefetching)
};

inline PanelRun panel_run(const uint8_t* pw, int64_t bytes_per_column, int64_t n, int64_t p, int64_t np,
                          bool ahead = false) {
  PanelRun run{};
  run.c0 = p * kPanel;
  run.ahead = ahead ? np * kPanel * bytes_per_column : 0;
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

// Decode (few rows, one pass over the weights): step j of panel i of the next run, requested into L2
// while this run computes. The demand loads alone kept too few misses in flight: the int8 output
// head of the bundled model streamed at ~20 GB/s without, ~34 with (the measured read bandwidth);
// into L1, or half a run ahead, gained less (docs/benchmarks.md). The address is made as an integer
// (scale_codes::prefetch_at): a thread's last run asks past the end of the weight.
__attribute__((always_inline)) inline void prefetch_l2(const void* p, int64_t bytes) {
  scale_codes::prefetch_at<_MM_HINT_T1>(p, bytes);
}
__attribute__((always_inline)) inline void prefetch_ahead(const PanelRun& run, int i, int64_t j) {
  if (run.ahead != 0) prefetch_l2(run.base[i] + j * run.step[i], run.ahead);
}

// Rows up to which the kernels prefetch: decode batches, whose weights stream once per row block.
constexpr int64_t kPrefetchRows = 16;

// Rows up to which the avx512_vnni kernels take one panel at a time (runs of 1): a thread's weights
// then stream as one contiguous read. A run of 4 panels reads 4 streams a panel apart, and this
// host's memory served those about 26% slower (a read microbenchmark, 2 threads, alternated: medians
// 58.1 / 47.3 GB/s for one stream, 42.6 / 34.9 for 4 streams 18 KB apart). Decode, 2B Q4_0 / Q4_K_M
// / W4A8-G128 / W8A8 at M = 1: +22% / +29% / +21% / +13% when the memory was slow, +1.5% when fast;
// M = 2 +25%, 8 +2%, 16 -6% (rows 9-15 not measured; at 16 the 4-panel blocks, which share each
// activation broadcast between 4 panels, were faster). avx512_vnni, Zen 5 host; docs/benchmarks.md.
constexpr int64_t kStreamRows = 8;

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

// Where the grouped blocks read each group's weight scales: the driver's fp32 scales of the run in
// panel order (Plain), or the linear's scales and offsets where they are stored (Stored: coded or
// not, LinearArgs::direct), the offsets' term then summed alongside.
struct PlainGroups {
  static constexpr bool kStored = false;
  const float* sp;
  int64_t ahead = 0;  // bytes from a panel's scales to the same panel's in the next run (0: no prefetching)
  // Panel i's scales of group g (16 floats, one line), its next run's requested into L2 while decoding:
  // left to demand loads, each group's four lines missed cache and stalled the stream (half the M = 1
  // G128 block's samples sat on them, avx512_vnni on a Zen 5 host; docs/benchmarks.md).
  __attribute__((always_inline)) const float* group(const PanelRun& run, int i, int64_t groups, int64_t g) const {
    return sp + i * kPanel * groups + g * run.width[i];
  }
  __attribute__((always_inline)) void request_next(const PanelRun& run, int i, int64_t groups, int64_t g) const {
    if (ahead != 0) prefetch_l2(group(run, i, groups, g), ahead);
  }
};
struct StoredGroups {
  static constexpr bool kStored = true;
  const GroupScales& gs;
  scale_codes::PanelAt at[4];
  bool offsets;
  scale_codes::PanelAt next[4];  // the same panel of the next run (prefetched while decoding)
  int prefetch = 0;              // how many of next are panels of the weight (0 outside decode)
  int64_t per = 0;               // the integer fold's groups per super-block (LinearArgs::sa_per)
  int32_t mid = 0;               // its lift: GroupScales::fold_mid
};

// Decode (run.ahead != 0): group g's scales, or codes and factors, of the run's P panels requested
// into L1 while the group before it computes (a narrow last panel's stored codes, laid out by its
// width, are left to the demand loads). The run-ahead request asks for them in L2, yet the
// epilogue's loads still held the weight stream: the G128 M = 1 kernel streamed 83-88% of W8A8's
// bytes a second, and 9-17% more with its scale loads pointed at one cached line (the same requests
// made). Requested a group ahead: G128 +1-5%, GGUF Q4_K and Q4_0 +8-13% when the memory was fast,
// -3% to +4% when slow (avx512_vnni, Zen 5 host; docs/benchmarks.md).
template <int P, typename Groups>
__attribute__((always_inline)) inline void request_group(const PanelRun& run, const Groups& src, int64_t groups,
                                                         int64_t g) {
  if (run.ahead == 0 || g >= groups) return;
  if constexpr (Groups::kStored) {
    const int64_t sb = scale_codes::super_block(src.gs.scales, g), ob = scale_codes::super_block(src.gs.offsets, g);
    #pragma GCC unroll 8
    for (int i = 0; i < P; ++i)
      if (run.width[i] == kPanel) scale_codes::prefetch_group<_MM_HINT_T0>(src.gs, src.at[i], g, sb, ob);
  } else {
    #pragma GCC unroll 8
    for (int i = 0; i < P; ++i) _mm_prefetch(reinterpret_cast<const char*>(src.group(run, i, groups, g)), _MM_HINT_T0);
  }
}

// How a grouped block scales the activations: per token, per group (LinearArgs::sa_groups), or per
// super-block with the integer fold (LinearArgs::sa_per, stored codes only).
enum Acts { kPerToken, kPerGroup, kFold };

// Groups per super-block of a block's fold (1 outside it).
template <typename Groups>
__attribute__((always_inline)) inline int64_t fold_per(const Groups& src) {
  if constexpr (Groups::kStored) return src.per > 0 ? src.per : 1;
  return 1;
}

// The integer the accumulators of a group start from, per activation of the group: minus the
// layout's offset, plus the fold's mid (the fold sums code * (dot + mid * gsum)).
template <int A, typename Groups>
__attribute__((always_inline)) inline int32_t acc_start(const Groups& src, int32_t layout_offset) {
  if constexpr (A == kFold && Groups::kStored) return src.mid - layout_offset;
  return -layout_offset;
}

// The integer fold's place in the super-blocks: the current block b, groups left in it.
struct FoldAt {
  int64_t b = 0, left;
  explicit FoldAt(int64_t per) : left(per) {}
  // After a group: whether it closed its super-block (then the next block starts).
  bool closes(int64_t per) {
    if (--left != 0) return false;
    left = per;
    return true;
  }
};

// A grouped block's call with its scale source: stored (LinearArgs::direct) or the driver's fp32 in
// panel order; activation scales per group (PG) or per token. block(src, sa) runs it.
template <typename Block>
__attribute__((always_inline)) inline void with_groups(const LinearArgs& a, const PanelRun& run, int np, int64_t r,
                                                     const Block& block) {
  const float* sa = a.sa_groups ? a.sa + r * a.groups : a.sa + r;
  if (a.direct == nullptr)
    return block(PlainGroups{a.sw + run.c0 * a.groups, run.ahead != 0 ? np * kPanel * a.groups * int64_t(sizeof(float)) : 0}, sa);
  StoredGroups src{*a.direct, {}, a.direct->offsets.values != nullptr};
  src.per = a.sa_per;
  src.mid = a.direct->fold_mid();
  const int64_t first = run.c0 / kPanel, panels = panel_count(a.n);
  for (int i = 0; i < np; ++i) {
    src.at[i] = scale_codes::panel_at(*a.direct, a.groups, first + i);
    if (run.ahead != 0 && first + np + i < panels) {
      src.next[i] = scale_codes::panel_at(*a.direct, a.groups, first + np + i);
      src.prefetch = i + 1;
    }
  }
  block(src, sa);
}

// with_groups and the activation scales' kind: block(src, sa, std::integral_constant<int, Acts>).
// The fold's sa: the rows' block scales [R, groups / sa_per].
template <typename Block>
__attribute__((always_inline)) inline void with_acts(const LinearArgs& a, const PanelRun& run, int np, int64_t r,
                                                   const Block& block) {
  with_groups(a, run, np, r, [&](const auto& src, const float* sa) {
    if constexpr (std::decay_t<decltype(src)>::kStored) {
      if (a.sa_per != 0) return block(src, a.sa + r * (a.groups / a.sa_per), std::integral_constant<int, kFold>{});
    }
    if (a.sa_groups) return block(src, sa, std::integral_constant<int, kPerGroup>{});
    block(src, sa, std::integral_constant<int, kPerToken>{});
  });
}

// The W4A8 blocks' weight kind as a template argument: block(std::integral_constant<int, HB>), HB 2
// for int6 panels (LinearArgs::high_bits), 0 for int4.
template <typename Block>
__attribute__((always_inline)) inline void with_high_bits(const LinearArgs& a, const Block& block) {
  if (a.high_bits != 0) return block(std::integral_constant<int, 2>{});
  block(std::integral_constant<int, 0>{});
}

}  // namespace cpk
