// Stand-alone check of the kernel core, no torch: every variant this CPU runs (or the one named on
// the command line) against the scalar twin, on odd shapes. Built natively or cross-compiled for
// aarch64 and run under qemu (cpuserve/kernels/cross_check.py); prints the selected variant.
//
// Budgets: integer dot products exact; W8A8 outputs bit-identical (shared float epilogue); W4A8
// bit-identical where the variant says so (Arm), else within 4 float ulps of the output's scale
// times the number of groups (x86 sums groups in vector lanes).
//
// usage: kernel_check [VARIANT]   exit 0 when every check passes

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "qlinear_core.h"

namespace {

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

bool runs_here(const std::string& name) {
  const std::string best = cpk::best_variant();
  if (name == "generic" || name == best) return true;
#if defined(__x86_64__)
  return name == "avx2" && best == "avx512_vnni";
#else
  if (best == "neon_i8mm") return name == "neon_dotprod" || name == "neon";
  if (best == "neon_dotprod") return name == "neon";
  return false;
#endif
}

int failures = 0;
long checks = 0;

// The two twins must agree on the integers: a row packed both ways, the same dot product.
bool layouts_agree(Rng& rng) {
  const int64_t k = 256;
  std::vector<int8_t> a(k), w(k);
  for (auto& e : a) e = int8_t(rng.range(-127, 127));
  for (auto& e : w) e = int8_t(rng.range(-8, 7));
  std::vector<uint8_t> off(k / 2), twos(k / 2);
  cpk::pack_int4_row(w.data(), k, off.data(), cpk::Int4Layout::Offset);
  cpk::pack_int4_row(w.data(), k, twos.data(), cpk::Int4Layout::TwosComplement);
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

// The variant's W8A8 linear over [0, N), its outputs (or panels) split in two uneven parts as two
// threads would split them.
void w8a8_split(const cpk::Variant& v, const std::vector<int8_t>& qa, const std::vector<float>& sa, int64_t m,
                int64_t k, const std::vector<int8_t>& w8, const std::vector<float>& s8, int64_t n,
                std::vector<float>& out) {
  if (v.panels) {
    std::vector<uint8_t> pw(n * cpk::quad_k(k));
    for (int64_t p = 0; p < cpk::panel_count(n); ++p)
      cpk::pack_int8_panel(w8.data(), n, k, p, pw.data(), v.panels == cpk::kVnniPanels);
    std::vector<int8_t> padded(qa);
    padded.resize(qa.size() + 4);  // rows readable 4 bytes past the last, as the binding keeps them
    std::vector<int32_t> asum(m, 0);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) asum[r] += qa[r * k + i];
    const int64_t panels = cpk::panel_count(n), split = panels / 3;
    cpk::w8a8_panels(v, padded.data(), sa.data(), asum.data(), m, k, pw.data(), s8.data(), n, 0, split, out.data());
    cpk::w8a8_panels(v, padded.data(), sa.data(), asum.data(), m, k, pw.data(), s8.data(), n, split, panels,
                     out.data());
    return;
  }
  const int64_t split = n / 3;
  cpk::w8a8_columns(v, qa.data(), sa.data(), m, k, w8.data(), s8.data(), n, 0, split, out.data());
  cpk::w8a8_columns(v, qa.data(), sa.data(), m, k, w8.data(), s8.data(), n, split, n, out.data());
}

// The same for W4A8 (rows: the weight packed in the variant's row layout, given).
void w4a8_split(const cpk::Variant& v, const std::vector<int8_t>& qa, const std::vector<float>& sa,
                const std::vector<int32_t>& gs, int64_t m, int64_t k, const std::vector<int8_t>& w4,
                const std::vector<uint8_t>& rows, const std::vector<float>& s4, int64_t groups, int64_t n,
                std::vector<float>& out) {
  if (v.panels) {
    std::vector<uint8_t> pw(n * k / 2);
    for (int64_t p = 0; p < cpk::panel_count(n); ++p)
      cpk::pack_int4_panel(n, k, p, pw.data(), [&](int64_t c, int64_t i) { return uint8_t(w4[c * k + i] + 8); });
    const int64_t panels = cpk::panel_count(n), split = panels / 3;
    std::vector<float> sp(s4.size());
    for (int64_t p = 0; p < panels; ++p) cpk::pack_scales_panel(s4.data(), n, groups, p, sp.data());
    cpk::w4a8_panels(v, qa.data(), sa.data(), gs.data(), m, k, pw.data(), sp.data(), groups, n, 0, split,
                     out.data());
    cpk::w4a8_panels(v, qa.data(), sa.data(), gs.data(), m, k, pw.data(), sp.data(), groups, n, split, panels,
                     out.data());
    return;
  }
  const int64_t split = n / 3;
  cpk::w4a8_columns(v, qa.data(), sa.data(), gs.data(), m, k, rows.data(), s4.data(), groups, n, 0, split,
                    out.data());
  cpk::w4a8_columns(v, qa.data(), sa.data(), gs.data(), m, k, rows.data(), s4.data(), groups, n, split, n,
                    out.data());
}

// The SIMD activation quantizers against the twin: the same scale bits, bytes and group sums, on
// rows with ties (x / s exactly n + 0.5), NaN, infinities, zeros and lengths off the vector width.
bool quantizers_agree(Rng& rng) {
  using Quantizer = void (*)(const float*, int64_t, int64_t, int8_t*, float*, int32_t*);
  std::vector<std::pair<const char*, Quantizer>> simd;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) simd.push_back({"avx2", cpk::quantize_row_avx2});
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
    simd.push_back({"avx512", cpk::quantize_row_avx512});
#endif
  simd.push_back({"dispatched", cpk::quantize_row});
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
      for (const auto& [name, quantize] : simd) {
        ++rows;
        quantize(x.data(), k, group, got.data(), &got_scale, got_sums.data());
        if (std::memcmp(&got_scale, &want_scale, sizeof(float)) != 0 || got != want || got_sums != want_sums) {
          std::printf("MISMATCH quantize_row [%s] K=%lld kind=%d\n", name, (long long)k, kind);
          ok = false;
        }
      }
    }
  std::printf("%s activation quantizers (%ld rows against the twin)\n", ok ? "ok" : "FAILED", rows);
  return ok;
}

