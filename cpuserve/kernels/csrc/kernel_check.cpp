// Stand-alone check of the kernel core, no torch: every variant this CPU runs (or the one named on
// the command line) through the same driver the torch binding uses (linear_driver.h), against the
// scalar twin of its own layouts, on odd shapes; and every twin against the generic row twin.
// Built natively or cross-compiled for aarch64 and run under qemu (cpuserve/kernels/cross_check.py);
// prints the selected variant.
//
// Budgets: integer sums exact; W8A8 bit-identical to the twin and to generic (one float epilogue);
// W4A8 bit-identical to the variant's own twin (every variant says w4_exact); a twin of another
// layout against generic within 4 float ulps of the output's scale times the number of groups
// (each layout's twin sums groups in its own float order). Float linears (fp32, bf16 and fp16
// weights; fp32, bf16 and fp16 activations): the variant and the twin each within (K + 2) fp32
// unit roundoffs of sum |x w| of a double-precision sum over the row-major weights (the worst case
// of any order of K rounded adds, fused or not), so a misplaced weight, row or column fails.
//
// Decode attention (fp32, bf16, fp16 and int8 caches, contiguous and paged, 1 to 3 query heads per
// KV head, head dims that fit the key blocks and one that does not, lengths over the block tails and
// long enough to be split in parts and merged): the variant's and the generic twin's outputs each
// within 1e-6 + (length + D) fp32 unit roundoffs x 4 of a double-precision softmax over the same
// stored keys and values (|q|, |k|, |v| <= 1), so a wrong key, position, scale or part weight fails.
//
// usage: kernel_check [VARIANT]   exit 0 when every check passes

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "prefill_attention.h"
#include "float_panels.h"
#include "linear_driver.h"
#include "linear_rows.h"
#include "panel_layout.h"
#include "quantize.h"
#include "row_layout.h"
#include "twins.h"

namespace {

using cpk::Variant;

struct Rng {
  uint64_t s = 0x9E3779B97F4A7C15ull;
  uint32_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return uint32_t(s >> 32);
  }
  float uniform() { return float(next()) / 4294967296.0f * 2.f - 1.f; }  // [-1, 1)
  int range(int lo, int hi) { return lo + int(next() % uint32_t(hi - lo + 1)); }
};

// Two uneven parts, one after the other, as two threads would split the work.
const cpk::Parallel kSplit{2, [](int64_t begin, int64_t end, int64_t, cpk::RangeBody body) {
                             const int64_t split = begin + (end - begin) / 3;
                             if (split > begin) body(begin, split);
                             if (end > split) body(split, end);
                           }};

int failures = 0;
long checks = 0;

// The two row twins must agree on the integers: a row packed both ways, the same dot product.
bool layouts_agree(Rng& rng) {
  const int64_t k = 256;
  std::vector<int8_t> a(k), w(k);
  for (auto& e : a) e = int8_t(rng.range(-127, 127));
  for (auto& e : w) e = int8_t(rng.range(-8, 7));
  std::vector<uint8_t> off(k / 2), twos(k / 2);
  cpk::pack_int4_row(w.data(), k, off.data(), cpk::Int4Layout::OffsetRows);
  cpk::pack_int4_row(w.data(), k, twos.data(), cpk::Int4Layout::TwosComplementRows);
  int32_t sum_a = 0;
  for (auto e : a) sum_a += e;
  return cpk::dot_s4_generic(a.data(), twos.data(), k) == cpk::dot_u4_generic(a.data(), off.data(), k) - 8 * sum_a &&
         cpk::dot_s4_generic(a.data(), twos.data(), k) == cpk::dot_i8_generic(a.data(), w.data(), k);
}

void fail(const char* what, const char* variant, int64_t m, int64_t n, int64_t k, int64_t group, double got,
          double want) {
  if (failures++ < 10)
    std::printf("MISMATCH %s [%s] M=%lld N=%lld K=%lld group=%lld: %.9g != %.9g\n", what, variant, (long long)m,
                (long long)n, (long long)k, (long long)group, got, want);
}

// Each variant's activation quantizer against the twin: the same scale bits, bytes and group sums,
// on rows with ties (x / s exactly n + 0.5), NaN, infinities, zeros and lengths off the vector width.
bool quantizers_agree(Rng& rng, const std::vector<const Variant*>& todo) {
  bool ok = true;
  long rows = 0;
  for (int64_t k : {1, 7, 16, 31, 64, 70, 576, 2048})
    for (int kind = 0; kind < 5; ++kind) {
      std::vector<float> x(k);
      for (auto& e : x) e = rng.uniform() * 3.f;
      if (kind == 1) {  // amax 127: s = 1, so halves are exact ties
        for (int64_t i = 0; i < k; ++i) x[i] = float(rng.range(-126, 126)) + 0.5f;
        x[0] = 127.f;
      }
      if (kind == 2) x[k / 2] = std::nanf("");
      if (kind == 3) x[k - 1] = -INFINITY;
      if (kind == 4) std::fill(x.begin(), x.end(), 0.f);
      const int64_t group = k % 32 == 0 ? 32 : 0;
      const int64_t groups = group ? k / group : 0;
      std::vector<int8_t> want(k), got(k);
      std::vector<int32_t> want_sums(groups + 1), got_sums(groups + 1);
      float want_scale, got_scale;
      cpk::quantize_row_generic(x.data(), k, group, want.data(), &want_scale, want_sums.data());
      for (const Variant* v : todo) {
        ++rows;
        v->quantize_row(x.data(), k, group, got.data(), &got_scale, got_sums.data());
        if (std::memcmp(&got_scale, &want_scale, sizeof(float)) != 0 || got != want || got_sums != want_sums) {
          std::printf("MISMATCH quantize_row [%s] K=%lld kind=%d\n", v->name, (long long)k, kind);
          ok = false;
        }
      }
    }
  std::printf("%s activation quantizers (%ld rows against the twin)\n", ok ? "ok" : "FAILED", rows);
  return ok;
}

// int8 [N, K] in the variant's W8A8 layout.
std::vector<uint8_t> pack_int8(const Variant& v, const std::vector<int8_t>& w8, int64_t n, int64_t k) {
  if (!cpk::is_panels(v.int8)) return std::vector<uint8_t>(w8.begin(), w8.end());
  std::vector<uint8_t> pw(n * cpk::quad_k(k));
  for (int64_t p = 0; p < cpk::panel_count(n); ++p)
    cpk::pack_int8_panel(w8.data(), n, k, p, pw.data(), v.int8 == cpk::Int8Layout::OffsetPanels);
  return pw;
}

