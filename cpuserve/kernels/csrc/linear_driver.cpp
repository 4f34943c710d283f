#include "linear_driver.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu_features.h"
#include "panel_layout.h"
#include "scale_codes.h"

namespace cpk {
namespace {

// One matmul's quantized activations, in buffers kept per calling thread and reused: a decode step
// makes ~120 matmuls, and four allocations each showed in its profile. Rows are readable 4 bytes past
// the last (the int8 panel kernels read whole quads; the padded weights are zero there).
struct Activations {
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> sums;
};

Activations& scratch(int64_t m, int64_t k, int64_t groups) {
  thread_local Activations act;
  act.q.resize(m * k + 4);
  act.scales.resize(m);
  act.sums.resize(m * groups);
  return act;
}

// A row as fp32: itself, or widened into buf (no fp32 copy of the whole input).
inline const float* widen(const float* row, int64_t, std::vector<float>&) { return row; }
template <typename T>
const float* widen(const T* row, int64_t k, std::vector<float>& buf) {
  buf.resize(k);
  for (int64_t i = 0; i < k; ++i) buf[i] = to_float(row[i]);
  return buf.data();
}

// block > 0: each block of `block` groups of a row quantized on its own (the row's quantizer over
// the block: one scale a block, one sum a group), scales [M, groups / block]; else one scale per
// row, scales [M].
template <typename T>
void quantize_rows_of(const Variant& v, const Parallel& par, const T* x, int64_t m, int64_t k, int64_t group,
                      Activations& act, bool with_sums, int64_t block) {
  const int64_t groups = group > 0 ? k / group : 0;
  par.for_range(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wide;
    for (int64_t r = begin; r < end; ++r) {
      const float* row = widen(x + r * k, k, wide);
      int8_t* q = act.q.data() + r * k;
      if (block > 0) {
        const int64_t blocks = groups / block, inputs = block * group;
        for (int64_t b = 0; b < blocks; ++b)
          v.quantize_row(row + b * inputs, inputs, group, q + b * inputs, act.scales.data() + r * blocks + b,
                         act.sums.data() + r * groups + b * block);
      } else {
        v.quantize_row(row, k, group, q, act.scales.data() + r, with_sums ? act.sums.data() + r * groups : nullptr);
      }
    }
  });
}

// Quantization of x, rows shared out: per token (group sums when group > 0) or, block > 0, per block
// of `block` groups (then per_groups: the block scales repeated for each of its groups, [M, groups],
// for the kernels that scale each group).
void quantize_rows(const Variant& v, const Parallel& par, const LinearInput& in, int64_t group, Activations& act,
                   int64_t block = 0, bool per_groups = false) {
  count(v, kQuantize);
  const bool sums = group > 0;
  const int64_t groups = group > 0 ? in.k / group : 0;
  if (block > 0) act.scales.resize(in.m * groups);
  if (in.dtype == DType::F32)
    quantize_rows_of(v, par, static_cast<const float*>(in.x), in.m, in.k, group, act, sums, block);
  else if (in.dtype == DType::Bf16)
    quantize_rows_of(v, par, static_cast<const Bf16*>(in.x), in.m, in.k, group, act, sums, block);
  else
    quantize_rows_of(v, par, static_cast<const F16*>(in.x), in.m, in.k, group, act, sums, block);
  if (block <= 1 || !per_groups) return;
  const int64_t blocks = groups / block;
  for (int64_t i = in.m * groups - 1; i >= 0; --i)  // in place, from the end: [M, blocks] -> [M, groups]
    act.scales[i] = act.scales[(i / groups) * blocks + (i % groups) / block];
}

// Rows up to which the panel layouts fold a K-quant in int32 (decode and small decode batches). In
// prefill blocks (3 rows x 4 panels) the fold's integer multiplies (vpmulld: two uops on the port
// the dot products use) cost more than the per-group float fold over expanded scales, whose
// offsets go in the driver's own pass: 2B Q4_K_M pp512 -10% with it (docs/benchmarks.md).
constexpr int64_t kFoldRows = 16;

// A grouped linear with activations per group (act_groups): the groups per activation block
// (GroupScales::fold_per: a K-quant's super-block, as llama.cpp's Q8_K; else 1), and whether this
// call folds them in int32 (panel kernels reading the codes in place: LinearArgs::sa_per). The same
// rule for a variant and its twin, so they stay bit-identical.
struct ActBlocks {
  int64_t block = 1;
  bool fold = false;
};
ActBlocks act_blocks(const GroupScales& s, int64_t groups, int64_t group, bool act_groups, bool panels,
                     int64_t m) {
  ActBlocks ab;
  if (!act_groups) return ab;
  const int64_t per = s.fold_per(group);
  if (per > 0 && groups % per == 0) ab = {per, panels && m <= kFoldRows};
  return ab;
}

// Output columns [c0, c1) += sa * sum_g offset[g, c] * sums[r, g]: the per-group additive term of
// w = s * q + offset, in float, after the kernel. Offsets in column chunks (offsets_index): the 16
// columns of a chunk for every group in one contiguous run, so a chunk's pass streams its offsets
// (group-major [G, N] made it read G rows n floats apart, a stream per group: 3x the int4 kernel's
// time per byte at one token). 16 neighbouring columns as vector lanes: each column's sum keeps its
// order over g, one fma a group (offsets_weight), so every vector width gives the same bits as one
// column at a time.
constexpr int kColumns = kOffsetColumns;

// What group g's offsets are multiplied by for token r: its activations' sum, times their scale when
// activations are scaled per group (one rounding, then one fma a group: the kernels' in-register
// offsets do the same, panel_runs.h StoredGroups).
inline float offsets_weight(const LinearArgs& a, int64_t r, int64_t g) {
  const float gsum = float(a.sums[r * a.groups + g]);
  return a.sa_groups ? gsum * a.sa[r * a.groups + g] : gsum;
}

// One column's term for token r, the same operations as a vector lane.
inline void offsets_column(const LinearArgs& a, int64_t r, int64_t c) {
  const int32_t* gs = a.sums + r * a.groups;
  const float* sa = a.sa_groups ? a.sa + r * a.groups : nullptr;
  float term = 0.f;
  for (int64_t g = 0; g < a.groups; ++g)
    term = std::fma(a.offsets[offsets_index(a.n, a.groups, g, c)], offsets_weight(a, r, g), term);
  a.out[r * a.n + c] += sa != nullptr ? term : term * a.sa[r];
}

// The lanes offsets_chunk works in: 16 (AVX-512), 8 (AVX2 + FMA) or 1 float (portable: std::fma,
// the fused operation on every target, in software where the CPU has none) per vector.
struct ScalarLanes {
  using T = float;
  static constexpr int kLanes = 1;
  static T load(const float* p) { return *p; }
  static T set1(float x) { return x; }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
  static T mul(T a, T b) { return a * b; }
  static void add_to(float* out, T v) { *out += v; }
};
#if defined(__x86_64__)
#define CPK_LANES_AVX2 __attribute__((target("avx2,fma")))
#define CPK_LANES_AVX512 __attribute__((target("avx512f,fma")))
struct YmmLanes {
  using T = __m256;
  static constexpr int kLanes = 8;
  CPK_LANES_AVX2 static T load(const float* p) { return _mm256_loadu_ps(p); }
  CPK_LANES_AVX2 static T set1(float x) { return _mm256_set1_ps(x); }
  CPK_LANES_AVX2 static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  CPK_LANES_AVX2 static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  CPK_LANES_AVX2 static void add_to(float* out, T v) { _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), v)); }
};
struct ZmmLanes {
  using T = __m512;
  static constexpr int kLanes = 16;
  CPK_LANES_AVX512 static T load(const float* p) { return _mm512_loadu_ps(p); }
  CPK_LANES_AVX512 static T set1(float x) { return _mm512_set1_ps(x); }
  CPK_LANES_AVX512 static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  CPK_LANES_AVX512 static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  CPK_LANES_AVX512 static void add_to(float* out, T v) { _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), v)); }
};
#endif