void check_shape(const cpk::Variant& v, Rng& rng, int64_t m, int64_t n, int64_t k, int64_t group) {
  const cpk::Variant& twin = cpk::twin_for(v.layout);  // the scalar twin of the variant's int4 layout
  // Activations with a few outliers, quantized per token as the kernels do.
  std::vector<float> x(m * k);
  for (auto& e : x) e = rng.uniform() * (rng.range(0, 50) == 0 ? 20.f : 1.f);
  const int64_t groups = group ? k / group : 1;
  std::vector<int8_t> qa(m * k);
  std::vector<float> sa(m);
  std::vector<int32_t> gs(m * groups);
  for (int64_t r = 0; r < m; ++r)
    cpk::quantize_row(x.data() + r * k, k, group ? group : k, qa.data() + r * k, &sa[r], gs.data() + r * groups);

  // W8A8, channel-wise: integer dot products exact, outputs bit-identical.
  std::vector<int8_t> w8(n * k);
  for (auto& e : w8) e = int8_t(rng.range(-128, 127));
  std::vector<float> s8(n);
  for (auto& e : s8) e = 0.001f + 0.01f * (rng.uniform() + 1.f);
  if (!v.panels)
    for (int64_t c = 0; c < n; ++c)
      for (int64_t r = 0; r < m; ++r) {
        ++checks;
        const int32_t got = v.dot_i8(qa.data() + r * k, w8.data() + c * k, k);
        const int32_t want = cpk::dot_i8_generic(qa.data() + r * k, w8.data() + c * k, k);
        if (got != want) fail("dot_i8", v.name, m, n, k, 0, got, want);
      }
  std::vector<float> out(m * n), ref(m * n);
  w8a8_split(v, qa, sa, m, k, w8, s8, n, out);
  cpk::w8a8_columns(twin, qa.data(), sa.data(), m, k, w8.data(), s8.data(), n, 0, n, ref.data());
  for (int64_t i = 0; i < m * n; ++i) {
    ++checks;
    if (std::memcmp(&out[i], &ref[i], sizeof(float)) != 0) fail("w8a8", v.name, m, n, k, 0, out[i], ref[i]);
  }

  // W4A8 with the given group (0: one group per row, i.e. channel-wise int4).
  const int64_t g = group ? group : k;
  std::vector<int8_t> w4(n * k);
  for (auto& e : w4) e = int8_t(rng.range(-8, 7));
  std::vector<uint8_t> packed(n * k / 2);
  for (int64_t c = 0; c < n; ++c) cpk::pack_int4_row(w4.data() + c * k, k, packed.data() + c * (k / 2), v.layout);
  std::vector<float> s4(n * groups);
  for (auto& e : s4) e = 0.001f + 0.01f * (rng.uniform() + 1.f);
  w4a8_split(v, qa, sa, gs, m, k, w4, packed, s4, groups, n, out);
  cpk::w4a8_columns(twin, qa.data(), sa.data(), gs.data(), m, k, packed.data(), s4.data(), groups, n, 0, n,
                    ref.data());
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < n; ++c) {
      ++checks;
      const float got = out[r * n + c], want = ref[r * n + c];
      if (v.w4_exact) {
        if (std::memcmp(&got, &want, sizeof(float)) != 0) fail("w4a8", v.name, m, n, k, g, got, want);
        continue;
      }
      // Magnitude scale of the sum: sum_g |s_g| * 127 * 15 * g, times the activation scale.
      float scale = 0.f;
      for (int64_t gi = 0; gi < groups; ++gi) scale += s4[c * groups + gi];
      scale *= 127.f * 15.f * float(g) * sa[r];
      const float budget = 4.f * 1.2e-7f * scale * float(groups);
      if (std::fabs(got - want) > budget) fail("w4a8", v.name, m, n, k, g, got, want);
    }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string best = cpk::best_variant();
  std::printf("selected variant: %s\n", best.c_str());
  std::vector<const cpk::Variant*> todo;
  if (argc > 1) {
    const cpk::Variant* v = cpk::variant_by_name(argv[1]);
    if (v == nullptr || !runs_here(argv[1])) {
      std::printf("variant %s is not compiled in or does not run on this CPU\n", argv[1]);
      return 2;
    }
    todo.push_back(v);
  } else {
    for (const cpk::Variant& v : cpk::compiled_variants())
      if (runs_here(v.name)) todo.push_back(cpk::variant_by_name(v.name));
  }
  Rng rng;
  if (!layouts_agree(rng)) {
    std::printf("FAILED: the offset and two's-complement twins disagree\n");
    return 1;
  }
  if (!quantizers_agree(rng)) return 1;
  const int64_t ns[] = {1, 2, 3, 7, 16, 33, 70};
  const int64_t ks[] = {128, 384, 1024, 4096};
  const int64_t group_sizes[] = {32, 64, 128, 0};
  for (const cpk::Variant* v : todo) {
    const long before = checks;
    const int failed_before = failures;
    for (int64_t m = 1; m <= 17; ++m)
      for (int64_t n : ns)
        for (int64_t k : ks)
          for (int64_t group : group_sizes) {
            if (k == 4096 && (m % 4 != 1 || n > 7)) continue;  // the big K on a sample of shapes
            check_shape(*v, rng, m, n, k, group);
          }
    std::printf("%s %s (%s int4%s): %ld checks (M 1..17, N %s, K 128..4096, groups 32/64/128/channel)%s\n",
                failures == failed_before ? "ok" : "FAILED", v->name,
                v->layout == cpk::Int4Layout::Offset ? "offset" : "two's-complement", v->panels ? ", panels" : "",
                checks - before, "1..70",
                std::string(v->name) == best ? " [selected]" : "");
  }
  return failures == 0 ? 0 : 1;
}