// int4 values [N, K] in the variant's layout, and its scales [N, groups] in that layout's order.
std::vector<uint8_t> pack_int4(const Variant& v, const std::vector<int8_t>& w4, int64_t n, int64_t k) {
  std::vector<uint8_t> pw(n * k / 2);
  if (cpk::is_panels(v.int4)) {
    for (int64_t p = 0; p < cpk::panel_count(n); ++p)
      cpk::pack_int4_panel(n, k, p, pw.data(), [&](int64_t c, int64_t i) { return uint8_t(w4[c * k + i] + 8); });
  } else {
    for (int64_t c = 0; c < n; ++c) cpk::pack_int4_row(w4.data() + c * k, k, pw.data() + c * (k / 2), v.int4);
  }
  return pw;
}
std::vector<float> pack_scales(const Variant& v, const std::vector<float>& s4, int64_t n, int64_t groups) {
  if (!cpk::is_panels(v.int4)) return s4;
  std::vector<float> sp(s4.size());
  for (int64_t p = 0; p < cpk::panel_count(n); ++p) cpk::pack_scales_panel(s4.data(), n, groups, p, sp.data());
  return sp;
}

void check_shape(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, int64_t group) {
  const Variant& twin = *v.twin;
  const Variant& generic = *cpk::variant_by_name("generic");
  std::vector<float> x(m * k);  // activations with a few outliers
  for (auto& e : x) e = rng.uniform() * (rng.range(0, 50) == 0 ? 20.f : 1.f);
  const cpk::LinearInput in{x.data(), cpk::DType::F32, m, k};

  // W8A8, channel-wise: bit-identical to the twin and to generic.
  std::vector<int8_t> w8(n * k);
  for (auto& e : w8) e = int8_t(rng.range(-128, 127));
  std::vector<float> s8(n);
  for (auto& e : s8) e = 0.001f + 0.01f * (rng.uniform() + 1.f);
  const std::vector<uint8_t> p8 = pack_int8(v, w8, n, k);
  std::vector<float> out(m * n), want(m * n), ref(m * n);
  cpk::w8a8_linear(v, kSplit, in, p8.data(), s8.data(), 1, n, out.data());
  cpk::w8a8_linear(twin, kSplit, in, p8.data(), s8.data(), 1, n, want.data());
  cpk::w8a8_linear(generic, kSplit, in, w8.data(), s8.data(), 1, n, ref.data());
  for (int64_t i = 0; i < m * n; ++i) {
    checks += 2;
    if (std::memcmp(&out[i], &want[i], sizeof(float)) != 0) fail("w8a8 vs twin", v.name, m, n, k, 0, out[i], want[i]);
    if (std::memcmp(&want[i], &ref[i], sizeof(float)) != 0) fail("w8a8 twin vs generic", v.name, m, n, k, 0, want[i], ref[i]);
  }

  // W4A8 with the given group (0: one group per row, i.e. channel-wise int4).
  const int64_t g = group ? group : k, groups = k / g;
  std::vector<int8_t> w4(n * k);
  for (auto& e : w4) e = int8_t(rng.range(-8, 7));
  std::vector<float> s4(n * groups);
  for (auto& e : s4) e = 0.001f + 0.01f * (rng.uniform() + 1.f);
  const std::vector<uint8_t> p4 = pack_int4(v, w4, n, k), rows = pack_int4(generic, w4, n, k);
  const std::vector<float> sp = pack_scales(v, s4, n, groups);
  cpk::w4a8_linear(v, kSplit, in, p4.data(), sp.data(), groups, n, out.data());
  cpk::w4a8_linear(twin, kSplit, in, p4.data(), sp.data(), groups, n, want.data());
  cpk::w4a8_linear(generic, kSplit, in, rows.data(), s4.data(), groups, n, ref.data());
  std::vector<float> sa(m);  // the activation scales, for the budget
  for (int64_t r = 0; r < m; ++r) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(x[r * k + i]));
    sa[r] = std::fmax(amax, 1e-8f) / 127.f;
  }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      checks += 2;
      const int64_t i = r * n + c;
      if (v.w4_exact ? std::memcmp(&out[i], &want[i], sizeof(float)) != 0 : out[i] != want[i])
        fail("w4a8 vs twin", v.name, m, n, k, g, out[i], want[i]);
      // Magnitude scale of the sum: sum_g |s_g| * 127 * 15 * g, times the activation scale.
      float scale = 0.f;
      for (int64_t gi = 0; gi < groups; ++gi) scale += s4[c * groups + gi];
      scale *= 127.f * 15.f * float(g) * sa[r];
      if (std::fabs(want[i] - ref[i]) > 4.f * 1.2e-7f * scale * float(groups))
        fail("w4a8 twin vs generic", v.name, m, n, k, g, want[i], ref[i]);
    }
}

// The bits of values [N, groups] in panel order (panel variants) or as they are.
// Super-block factors as a K-quant file holds them (fp16: GGUF's d, and -dmin for the offsets):
// random halves of 2^lo .. 2^hi times (1 + m / 1024), those below 2^-14 subnormal (m / 1024 times
// 2^-14, as a small dmin is), and their exact fp32 values.
struct Supers {
  std::vector<cpk::F16> half;
  std::vector<float> value;
};
Supers random_supers(Rng& rng, int64_t count, int lo, int hi, bool negative) {
  Supers s{std::vector<cpk::F16>(count), std::vector<float>(count)};
  for (int64_t i = 0; i < count; ++i) {
    const int exponent = std::max(0, int(rng.range(lo, hi)) + 15), mantissa = int(rng.range(1, 1023));
    s.half[i].bits = uint16_t((negative ? 0x8000 : 0) | (exponent << 10) | mantissa);
    s.value[i] = cpk::to_float(s.half[i]);
  }
  return s;
}

template <typename T>
std::vector<T> in_scale_order(const Variant& v, const std::vector<T>& values, int64_t n, int64_t groups) {
  if (!cpk::is_panels(v.int4)) return values;
  std::vector<T> out(values.size());
  for (int64_t p = 0; p < cpk::panel_count(n); ++p) cpk::pack_scales_panel(values.data(), n, groups, p, out.data());
  return out;
}

// Values [N, groups] in the driver's column chunks (offsets_index).
template <typename T>
std::vector<T> in_chunks(const std::vector<T>& values, int64_t n, int64_t groups) {
  std::vector<T> out(values.size());
  for (int64_t c = 0; c < n; ++c)
    for (int64_t gi = 0; gi < groups; ++gi) out[cpk::offsets_index(n, groups, gi, c)] = values[c * groups + gi];
  return out;
}

