// torch bindings of the kernel core (qlinear_core.h, qlinear_panels.h): tensors in and out, work split
// over output columns (or panels of 16) with at::parallel_for, which is torch's own pinned OpenMP pool (no second runtime).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "ops.h"
#include "qlinear_core.h"

namespace {

const cpk::Variant& variant_or_fail(const std::string& name) {
  const cpk::Variant* v = cpk::variant_by_name(name);
  TORCH_CHECK(v != nullptr, "cpuserve kernels: unknown or unsupported variant '", name, "'");
  return *v;
}

// A row as fp32: itself, or widened into buf.
inline const float* widen(const float* row, int64_t, std::vector<float>&) { return row; }
template <typename T>
const float* widen(const T* row, int64_t k, std::vector<float>& buf) {
  buf.resize(k);
  for (int64_t i = 0; i < k; ++i) buf[i] = static_cast<float>(row[i]);
  return buf.data();
}

// Per-token quantization of x [M, K] (fp32, bf16 or fp16, contiguous), rows shared out over the
// pool; a 16-bit row is widened into a per-thread buffer first (no fp32 copy of the whole input).
void quantize_rows(const torch::Tensor& x, int64_t group, int8_t* q, float* scales, int32_t* sums) {
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t groups = group > 0 ? k / group : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> wide;
      for (int64_t r = begin; r < end; ++r)
        cpk::quantize_row(widen(xp + r * k, k, wide), k, group, q + r * k, scales + r,
                          sums ? sums + r * groups : nullptr);
    });
  });
}

// One matmul's quantized activations, in buffers kept per calling thread and reused: a decode step
// makes ~120 matmuls, and four tensor allocations each showed in its profile. Rows are readable 4
// bytes past the last (the int8 panel kernel reads whole quads; the padded weights are zero there).
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

// Output work shared out over the pool: panels for a panel variant, else columns.
template <typename Work>
void over_outputs(const cpk::Variant& v, int64_t n, const Work& work) {
  if (v.panels)
    at::parallel_for(0, cpk::panel_count(n), 1, work);
  else
    at::parallel_for(0, n, 16, work);
}

// fp32 results [M, N] (+ bias) in the input's dtype: rounded once, as out.to(dtype) would.
torch::Tensor finish(torch::Tensor out, const c10::optional<torch::Tensor>& bias, c10::ScalarType dtype) {
  torch::Tensor b = bias.has_value() ? bias->to(torch::kFloat32).contiguous() : torch::Tensor();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const int64_t m = out.size(0), n = out.size(1);
  float* op = out.data_ptr<float>();
  if (dtype == torch::kFloat32) {
    if (bp)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = 0; c < n; ++c) op[r * n + c] += bp[c];
    return out;
  }
  auto result = torch::empty({m, n}, out.options().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "finish", [&] {
    scalar_t* rp = result.data_ptr<scalar_t>();
    at::parallel_for(0, m * n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) rp[i] = static_cast<scalar_t>(bp ? op[i] + bp[i % n] : op[i]);
    });
  });
  return result;
}

}  // namespace

// x [M, K] (fp32 or bf16), weight as pack_int8 left it for the variant (int8 rows [N, K]; int8 or
// uint8 w + 128 panels [N, quad_k(K)]), scales fp32 [N]: out [M, N] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = qweight.size(0);
  const bool offset = v.panels == cpk::kVnniPanels;  // uint8 w + 128: one activation sum per row corrects it
  TORCH_CHECK(qweight.size(1) == (v.panels ? cpk::quad_k(k) : k) &&
                  qweight.scalar_type() == (offset ? torch::kUInt8 : torch::kInt8),
              "w8a8_linear: the weight must be as pack_int8 gives it for ", variant);
  Activations& act = scratch(m, k, 1);
  quantize_rows(xc, offset ? k : 0, act.q.data(), act.scales.data(), offset ? act.sums.data() : nullptr);
  auto out = torch::empty({m, n}, torch::kFloat32);
  const int8_t* qa = act.q.data();
  const float* sw = scales.data_ptr<float>();
  const float* sap = act.scales.data();
  const int32_t* asum = act.sums.data();
  float* o = out.data_ptr<float>();
  const void* w = qweight.data_ptr();
  over_outputs(v, n, [&](int64_t begin, int64_t end) {
    if (v.panels) return cpk::w8a8_panels(v, qa, sap, asum, m, k, static_cast<const uint8_t*>(w), sw, n, begin, end, o);
    cpk::w8a8_columns(v, qa, sap, m, k, static_cast<const int8_t*>(w), sw, n, begin, end, o);
  });
  return finish(out, bias, x.scalar_type());
}

// int8 [N, K] -> the variant's W8A8 weight: the same int8 (rows), int8 panels (AVX2) or uint8 w + 128
// panels (AVX-512 VNNI), [N, quad_k(K)].
torch::Tensor pack_int8(torch::Tensor q, std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  if (!v.panels) return q.contiguous();
  const bool offset = v.panels == cpk::kVnniPanels;
  auto src_t = q.contiguous();
  const int64_t n = q.size(0), k = q.size(1);
  auto out = torch::empty({n, cpk::quad_k(k)}, offset ? torch::kUInt8 : torch::kInt8);
  const int8_t* src = src_t.data_ptr<int8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  at::parallel_for(0, cpk::panel_count(n), 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) cpk::pack_int8_panel(src, n, k, p, dst, offset);
  });
  return out;
}

std::string int8_layout(std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  return v.panels == cpk::kVnniPanels ? "offset_panel" : v.panels ? "signed_panel" : "signed";
}