// Rows RB (from r) of one whole chunk at column c: the chunk's offsets loaded once a group for all
// RB rows, the sums in registers (a row at a time, the sums in memory: 2B Q4_K_M pp512 8-13% slower,
// docs/benchmarks.md session 25). Each lane's operations are offsets_column's.
// weights: offsets_weight of every row and group [M, G] (offsets_weights, once a linear).
template <typename V, int RB>
inline void offsets_chunk(const LinearArgs& a, const float* weights, int64_t r, int64_t c) {
  constexpr int kVectors = kColumns / V::kLanes;
  const float* chunk = a.offsets + c * a.groups;  // this chunk's [G][16]
  typename V::T term[RB][kVectors];
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < kVectors; ++i) term[j][i] = V::set1(0.f);
  for (int64_t g = 0; g < a.groups; ++g) {
    typename V::T w[RB];
    for (int j = 0; j < RB; ++j) w[j] = V::set1(weights[(r + j) * a.groups + g]);
    for (int i = 0; i < kVectors; ++i) {
      const typename V::T off = V::load(chunk + g * kColumns + i * V::kLanes);
      for (int j = 0; j < RB; ++j) term[j][i] = V::fma(off, w[j], term[j][i]);
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int i = 0; i < kVectors; ++i)
      V::add_to(a.out + (r + j) * a.n + c + i * V::kLanes,
                a.sa_groups ? term[j][i] : V::mul(term[j][i], V::set1(a.sa[r + j])));
}