// A K-quant's linear with activations per super-block of `per` groups of g (GroupScales::fold_per):
// got bit-identical to the twin's (twin_codes), both within the float budget of an fp64 sum of the
// signed weights w (scales s, offsets off [N, groups]) times the same int8 activations.
long fold_shapes = 0;  // linears check_blocks took (the integer fold on the panel variants)
void check_blocks(const Variant& v, int64_t m, int64_t n, int64_t k, int64_t g, int64_t per,
                  const std::vector<float>& x, const std::vector<int8_t>& w, const std::vector<float>& s,
                  const std::vector<float>& off, const std::vector<float>& got, const std::vector<float>& twin_codes) {
  const int64_t groups = k / g, blocks = groups / per, inputs = g * per;
  std::vector<int8_t> q(k);
  std::vector<float> sa(blocks);
  std::vector<int32_t> sums(groups);
  ++fold_shapes;
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b)
      cpk::quantize_row_generic(x.data() + r * k + b * inputs, inputs, g, q.data() + b * inputs, &sa[b],
                                sums.data() + b * per);
    for (int64_t c = 0; c < n; ++c) {
      checks += 2;
      const int64_t i = r * n + c;
      if (std::memcmp(&got[i], &twin_codes[i], sizeof(float)) != 0)
        fail("K-quant codes, activations per super-block, vs twin", v.name, m, n, k, g, got[i], twin_codes[i]);
      double want = 0.0, scale = 0.0;
      for (int64_t gi = 0; gi < groups; ++gi) {
        int64_t dot = 0;
        for (int64_t j = gi * g; j < (gi + 1) * g; ++j) dot += int64_t(w[c * k + j]) * q[j];
        const double a = sa[gi / per];
        want += a * (double(s[c * groups + gi]) * double(dot) + double(off[c * groups + gi]) * double(sums[gi]));
        scale += a * (s[c * groups + gi] * 128.0 + std::fabs(off[c * groups + gi])) * 127.0 * double(g);
      }
      if (std::fabs(got[i] - want) > 4.0 * 1.2e-7 * scale * double(blocks + 1))
        fail("K-quant codes, activations per super-block, vs fp64", v.name, m, n, k, g, got[i], float(want));
    }
  }
}

// W8A8 in groups (16 for the channel case: Q6_K's) and W4A8 in groups, both with per-group offsets
// (the GGUF formats with a minimum): each variant bit-identical to its twin, the twin to generic
// within the float budget of the group sums' order. The scales and offsets are a K-quant's (6-bit
// codes under an fp16-precision factor per `per` groups, offset = 8 scale + factor * code), and the
// same linear with them coded (the driver expands them, linear_driver.h GroupScales) is
// bit-identical to it with them in fp32.
void check_grouped(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, int64_t group) {
  const Variant& twin = *v.twin;
  const Variant& generic = *cpk::variant_by_name("generic");
  std::vector<float> x(m * k);
  for (auto& e : x) e = rng.uniform() * (rng.range(0, 50) == 0 ? 20.f : 1.f);
  const cpk::LinearInput in{x.data(), cpk::DType::F32, m, k};
  std::vector<float> sa(m);
  for (int64_t r = 0; r < m; ++r) {
    float amax = 0.f;
    for (int64_t i = 0; i < k; ++i) amax = std::fmax(amax, std::fabs(x[r * k + i]));
    sa[r] = std::fmax(amax, 1e-8f) / 127.f;
  }
  for (int mode = 0; mode < 4; ++mode) {
    const int bits = mode % 2 ? 4 : 8;
    const bool act_groups = mode >= 2;  // activations scaled per group
    const int64_t g = bits == 8 && group == 0 ? 16 : (group ? group : k), groups = k / g;
    std::vector<int8_t> w(n * k);
    for (auto& e : w) e = bits == 8 ? int8_t(rng.range(-128, 127)) : int8_t(rng.range(-8, 7));
    const int64_t per = groups % 8 == 0 ? 8 : groups % 2 == 0 ? 2 : 1, supers = groups / per;
    std::vector<uint8_t> sc(n * groups), mc(n * groups);
    const Supers ssup_h = random_supers(rng, n * supers, -13, -11, false), osup_h = random_supers(rng, n * supers, -16, -14, true);
    const std::vector<float>&ssup = ssup_h.value, &osup = osup_h.value;
    std::vector<float> s(n * groups), off(n * groups);
    for (int64_t i = 0; i < n * groups; ++i) {
      sc[i] = uint8_t(rng.range(1, 63));
      mc[i] = uint8_t(rng.range(0, 63));
      const int64_t b = (i / groups) * supers + (i % groups) / per;
      s[i] = ssup[b] * float(sc[i]);  // exact, as the driver's
      off[i] = 8.f * s[i] + osup[b] * float(mc[i]);
    }
    const std::vector<float> off_t = in_chunks(off, n, groups);
    const std::vector<float> sp = pack_scales(v, s, n, groups);
    const std::vector<uint8_t> sc_p = in_scale_order(v, sc, n, groups), mc_t = in_chunks(mc, n, groups);
    const std::vector<cpk::F16> ssup_p = in_scale_order(v, ssup_h.half, n, supers), osup_t = in_chunks(osup_h.half, n, supers);
    cpk::GroupScales coded;
    coded.scales = {sc_p.data(), cpk::Code::U8, per > 1 || rng.range(0, 1) ? ssup_p.data() : nullptr, per};
    if (coded.scales.super == nullptr) coded.scales = {sp.data(), cpk::Code::F32, nullptr, 0};  // offsets alone
    coded.offsets = {mc_t.data(), cpk::Code::U8, osup_t.data(), per};
    coded.mid = 8.f;
    std::vector<float> from_codes(m * n), twin_codes(m * n);
    std::vector<float> out(m * n), want(m * n), ref(m * n);
    if (bits == 8) {
      const std::vector<uint8_t> p8 = pack_int8(v, w, n, k);
      cpk::w8a8_linear(v, kSplit, in, p8.data(), sp.data(), groups, n, out.data(), off_t.data(), act_groups);
      cpk::w8a8_linear(twin, kSplit, in, p8.data(), sp.data(), groups, n, want.data(), off_t.data(), act_groups);
      cpk::w8a8_linear(generic, kSplit, in, w.data(), s.data(), groups, n, ref.data(), off_t.data(), act_groups);
      cpk::w8a8_linear(v, kSplit, in, p8.data(), coded, groups, n, from_codes.data(), act_groups);
      cpk::w8a8_linear(twin, kSplit, in, p8.data(), coded, groups, n, twin_codes.data(), act_groups);
    } else {
      const std::vector<uint8_t> p4 = pack_int4(v, w, n, k), rows = pack_int4(generic, w, n, k);
      cpk::w4a8_linear(v, kSplit, in, p4.data(), sp.data(), groups, n, out.data(), off_t.data(), act_groups);
      cpk::w4a8_linear(twin, kSplit, in, p4.data(), sp.data(), groups, n, want.data(), off_t.data(), act_groups);
      cpk::w4a8_linear(generic, kSplit, in, rows.data(), s.data(), groups, n, ref.data(), off_t.data(), act_groups);
      cpk::w4a8_linear(v, kSplit, in, p4.data(), coded, groups, n, from_codes.data(), act_groups);
      cpk::w4a8_linear(twin, kSplit, in, p4.data(), coded, groups, n, twin_codes.data(), act_groups);
    }
    // Integer codes with activations per group: quantized per super-block instead (the panel variants
    // fold each in int32): the twin's bits, and within the float budget of an fp64 sum over the same
    // int8 activations (the twin quantizer's, per super-block).
    const int64_t per_block = act_groups ? coded.fold_per(g) : 0;
    if (per_block > 0) check_blocks(v, m, n, k, g, per_block, x, w, s, off, from_codes, twin_codes);
    const bool exact = bits == 8 || v.w4_exact;
    const char* what = bits == 8 ? (act_groups ? "grouped w8a8 + offsets, activations per group" : "grouped w8a8 + offsets")
                                 : (act_groups ? "w4a8 + offsets, activations per group" : "w4a8 + offsets");
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < n; ++c) {
        checks += 3;
        const int64_t i = r * n + c;
        if (exact ? std::memcmp(&out[i], &want[i], sizeof(float)) != 0 : out[i] != want[i])
          fail(what, v.name, m, n, k, g, out[i], want[i]);
        if (per_block == 0 && std::memcmp(&out[i], &from_codes[i], sizeof(float)) != 0)
          fail(bits == 8 ? "grouped w8a8, coded scales" : "w4a8, coded scales", v.name, m, n, k, g, from_codes[i],
               out[i]);
        float scale = 0.f;  // magnitude of the sums: weights, offsets, activations
        for (int64_t gi = 0; gi < groups; ++gi) scale += s[c * groups + gi] * 128.f + std::fabs(off[c * groups + gi]);
        scale *= 127.f * float(g) * sa[r];
        if (std::fabs(want[i] - ref[i]) > 4.f * 1.2e-7f * scale * float(groups + 1))
          fail(what, v.name, m, n, k, g, want[i], ref[i]);
      }
  }
}