// x [M, K], packed uint8 [N, K / 2] (the variant's int4 layout), scales fp32 [N, G] as pack_scales
// gives them for the variant: out [M, N].
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), n = packed.size(0), groups = scales.size(1);
  const int64_t group = k / groups;
  TORCH_CHECK(packed.size(1) * 2 == k && group % 32 == 0 && groups * group == k, "w4a8_linear: bad shapes");
  Activations& act = scratch(m, k, groups);
  quantize_rows(xc, group, act.q.data(), act.scales.data(), act.sums.data());
  auto out = torch::empty({m, n}, torch::kFloat32);
  const int8_t* qa = act.q.data();
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const float* sw = scales.data_ptr<float>();
  const float* sap = act.scales.data();
  const int32_t* gs = act.sums.data();
  float* o = out.data_ptr<float>();
  over_outputs(v, n, [&](int64_t begin, int64_t end) {
    if (v.panels) return cpk::w4a8_panels(v, qa, sap, gs, m, k, pw, sw, groups, n, begin, end, o);
    cpk::w4a8_columns(v, qa, sap, gs, m, k, pw, sw, groups, n, begin, end, o);
  });
  return finish(out, bias, x.scalar_type());
}

// W4A8 scales fp32 [N, G] in the variant's order: as they are, or in panel order.
torch::Tensor pack_scales(torch::Tensor scales, std::string variant) {
  auto src_t = scales.to(torch::kFloat32).contiguous();
  if (!variant_or_fail(variant).panels) return src_t;
  const int64_t n = scales.size(0), groups = scales.size(1);
  auto out = torch::empty({n, groups}, torch::kFloat32);
  const float* src = src_t.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, cpk::panel_count(n), 64, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) cpk::pack_scales_panel(src, n, groups, p, dst);
  });
  return out;
}

// [N, K / 2] uint8 in the variant's int4 layout; nibble(c, i) reads column c's input i as an offset
// nibble (w + 8), row(c, dst) packs one row in a row layout.
template <typename Nibble, typename Row>
torch::Tensor pack_int4_with(const cpk::Variant& v, int64_t n, int64_t k, const Nibble& nibble, const Row& row) {
  auto out = torch::empty({n, k / 2}, torch::kUInt8);
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (v.panels) {
    at::parallel_for(0, cpk::panel_count(n), 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) cpk::pack_int4_panel(n, k, p, dst, nibble);
    });
  } else {
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) row(c, dst + c * (k / 2));
    });
  }
  return out;
}

// int8 values in [-8, 7], [N, K] -> the variant's int4 layout, uint8 [N, K / 2].
torch::Tensor pack_int4(torch::Tensor q, std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % 32 == 0, "pack_int4: K must be a multiple of 32");
  auto src_t = q.contiguous();
  const int8_t* src = src_t.data_ptr<int8_t>();
  return pack_int4_with(
      v, n, k, [&](int64_t c, int64_t i) { return uint8_t(src[c * k + i] + 8); },
      [&](int64_t c, uint8_t* dst) { cpk::pack_int4_row(src + c * k, k, dst, v.layout); });
}

// compressed-tensors pack-quantized int32 words [N, W] (word j holds k = 8j..8j+7 as value + 8 at
// bits 4i) -> the variant's int4 layout, uint8 [N, K / 2], without an int8 copy.
torch::Tensor words_to_nibbles(torch::Tensor words, int64_t k, std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  const int64_t n = words.size(0), w = words.size(1);
  TORCH_CHECK(k % 32 == 0 && w * 8 >= k, "words_to_nibbles: K must be a multiple of 32 and fit the words");
  auto src_t = words.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(src_t.data_ptr<int32_t>());
  return pack_int4_with(
      v, n, k, [&](int64_t c, int64_t i) { return uint8_t((src[c * w + i / 8] >> (4 * (i % 8))) & 0x0F); },
      [&](int64_t c, uint8_t* dst) { cpk::words_to_nibbles_row(src + c * w, k, dst, v.layout); });
}

std::string int4_layout(std::string variant) {
  const cpk::Variant& v = variant_or_fail(variant);
  if (v.panels) return "offset_panel";
  return v.layout == cpk::Int4Layout::Offset ? "offset" : "twos_complement";
}

std::vector<std::string> variants() {
  std::vector<std::string> names;
  for (const cpk::Variant& v : cpk::compiled_variants()) names.push_back(v.name);
  return names;
}

void register_layer_ops(pybind11::module& mod);      // layer_ops.cpp
void register_decoder_layers(pybind11::module& mod);  // decoder_layers.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  register_layer_ops(mod);
  register_decoder_layers(mod);
  mod.def("w8a8_linear", &w8a8_linear, "W8A8 channel-wise linear");
  mod.def("w4a8_linear", &w4a8_linear, "W4A8 group-wise linear");
  mod.def("pack_int8", &pack_int8, "the variant's W8A8 weight layout (int8 rows, int8 or uint8 + 128 panels)");
  mod.def("int8_layout", &int8_layout, "signed, signed_panel or offset_panel: how the variant stores W8A8 weights");
  mod.def("pack_scales", &pack_scales, "W4A8 scales in the variant's order (panel order for panel variants)");
  mod.def("pack_int4", &pack_int4, "repack int4 values into the kernel's nibble layout");
  mod.def("words_to_nibbles", &words_to_nibbles, "pack-quantized int32 words -> the kernel's nibble layout");
  mod.def("int4_layout", &int4_layout, "offset, twos_complement or offset_panel: how the variant stores int4 nibbles");
  mod.def("variants", &variants, "variants compiled in (the CPU decides which can run)");
  mod.def("best_variant", &cpk::best_variant, "the best variant for this CPU, as the kernel sees it");
}