template <typename V>  // ScalarLanes, YmmLanes, ZmmLanes
inline void offsets_range(const LinearArgs& a, const float* weights, int64_t c0, int64_t c1) {
  constexpr int kRows = 4;
  const int64_t full = a.n / kColumns * kColumns;
  // A range that starts inside a chunk (columns shared out by threads, not panels): its columns up
  // to the chunk's end one at a time, then whole chunks, then the rest.
  const int64_t aligned = std::min(c1, (c0 + kColumns - 1) / kColumns * kColumns);
  const int64_t chunks_end = std::max(aligned, std::min(c1, full) / kColumns * kColumns);
  for (int64_t r = 0; r < a.m; ++r) {
    for (int64_t c = c0; c < aligned; ++c) offsets_column(a, r, c);
    for (int64_t c = chunks_end; c < c1; ++c) offsets_column(a, r, c);  // the last columns
  }
  if (aligned >= chunks_end) return;
  for (int64_t c = aligned; c < chunks_end; c += kColumns) {
    int64_t r = 0;
    for (; r + kRows <= a.m; r += kRows) offsets_chunk<V, kRows>(a, weights, r, c);
    for (; r < a.m; ++r) offsets_chunk<V, 1>(a, weights, r, c);
  }
}

using AddOffsets = void (*)(const LinearArgs&, const float*, int64_t, int64_t);
// flatten: the lanes' target-specific operations inline into each entry (not into the generic
// templates, which have no target of their own).
__attribute__((flatten)) void offsets_portable(const LinearArgs& a, const float* weights, int64_t c0, int64_t c1) { offsets_range<ScalarLanes>(a, weights, c0, c1); }
#if defined(__x86_64__)
__attribute__((target("avx2,fma"), flatten)) void offsets_avx2(const LinearArgs& a, const float* weights, int64_t c0, int64_t c1) {
  offsets_range<YmmLanes>(a, weights, c0, c1);
}
__attribute__((target("avx512f,fma"), flatten)) void offsets_avx512(const LinearArgs& a, const float* weights, int64_t c0, int64_t c1) {
  offsets_range<ZmmLanes>(a, weights, c0, c1);
}
#endif

// The widest vectors the variant's CPU features allow (the twins: the portable ones).
AddOffsets offsets_for(const Variant& v) {
#if defined(__x86_64__)
  if (v.needs & kAvx512Vnni) return offsets_avx512;
  if (v.needs & kAvx2) return offsets_avx2;
#endif
  (void)v;
  return offsets_portable;
}

// A pointer that reads `base`'s element i at index i + shift (the kernels index scales from the
// weight's first column; an expanded chunk starts later).
inline const float* shifted(const float* base, int64_t shift) {
  return reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(base) - uintptr_t(shift) * sizeof(float));
}