// Int6 panels (Variant::int6; panel_layout.h): values in [-32, 31] held as nibbles plus a 2-bit
// plane, run by the W4A8 kernel. Each variant bit-identical to its twin and to the same values on
// its own int8 path (the same integer sums, folded by the same code: that path is checked against
// generic and fp64 above), with fp32 scales, with a K-quant's codes (Q6_K: int8 codes under a
// factor per 16 groups of 16, no offsets; Q5_K: 6-bit codes and minimums, mid 16, groups of 32) and
// activations per token, per group and per super-block (the integer fold).
long int6_shapes = 0;
void check_int6(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, int64_t g) {
  const Variant& twin = *v.twin;
  const int64_t groups = k / g;
  std::vector<float> x(m * k);
  for (auto& e : x) e = rng.uniform() * (rng.range(0, 50) == 0 ? 20.f : 1.f);
  const cpk::LinearInput in{x.data(), cpk::DType::F32, m, k};
  std::vector<int8_t> w(n * k);
  for (auto& e : w) e = int8_t(rng.range(-32, 31));
  std::vector<uint8_t> p6(n * cpk::int6_bytes_per_column(k));
  for (int64_t p = 0; p < n / cpk::kPanel; ++p)
    cpk::pack_int6_panel(k, p, p6.data(), [&](int64_t c, int64_t i) { return uint8_t(w[c * k + i] + 32); });
  const std::vector<uint8_t> p8 = pack_int8(v, w, n, k);
  const bool q6k = g == 16, offsets = !q6k;
  const int64_t per = groups % (q6k ? 16 : 8) == 0 ? (q6k ? 16 : 8) : 1, supers = groups / per;
  std::vector<uint8_t> sc(n * groups), mc(n * groups);
  const Supers ssup_h = random_supers(rng, n * supers, -13, -11, false), osup_h = random_supers(rng, n * supers, -16, -14, true);
  const std::vector<float>&ssup = ssup_h.value, &osup = osup_h.value;
  std::vector<float> s(n * groups), off(n * groups, 0.f);
  for (int64_t i = 0; i < n * groups; ++i) {
    const int64_t b = (i / groups) * supers + (i % groups) / per;
    sc[i] = q6k ? uint8_t(int8_t(rng.range(-128, 127))) : uint8_t(rng.range(1, 63));
    mc[i] = uint8_t(rng.range(0, 63));
    s[i] = ssup[b] * float(q6k ? float(int8_t(sc[i])) : float(sc[i]));
    if (offsets) off[i] = 16.f * s[i] + osup[b] * float(mc[i]);
  }
  const std::vector<float> sp = pack_scales(v, s, n, groups), off_t = in_chunks(off, n, groups);
  const std::vector<uint8_t> sc_p = in_scale_order(v, sc, n, groups), mc_t = in_chunks(mc, n, groups);
  const std::vector<cpk::F16> ssup_p = in_scale_order(v, ssup_h.half, n, supers), osup_t = in_chunks(osup_h.half, n, supers);
  cpk::GroupScales coded, plain;
  coded.scales = {sc_p.data(), q6k ? cpk::Code::I8 : cpk::Code::U8, ssup_p.data(), per};
  if (offsets) coded.offsets = {mc_t.data(), cpk::Code::U8, osup_t.data(), per}, coded.mid = 16.f;
  plain.scales = {sp.data(), cpk::Code::F32, nullptr, 0};
  if (offsets) plain.offsets = {off_t.data(), cpk::Code::F32, nullptr, 0};
  ++int6_shapes;
  for (const cpk::GroupScales* gs : {&plain, &coded})
    for (bool act_groups : {false, true}) {
      std::vector<float> got(m * n), want(m * n), int8(m * n);
      cpk::w4a8_linear(v, kSplit, in, p6.data(), *gs, groups, n, got.data(), act_groups, 2);
      cpk::w4a8_linear(twin, kSplit, in, p6.data(), *gs, groups, n, want.data(), act_groups, 2);
      cpk::w8a8_linear(v, kSplit, in, p8.data(), *gs, groups, n, int8.data(), act_groups);
      const char* what = gs == &plain ? (act_groups ? "int6, activations per group" : "int6")
                                      : (act_groups ? "int6, codes, activations per group or super-block"
                                                    : "int6, codes");
      for (int64_t i = 0; i < m * n; ++i) {
        checks += 2;
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) fail(what, v.name, m, n, k, g, got[i], want[i]);
        if (std::memcmp(&got[i], &int8[i], sizeof(float)) != 0)
          fail("int6 vs the same values as int8", v.name, m, n, k, g, got[i], int8[i]);
      }
    }
}