// Output work shared out: panels for a panel layout, else columns; each range's offsets added by
// the thread that computed it. With coded scales, each range goes in chunks of a few 16-column
// units, its scales and offsets expanded into the thread's buffers (up to ~128 KB: in L2) first.
// Few rows (decode) on a variant whose grouped kernels read them in place (Variant::direct_rows):
// the kernels take the scales and offsets as stored and add the offsets themselves; an expanded
// copy, read once, cost about half the kernel's own time. grouped: the kernel runs its grouped
// blocks (every W4A8; W8A8 with groups > 1).
void over_outputs(const Parallel& par, const Variant& v, bool panels, int64_t n, LinearKernel kernel,
                  const LinearArgs& args, const GroupScales& gs, bool grouped) {
  const bool coded = gs.scales.coded() || gs.offsets.coded();
  if (args.sa_per != 0) {  // the integer fold: codes read in place, any M
    LinearArgs a = args;
    a.direct = &gs;
    return par.for_range(0, panel_count(n), 1, [&](int64_t begin, int64_t end) { kernel(a, begin, end); });
  }
  if ((coded || args.offsets != nullptr) && panels && grouped && v.direct_rows > 0 && args.m <= v.direct_rows) {
    LinearArgs a = args;
    a.direct = &gs;
    return par.for_range(0, panel_count(n), 1, [&](int64_t begin, int64_t end) { kernel(a, begin, end); });
  }
  const AddOffsets add_offsets = args.offsets != nullptr ? offsets_for(v) : nullptr;
  thread_local std::vector<float> weight_buffer;  // per calling thread, reused
  const float* weights = nullptr;  // offsets_weight [M, G], once a linear: the caller's, read by the pool
  if (add_offsets != nullptr) {
    weight_buffer.resize(args.m * args.groups);
    for (int64_t r = 0; r < args.m; ++r)
      for (int64_t g = 0; g < args.groups; ++g) weight_buffer[r * args.groups + g] = offsets_weight(args, r, g);
    weights = weight_buffer.data();
  }
  auto columns = [&](int64_t begin, int64_t end) {
    return std::pair<int64_t, int64_t>{panels ? begin * kPanel : begin, panels ? std::min(n, end * kPanel) : end};
  };
  auto run = [&](const LinearArgs& a, int64_t begin, int64_t end) {
    kernel(a, begin, end);
    if (add_offsets != nullptr) add_offsets(a, weights, columns(begin, end).first, columns(begin, end).second);
  };
  const int64_t groups = args.groups, unit = kPanel * groups;
  const int64_t per_unit = unit * (args.offsets != nullptr ? 2 : 1) * int64_t(sizeof(float));
  const int64_t units = std::max<int64_t>(4, (131072 / per_unit) / 4 * 4);
  auto body = [&](int64_t begin, int64_t end) {
    if (!coded) return run(args, begin, end);
    thread_local std::vector<float> scales, offsets;
    const auto [c0, c1] = columns(begin, end);
    const int64_t last = (c1 + kPanel - 1) / kPanel;  // this range's units only: not the next thread's
    for (int64_t u0 = c0 / kPanel; u0 < last; u0 += units) {
      const int64_t u1 = std::min(u0 + units, last);
      // grown, never shrunk: a resize back up zero-fills (128 KB between a layer without offsets and one with)
      if (int64_t(scales.size()) < units * unit) scales.resize(units * unit);
      if (args.offsets != nullptr && int64_t(offsets.size()) < units * unit) offsets.resize(units * unit);
      const float* plain = gs.scales.coded() ? nullptr : args.sw + u0 * unit;
      scale_codes::expand(v, gs, panels, n, groups, u0, u1, scales.data(), offsets.data(), plain);
      LinearArgs a = args;
      if (gs.scales.coded()) a.sw = shifted(scales.data(), u0 * unit);
      if (gs.offsets.values != nullptr && gs.offsets.coded()) a.offsets = shifted(offsets.data(), u0 * unit);
      if (panels)
        run(a, std::max(begin, u0), std::min(end, u1));
      else
        run(a, std::max(c0, u0 * kPanel), std::min(c1, u1 * kPanel));
    }
  };
  if (panels)
    par.for_range(0, panel_count(n), 1, body);
  else
    par.for_range(0, n, 16, body);
}

}  // namespace