// The simple GGUF types' scales (Q4_0, Q8_0: an fp16 code per group, no factor; Q4_1: offsets too,
// mid * scale + an fp16 minimum), coded: bit-identical to the same values stored in fp32 and to the
// twin, with and without offsets, at decode's M (whose kernels read them in place: LinearArgs::direct)
// and at the blocks'.
void check_fp16_codes(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, int64_t group) {
  std::vector<float> x(m * k);
  for (auto& e : x) e = rng.uniform();
  const cpk::LinearInput in{x.data(), cpk::DType::F32, m, k};
  const int64_t g = group ? group : 32, groups = k / g;
  for (int mode = 0; mode < 8; ++mode) {
    const int bits = mode % 2 ? 4 : 8;
    const bool act_groups = mode & 2, with_offsets = mode & 4;
    std::vector<int8_t> w(n * k);
    for (auto& e : w) e = bits == 8 ? int8_t(rng.range(-128, 127)) : int8_t(rng.range(-8, 7));
    std::vector<cpk::F16> sc(n * groups), mc(n * groups);
    std::vector<float> s(n * groups), off(n * groups);
    for (int64_t i = 0; i < n * groups; ++i) {
      sc[i].bits = uint16_t(rng.range(0x1400, 0x2400));                               // 2^-10 .. 2^-6
      mc[i].bits = uint16_t(rng.range(0, 0x2400) | (rng.range(0, 1) ? 0x8000 : 0));  // subnormals too
      s[i] = cpk::to_float(sc[i]);
      off[i] = 8.f * s[i] + cpk::to_float(mc[i]);
    }
    const std::vector<float> sp = pack_scales(v, s, n, groups), off_t = in_chunks(off, n, groups);
    const std::vector<cpk::F16> sc_p = in_scale_order(v, sc, n, groups), mc_t = in_chunks(mc, n, groups);
    cpk::GroupScales coded;
    coded.scales = {sc_p.data(), cpk::Code::F16, nullptr, 0};
    if (with_offsets) coded.offsets = {mc_t.data(), cpk::Code::F16, nullptr, 0};
    coded.mid = 8.f;
    const float* offsets = with_offsets ? off_t.data() : nullptr;
    std::vector<float> out(m * n), want(m * n), from_codes(m * n);
    if (bits == 8) {
      const std::vector<uint8_t> p8 = pack_int8(v, w, n, k);
      cpk::w8a8_linear(v, kSplit, in, p8.data(), sp.data(), groups, n, out.data(), offsets, act_groups);
      cpk::w8a8_linear(*v.twin, kSplit, in, p8.data(), sp.data(), groups, n, want.data(), offsets, act_groups);
      cpk::w8a8_linear(v, kSplit, in, p8.data(), coded, groups, n, from_codes.data(), act_groups);
    } else {
      const std::vector<uint8_t> p4 = pack_int4(v, w, n, k);
      cpk::w4a8_linear(v, kSplit, in, p4.data(), sp.data(), groups, n, out.data(), offsets, act_groups);
      cpk::w4a8_linear(*v.twin, kSplit, in, p4.data(), sp.data(), groups, n, want.data(), offsets, act_groups);
      cpk::w4a8_linear(v, kSplit, in, p4.data(), coded, groups, n, from_codes.data(), act_groups);
    }
    const char* what = bits == 8 ? "grouped w8a8, fp16 codes" : "w4a8, fp16 codes";
    for (int64_t i = 0; i < m * n; ++i) {
      checks += 2;
      if (std::memcmp(&from_codes[i], &out[i], sizeof(float)) != 0) fail(what, v.name, m, n, k, g, from_codes[i], out[i]);
      if ((bits == 8 || v.w4_exact) && std::memcmp(&out[i], &want[i], sizeof(float)) != 0)
        fail(bits == 8 ? "grouped w8a8 vs twin" : "w4a8 vs twin", v.name, m, n, k, g, out[i], want[i]);
    }
  }
}

template <typename E>
E narrow_to(float f);
template <>
float narrow_to<float>(float f) { return f; }
template <>
cpk::Bf16 narrow_to<cpk::Bf16>(float f) {  // truncation: any bf16 value will do
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return cpk::Bf16{uint16_t(bits >> 16)};
}
template <>
cpk::F16 narrow_to<cpk::F16>(float f) {  // |f| < 1: a normal or zero half, mantissa truncated
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t sign = (bits >> 16) & 0x8000, exponent = (bits >> 23) & 0xFF;
  if (exponent < 113) return cpk::F16{uint16_t(sign)};
  return cpk::F16{uint16_t(sign | ((exponent - 112) << 10) | ((bits >> 13) & 0x3FF))};
}

const char* dtype_name(cpk::DType t) { return t == cpk::DType::F32 ? "fp32" : t == cpk::DType::Bf16 ? "bf16" : "fp16"; }

// x [M, K] of type A, w [N, K] of type E: the variant's float linear and its twin's, both through the
// driver on float panels, against a double sum over the row-major weights.
template <typename A, typename E>
void check_float(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, cpk::DType xt, cpk::DType wt) {
  std::vector<A> x(m * k);
  std::vector<E> w(n * k);
  for (auto& e : x) e = narrow_to<A>(rng.uniform());
  for (auto& e : w) e = narrow_to<E>(rng.uniform());
  std::vector<E> panels(cpk::float_panel_elements(n, k));
  for (int64_t p = 0; p < cpk::panel_count(n); ++p) cpk::pack_float_panel(w.data(), n, k, p, panels.data());
  std::vector<float> out(m * n), twin(m * n);
  const cpk::LinearInput in{x.data(), xt, m, k};
  cpk::float_linear(v, kSplit, in, panels.data(), wt, n, out.data());
  cpk::float_linear(*v.twin, kSplit, in, panels.data(), wt, n, twin.data());
  char what[64];
  std::snprintf(what, sizeof what, "float linear, %s x, %s w", dtype_name(xt), dtype_name(wt));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      double ref = 0, magnitude = 0;
      for (int64_t j = 0; j < k; ++j) {
        const double prod = double(cpk::to_float(x[r * k + j])) * double(cpk::to_float(w[c * k + j]));
        ref += prod;
        magnitude += std::fabs(prod);
      }
      const double budget = double(k + 2) * 5.9604645e-8 * magnitude;
      checks += 2;
      if (std::fabs(out[r * n + c] - ref) > budget) fail(what, v.name, m, n, k, 0, out[r * n + c], ref);
      if (std::fabs(twin[r * n + c] - ref) > budget) fail(what, v.twin->name, m, n, k, 0, twin[r * n + c], ref);
    }
}

void check_floats(const Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k) {
  using cpk::DType;
  check_float<float, float>(v, rng, m, n, k, DType::F32, DType::F32);
  check_float<float, cpk::Bf16>(v, rng, m, n, k, DType::F32, DType::Bf16);
  check_float<float, cpk::F16>(v, rng, m, n, k, DType::F32, DType::F16);
  if (m % 4 == 1) {  // 16-bit activations (widened by the driver) on a sample of shapes
    check_float<cpk::Bf16, cpk::Bf16>(v, rng, m, n, k, DType::Bf16, DType::Bf16);
    check_float<cpk::F16, float>(v, rng, m, n, k, DType::F16, DType::F32);
  }
}

// A random K/V cache of T in [-1, 1) (int8: [-127, 127] with one scale per row of `rows`, each
// in [0.5, 1] / 127, so rows read as values in [-1, 1]), and the DType it is read as.
template <typename T>
void random_cache(Rng& rng, std::vector<T>& k, std::vector<T>& val, std::vector<float>& k_scale,
                  std::vector<float>& v_scale, int64_t rows) {
  for (size_t i = 0; i < k.size(); ++i) {
    if constexpr (std::is_same<T, int8_t>::value) {
      k[i] = int8_t(rng.range(-127, 127));
      val[i] = int8_t(rng.range(-127, 127));
    } else {
      k[i] = narrow_to<T>(rng.uniform());
      val[i] = narrow_to<T>(rng.uniform());
    }
  }
  if constexpr (std::is_same<T, int8_t>::value) {
    k_scale.resize(rows);
    v_scale.resize(rows);
    for (auto& s : k_scale) s = (0.5f + 0.5f * std::fabs(rng.uniform())) / 127.f;
    for (auto& s : v_scale) s = (0.5f + 0.5f * std::fabs(rng.uniform())) / 127.f;
  }
}

template <typename T>
cpk::DType cache_dtype() {
  return std::is_same<T, cpk::Bf16>::value ? cpk::DType::Bf16
         : std::is_same<T, cpk::F16>::value ? cpk::DType::F16
                                            : cpk::DType::F32;
}

// One decode-attention case: n sequences of random lengths up to `longest`, hkv KV heads of `group`
// query heads, head dimension d, keys/values stored as T (int8 with a scale per row), in a
// contiguous cache or in a paged one through shuffled slots.
template <typename T>
void check_attention(const Variant& v, Rng& rng, int64_t n, int64_t hkv, int64_t group, int64_t d, int64_t longest,
                     bool paged) {
  const int64_t hq = hkv * group, batches = paged ? 1 : n, positions = paged ? n * longest : longest;
  std::vector<int64_t> lengths(n), slots(paged ? n * longest : 0);
  for (auto& l : lengths) l = rng.range(1, int(longest));
  lengths[0] = longest;
  for (int64_t i = 0; i < int64_t(slots.size()); ++i) slots[i] = i;
  for (int64_t i = int64_t(slots.size()) - 1; i > 0; --i) std::swap(slots[i], slots[rng.next() % uint64_t(i + 1)]);
  const int64_t elements = batches * positions * hkv * d;
  std::vector<T> k(elements), val(elements);
  std::vector<float> k_scale, v_scale, q(n * hq * d), out(n * hq * d), twin(n * hq * d);
  for (auto& e : q) e = rng.uniform();
  const bool int8 = std::is_same<T, int8_t>::value;
  random_cache(rng, k, val, k_scale, v_scale, batches * positions * hkv);
  const cpk::DType dtype = cache_dtype<T>();
  const float scale = 1.f / std::sqrt(float(d));
  cpk::AttentionArgs a{q.data(), k.data(), val.data(), dtype, int8 ? k_scale.data() : nullptr,
                       int8 ? v_scale.data() : nullptr, positions * hkv, hkv, 1, lengths.data(),
                       paged ? slots.data() : nullptr, longest, n, hq, hkv, d, positions * hkv * d, hkv * d, d,
                       longest, scale, out.data()};
  v.decode_attention(a, kSplit);
  a.out = twin.data();
  cpk::decode_attention_generic(a, kSplit);
  char what[96];
  std::snprintf(what, sizeof what, "attention, %s cache%s, %lld heads per KV head, D=%lld",
                int8 ? "int8" : dtype_name(dtype), paged ? " (paged)" : "", (long long)group, (long long)d);
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t head = h / group, length = lengths[s];
      auto at = [&](int64_t l) { return (paged ? slots[s * longest + l] : s * positions + l) * hkv + head; };
      auto stored = [&](const std::vector<T>& cache, const std::vector<float>& scales, int64_t l, int64_t i) {
        return double(cpk::to_float(cache[at(l) * d + i])) * (int8 ? double(scales[at(l)]) : 1.0);
      };
      std::vector<double> score(length);
      double top = -1e300, total = 0;
      for (int64_t l = 0; l < length; ++l) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += double(q[(s * hq + h) * d + i]) * stored(k, k_scale, l, i);
        score[l] = dot * double(scale);
        top = std::max(top, score[l]);
      }
      for (auto& e : score) total += (e = std::exp(e - top));
      const double budget = 1e-6 + 4 * double(length + d) * 5.9604645e-8;
      for (int64_t i = 0; i < d; ++i) {
        double ref = 0;
        for (int64_t l = 0; l < length; ++l) ref += score[l] / total * stored(val, v_scale, l, i);
        const int64_t at_out = (s * hq + h) * d + i;
        checks += 2;
        if (std::fabs(out[at_out] - ref) > budget) fail(what, v.name, n, length, d, group, out[at_out], ref);
        if (std::fabs(twin[at_out] - ref) > budget) fail(what, "generic", n, length, d, group, twin[at_out], ref);
      }
    }
}