void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const GroupScales& s,
                 int64_t groups, int64_t n, float* out, bool act_groups) {
  count(v, kW8A8);
  act_groups = act_groups && groups > 1;  // one group: per token is per group
  const bool has_offsets = s.offsets.values != nullptr;
  // uint8 w + 128 (OffsetPanels): the activation sums of each group correct it; offsets need them too.
  const bool sums = v.int8 == Int8Layout::OffsetPanels || has_offsets || act_groups;
  const ActBlocks ab = act_blocks(s, groups, in.k / groups, act_groups, is_panels(v.int8), in.m);
  Activations& act = scratch(in.m, in.k, groups);
  quantize_rows(v, par, in, sums ? in.k / groups : 0, act, act_groups ? ab.block : 0, !ab.fold);
  LinearArgs args{act.q.data(),
                        act.scales.data(),
                        act.sums.data(),
                        in.m,
                        in.k,
                        w,
                        static_cast<const float*>(s.scales.values),
                        groups,
                        n,
                        out,
                        static_cast<const float*>(s.offsets.values),
                        act_groups && !ab.fold};
  if (ab.fold) args.sa_per = ab.block;
  over_outputs(par, v, is_panels(v.int8), n, v.w8a8, args, s, groups > 1);
}

void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const GroupScales& s,
                 int64_t groups, int64_t n, float* out, bool act_groups, int64_t high_bits) {
  count(v, kW4A8);
  act_groups = act_groups && groups > 1;
  const ActBlocks ab = act_blocks(s, groups, in.k / groups, act_groups, is_panels(v.int4), in.m);
  Activations& act = scratch(in.m, in.k, groups);
  quantize_rows(v, par, in, in.k / groups, act, act_groups ? ab.block : 0, !ab.fold);
  LinearArgs args{act.q.data(),
                        act.scales.data(),
                        act.sums.data(),
                        in.m,
                        in.k,
                        w,
                        static_cast<const float*>(s.scales.values),
                        groups,
                        n,
                        out,
                        static_cast<const float*>(s.offsets.values),
                        act_groups && !ab.fold};
  if (ab.fold) args.sa_per = ab.block;
  args.high_bits = high_bits;
  over_outputs(par, v, is_panels(v.int4), n, v.w4a8, args, s, true);
}

namespace {
GroupScales plain(const float* scales, const float* offsets) {
  GroupScales s;
  s.scales.values = scales;
  s.offsets.values = offsets;
  return s;
}
}  // namespace

void w8a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets, bool act_groups) {
  w8a8_linear(v, par, in, w, plain(scales, offsets), groups, n, out, act_groups);
}

void w4a8_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, const float* scales,
                 int64_t groups, int64_t n, float* out, const float* offsets, bool act_groups) {
  w4a8_linear(v, par, in, w, plain(scales, offsets), groups, n, out, act_groups);
}

void float_linear(const Variant& v, const Parallel& par, const LinearInput& in, const void* w, DType wtype, int64_t n,
                  float* out) {
  count(v, kFloatLinear);
  const float* x = static_cast<const float*>(in.x);
  if (in.dtype != DType::F32) {
    thread_local std::vector<float> buffer;  // per calling thread, reused
    std::vector<float>& wide = buffer;       // the caller's, not each pool thread's own
    wide.resize(in.m * in.k);
    par.for_range(0, in.m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t at = r * in.k;
        if (in.dtype == DType::Bf16)
          for (int64_t i = 0; i < in.k; ++i) wide[at + i] = to_float(static_cast<const Bf16*>(in.x)[at + i]);
        else
          for (int64_t i = 0; i < in.k; ++i) wide[at + i] = to_float(static_cast<const F16*>(in.x)[at + i]);
      }
    });
    x = wide.data();
  }
  const FloatArgs args{x, in.m, in.k, w, wtype, n, out};
  par.for_range(0, panel_count(n), 1, [&](int64_t begin, int64_t end) { v.float_linear(args, begin, end); });
}

void decode_attention(const Variant& v, const Parallel& par, const AttentionArgs& a) {
  count(v, kDecodeAttention);
  v.decode_attention(a, par);
}

void prefill_attention(const Variant& v, const Parallel& par, const PrefillArgs& a) {
  count(v, kPrefillAttention);
  v.prefill_attention(a, par);
}

}  // namespace cpk