void check_attentions(const Variant& v, Rng& rng) {
  // 36: ymm's and zmm's portable loops, NEON's blocks; 30: none's blocks; 48: zmm's blocks a chunk at a time
  for (int64_t d : {64, 128, 36, 30, 48})
    for (int64_t group : {1, 3, 8})  // value_sums' widths: 4, 2 and 1 chunks at a time on ymm, 4 and 2 on zmm
      for (int64_t longest : {1, 5, 17, 300})
        for (bool paged : {false, true}) {
          const int64_t n = longest == 300 ? 1 : 3, hkv = longest == 300 ? 1 : 2;  // 300: one job, split in parts
          check_attention<float>(v, rng, n, hkv, group, d, longest, paged);
          check_attention<cpk::Bf16>(v, rng, n, hkv, group, d, longest, paged);
          check_attention<cpk::F16>(v, rng, n, hkv, group, d, longest, paged);
          check_attention<int8_t>(v, rng, n, hkv, group, d, longest, paged);
        }
}

// One prefill-attention case: b sequences of t new tokens with `context` keys each (a contiguous
// cache; paged: one sequence through shuffled slots), hkv KV heads of `group` query heads, head
// dimension d, an optional window, keys/values stored as T. bf16_queries: the queries are bf16
// values and say so (q_bf16), which lets a variant with AVX512_BF16 take its bf16 pairs; its
// probabilities are then rounded to bf16 (relative error 2^-9 each), so the budget gains
// 2^-8 * the largest |value| (1 here).
template <typename T>
void check_prefill(const Variant& v, Rng& rng, int64_t b, int64_t t, int64_t context, int64_t window, int64_t hkv,
                   int64_t group, int64_t d, bool paged, bool bf16_queries = false) {
  const int64_t hq = hkv * group, positions = paged ? context + 7 : context;
  std::vector<int64_t> slots(paged ? context : 0);
  if (paged) {
    std::vector<int64_t> all(positions);
    for (int64_t i = 0; i < positions; ++i) all[i] = i;
    for (int64_t i = positions - 1; i > 0; --i) std::swap(all[i], all[rng.next() % uint64_t(i + 1)]);
    std::copy(all.begin(), all.begin() + context, slots.begin());
  }
  const bool int8 = std::is_same<T, int8_t>::value;
  const int64_t elements = b * positions * hkv * d;
  std::vector<T> k(elements), val(elements);
  std::vector<float> k_scale, v_scale, q(b * t * hq * d), out(q.size()), twin(q.size());
  for (auto& e : q) e = bf16_queries ? cpk::to_float(narrow_to<cpk::Bf16>(rng.uniform())) : rng.uniform();
  random_cache(rng, k, val, k_scale, v_scale, b * positions * hkv);
  const cpk::DType dtype = cache_dtype<T>();
  const float scale = 1.f / std::sqrt(float(d));
  cpk::PrefillArgs a{};
  a.q = q.data(), a.k = k.data(), a.v = val.data(), a.dtype = dtype;
  a.k_scale = int8 ? k_scale.data() : nullptr, a.v_scale = int8 ? v_scale.data() : nullptr;
  a.sb = positions * hkv, a.ss = hkv, a.sh = 1;
  a.slots = paged ? slots.data() : nullptr;
  a.b = b, a.t = t, a.hq = hq, a.hkv = hkv, a.d = d, a.kb = positions * hkv * d, a.ks = hkv * d, a.kh = d;
  a.context = context, a.window = window, a.scale = scale, a.out = out.data(), a.q_bf16 = bf16_queries;
  v.prefill_attention(a, kSplit);
  a.out = twin.data();
  cpk::prefill_attention_generic(a, kSplit);
  char what[128];
  std::snprintf(what, sizeof what, "prefill attention, %s cache%s%s, T=%lld of %lld keys, window %lld, group %lld, D=%lld",
                int8 ? "int8" : dtype_name(dtype), paged ? " (paged)" : "", bf16_queries ? ", bf16 queries" : "",
                (long long)t, (long long)context, (long long)window, (long long)group, (long long)d);
  for (int64_t s = 0; s < b; ++s)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t head = h / group, last = context - t + i;
        const int64_t first = window > 0 ? std::max<int64_t>(0, last - window + 1) : 0;
        auto at = [&](int64_t l) { return (s * positions + (paged ? slots[l] : l)) * hkv + head; };
        auto stored = [&](const std::vector<T>& cache, const std::vector<float>& scales, int64_t l, int64_t x) {
          return double(cpk::to_float(cache[at(l) * d + x])) * (int8 ? double(scales[at(l)]) : 1.0);
        };
        const float* qr = q.data() + ((s * t + i) * hq + h) * d;
        std::vector<double> score(last + 1);
        double top = -1e300, total = 0;
        for (int64_t l = first; l <= last; ++l) {
          double dot = 0;
          for (int64_t x = 0; x < d; ++x) dot += double(qr[x]) * stored(k, k_scale, l, x);
          score[l] = dot * double(scale);
          top = std::max(top, score[l]);
        }
        for (int64_t l = first; l <= last; ++l) total += (score[l] = std::exp(score[l] - top));
        const double budget = 1e-6 + 4 * double(last - first + 1 + d) * 5.9604645e-8;
        const double rounded = bf16_queries ? 1.0 / 256 : 0.0;  // the bf16 pairs' probabilities
        for (int64_t x = 0; x < d; ++x) {
          double ref = 0;
          for (int64_t l = first; l <= last; ++l) ref += score[l] / total * stored(val, v_scale, l, x);
          const int64_t o = ((s * t + i) * hq + h) * d + x;
          checks += 2;
          if (std::fabs(out[o] - ref) > budget + rounded) fail(what, v.name, t, context, d, group, out[o], ref);
          if (std::fabs(twin[o] - ref) > budget) fail(what, "generic", t, context, d, group, twin[o], ref);
        }
      }
}

void check_prefills(const Variant& v, Rng& rng) {
  struct Case {
    int64_t t, context, window;
  };
  // 1 token; a short prompt; blocks of 64 keys cut by the diagonal; a chunk behind cached keys; a
  // window inside the context and one shorter than a key block.
  const Case cases[] = {{1, 1, 0}, {5, 5, 0}, {70, 70, 0}, {40, 150, 0}, {33, 200, 50}, {64, 64, 16}};
  for (int64_t d : {64, 36, 30})  // 36: ymm's and zmm's portable loops, NEON's blocks; 30: nobody's blocks
    for (int64_t group : {1, 3})
      for (const Case& c : cases)
        for (bool paged : {false, true}) {
          const int64_t b = paged ? 1 : 2, hkv = 2;
          check_prefill<float>(v, rng, b, c.t, c.context, c.window, hkv, group, d, paged);
          check_prefill<cpk::Bf16>(v, rng, b, c.t, c.context, c.window, hkv, group, d, paged);
          check_prefill<cpk::Bf16>(v, rng, b, c.t, c.context, c.window, hkv, group, d, paged, true);
          check_prefill<cpk::F16>(v, rng, b, c.t, c.context, c.window, hkv, group, d, paged);
          check_prefill<int8_t>(v, rng, b, c.t, c.context, c.window, hkv, group, d, paged);
        }
  for (bool bf16_queries : {false, true}) {  // the 2B shape's head dimension and group, one long-ish case
    check_prefill<cpk::Bf16>(v, rng, 1, 100, 300, 0, 2, 8, 128, true, bf16_queries);
    // 96 (Phi-3): the bf16 pairs' 32-column tail; 80: the fp32 engine's tails of 1-3 vectors
    for (int64_t d : {96, 80}) check_prefill<cpk::Bf16>(v, rng, 1, 70, 90, 0, 2, 2, d, false, bf16_queries);
  }
  check_prefill<float>(v, rng, 1, 70, 90, 0, 2, 2, 80, false);
}

// The dot-peak loop does the multiply-adds it claims: with all-ones operands the lanes' sum is the
// count, rounds * dot_peak_macs (what the benchmark divides by time).
void dot_peak_counts(const Variant& v) {
  for (int64_t rounds : {1, 7, 1000}) {
    const int64_t got = v.dot_peak(rounds), want = rounds * v.dot_peak_macs;
    if (got != want) {
      std::printf("FAILED %s dot_peak(%ld): lanes sum to %ld, expected %ld\n", v.name, long(rounds), long(got),
                  long(want));
      ++failures;
      return;
    }
  }
}

const char* int4_name(cpk::Int4Layout l) {
  return l == cpk::Int4Layout::TwosComplementRows ? "two's-complement" : "offset";
}

}  // namespace

int main(int argc, char** argv) {
  const Variant& best = cpk::best_variant();
  std::printf("selected variant: %s\n", best.name);
  std::vector<const Variant*> todo;
  if (argc > 1) {
    const Variant* v = cpk::variant_by_name(argv[1]);
    if (v == nullptr || !cpk::runs_here(*v)) {
      std::printf("variant %s is not compiled in or does not run on this CPU\n", argv[1]);
      return 2;
    }
    todo.push_back(v);
  } else {
    for (const Variant* v : cpk::compiled_variants())
      if (cpk::runs_here(*v)) todo.push_back(v);
  }
  Rng rng;
  if (!layouts_agree(rng)) {
    std::printf("FAILED: the offset and two's-complement twins disagree\n");
    return 1;
  }
  if (!quantizers_agree(rng, todo)) return 1;
  const int64_t ns[] = {1, 2, 3, 7, 16, 33, 70};
  const int64_t ks[] = {128, 384, 1024, 4096};
  const int64_t group_sizes[] = {32, 64, 128, 0};
  std::vector<const void*> attention_checked;
  for (const Variant* v : todo) {
    const long before = checks, folds_before = fold_shapes, int6_before = int6_shapes;
    const int failed_before = failures;
    if (v->dot_peak != nullptr) dot_peak_counts(*v);  // a twin row named on the command line has none
    for (int64_t m = 1; m <= 17; ++m)
      for (int64_t n : ns)
        for (int64_t k : ks)
          for (int64_t group : group_sizes) {
            if (k == 4096 && (m % 4 != 1 || n > 7)) continue;  // the big K on a sample of shapes
            check_shape(*v, rng, m, n, k, group);
            if (m <= 3 || m == 5 || m == 9 || m == 16 || m == 17) {  // decode, blocks, 4-panel decode, tails
              check_grouped(*v, rng, m, n, k, group);
              check_fp16_codes(*v, rng, m, n, k, group);
            }
          }
    if (v->int6)
      for (int64_t m : {1, 2, 3, 5, 9, 16, 17, 40})
        for (int64_t n : {16, 48, 80})
          for (int64_t k : {256, 512, 768})
            for (int64_t g : {16, 32}) check_int6(*v, rng, m, n, k, g);
    for (int64_t m : {1, 2, 3, 5, 6, 7, 8, 9, 13, 17, 50, 97})
      for (int64_t n : {1, 7, 16, 33, 70})
        for (int64_t k : {1, 3, 64, 577})
          if (m <= 17 || (n == 33 && k == 64)) check_floats(*v, rng, m, n, k);
    // Attention kernels shared by several rows (the Arm variants' NEON blocks, avx2's and avx_vnni's)
    // are the same code: checked with the first row that has them (under qemu, checking them again
    // for each Arm variant tripled the emulated run's cost and covered nothing more).
    auto first_with = [&](const void* kernel) {
      if (std::find(attention_checked.begin(), attention_checked.end(), kernel) != attention_checked.end()) return false;
      attention_checked.push_back(kernel);
      return true;
    };
    bool shared = true;
    if (first_with((const void*)v->decode_attention)) check_attentions(*v, rng), shared = false;
    if (first_with((const void*)v->prefill_attention)) check_prefills(*v, rng), shared = false;
    std::printf("%s %s (%s int4%s): %ld checks against %s (M 1..17, N 1..70, K 128..4096, groups "
                "32/64/128/channel; W8A8 also in groups of 16..128, both with offsets (fp32 and coded), fp16 codes with and without offsets, and "
                "per-group activations at M 1, 2, 3, 5, 17 (K-quant codes per super-block: %ld linears); int6 panels: %ld linears; float linears, fp32/bf16/fp16 weights, M 1..97, N 1..70, K 1..577; "
                "decode and prefill attention%s, fp32/bf16/fp16/int8 caches, contiguous and paged, windows; the dot-peak loop's count)%s\n",
                failures == failed_before ? "ok" : "FAILED", v->name, int4_name(v->int4),
                cpk::is_panels(v->int4) ? ", panels" : "", checks - before, v->twin->name, fold_shapes - folds_before,
                int6_shapes - int6_before,
                shared ? " (the same kernels as an earlier row's: checked there)" : "", v == &best ? " [selected]" : "");
  }
  return failures == 0 ? 0 : 1;
}
