// torch bindings of the quantized linears: tensors in and out, the work done by the torch-free
// driver (linear_driver.h) on torch's thread pool; the weight layouts each variant needs; the
// variant table as Python `Variant` objects, and its dispatch counters.

#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <climits>

#include "float_panels.h"
#include "linear_driver.h"
#include "ops.h"
#include "panel_layout.h"
#include "row_layout.h"
#if defined(__x86_64__)
#include "arch/x86/kernels.h"
#endif

cpk::Parallel torch_parallel() {
  return {at::get_num_threads(), [](int64_t begin, int64_t end, int64_t grain, cpk::RangeBody body) {
            at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { body(b, e); });
          }};
}

cpk::DType float_dtype(const torch::Tensor& t, const char* what) {
  if (t.scalar_type() == torch::kFloat32) return cpk::DType::F32;
  if (t.scalar_type() == torch::kBFloat16) return cpk::DType::Bf16;
  TORCH_CHECK(t.scalar_type() == torch::kHalf, what, ": unsupported dtype ", t.scalar_type());
  return cpk::DType::F16;
}

namespace {

const char* int8_layout_name(cpk::Int8Layout l) {
  return l == cpk::Int8Layout::OffsetPanels ? "offset_panel" : l == cpk::Int8Layout::SignedPanels ? "signed_panel" : "signed";
}
const char* int4_layout_name(cpk::Int4Layout l) {
  return l == cpk::Int4Layout::OffsetPanels ? "offset_panel" : l == cpk::Int4Layout::OffsetRows ? "offset" : "twos_complement";
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

cpk::LinearInput input_of(const torch::Tensor& xc) {
  return {xc.data_ptr(), float_dtype(xc, "linear input"), xc.size(0), xc.size(1)};
}

// One of a linear's per-group tensors (scales [N, G] in the variant's order, or offsets groups x N
// in the driver's column chunks), checked: fp32, or codes (uint8, int8, fp16) times an fp16 factor
// per super-block (super: N x G / per in the same order) or none (linear_driver.h, GroupValues).
cpk::GroupValues group_values(const torch::Tensor& t, const c10::optional<torch::Tensor>& super, int64_t n,
                              int64_t groups, const char* what) {
  cpk::GroupValues gv;
  const auto type = t.scalar_type();
  gv.code = type == torch::kFloat32 ? cpk::Code::F32
            : type == torch::kUInt8 ? cpk::Code::U8
            : type == torch::kInt8  ? cpk::Code::I8
                                    : cpk::Code::F16;
  TORCH_CHECK((gv.code != cpk::Code::F16 || type == torch::kHalf) && t.is_contiguous() && t.numel() == n * groups,
              what, ": must be contiguous N x G of fp32, uint8, int8 or fp16 codes, got ", type, " of ", t.numel());
  gv.values = t.data_ptr();
  if (super.has_value()) {
    const torch::Tensor& sp = *super;
    const int64_t supers = sp.numel() / std::max<int64_t>(n, 1);
    TORCH_CHECK(gv.code != cpk::Code::F32 && sp.scalar_type() == torch::kHalf && sp.is_contiguous() &&
                    supers > 0 && supers * n == sp.numel() && groups % supers == 0,
                what, ": its super-block factors must be contiguous fp16 of N x (G / per), for codes, got ",
                sp.scalar_type());
    gv.super = static_cast<const cpk::F16*>(sp.data_ptr());
    gv.per = groups / supers;
  }
  return gv;
}

// Scales and offsets of a linear with n outputs in `groups` groups, checked (group_values); mid:
// a coded offset's multiple of its group's scale.
cpk::GroupScales group_scales(const torch::Tensor& scales, const c10::optional<torch::Tensor>& scale_super,
                              const c10::optional<torch::Tensor>& offsets,
                              const c10::optional<torch::Tensor>& offset_super, double mid, int64_t n, int64_t groups,
                              const char* what) {
  cpk::GroupScales s;
  s.scales = group_values(scales, scale_super, n, groups, what);
  if (offsets.has_value()) s.offsets = group_values(*offsets, offset_super, n, groups, what);
  TORCH_CHECK(offsets.has_value() || !offset_super.has_value(), what, ": offset factors without offsets");
  s.mid = float(mid);
  return s;
}

}  // namespace

// x [M, K] (fp32, bf16 or fp16), weight as pack_int8 left it for the variant (int8 rows [N, K]; int8
// or uint8 w + 128 panels [N, quad_k(K)]), scales fp32 [N] (per channel) or [N, G] as pack_scales
// gives them (groups of K / G inputs, a multiple of 4; fp32 or codes: group_values): out [M, N] in x's dtype.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, const Variant& v, c10::optional<torch::Tensor> offsets,
                          bool act_groups, c10::optional<torch::Tensor> scale_super,
                          c10::optional<torch::Tensor> offset_super, double mid) {
  auto xc = x.contiguous();
  const int64_t k = xc.size(1), n = qweight.size(0), groups = scales.dim() == 2 ? scales.size(1) : 1;
  const bool offset = v.int8 == cpk::Int8Layout::OffsetPanels;
  TORCH_CHECK(qweight.size(1) == (cpk::is_panels(v.int8) ? cpk::quad_k(k) : k) &&
                  qweight.scalar_type() == (offset ? torch::kUInt8 : torch::kInt8),
              "w8a8_linear: the weight must be as pack_int8 gives it for ", v.name);
  TORCH_CHECK(scales.numel() == n * groups && (groups == 1 || (k % groups == 0 && (k / groups) % 4 == 0)),
              "w8a8_linear: scales must be [N] or [N, G] with groups of a multiple of 4 inputs");
  const cpk::GroupScales s =
      group_scales(scales, scale_super, offsets, offset_super, mid, n, groups, "w8a8_linear scales and offsets");
  auto out = torch::empty({xc.size(0), n}, torch::kFloat32);
  cpk::w8a8_linear(v, torch_parallel(), input_of(xc), qweight.data_ptr(), s, groups, n, out.data_ptr<float>(),
                   act_groups);
  return finish(out, bias, x.scalar_type());
}

// x [M, K], packed uint8 [N, K / 2] (the variant's int4 layout) or [N, 3K / 4] (int6 panels: pack_int6),
// scales [N, G] as pack_scales
// gives them for the variant (fp32, or codes with scale_super: group_values): out [M, N].
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, const Variant& v, c10::optional<torch::Tensor> offsets,
                          bool act_groups, c10::optional<torch::Tensor> scale_super,
                          c10::optional<torch::Tensor> offset_super, double mid) {
  auto xc = x.contiguous();
  const int64_t k = xc.size(1), n = packed.size(0), groups = scales.size(1);
  const int64_t group = k / groups;
  // int6 panels (pack_int6) by their width: 3K / 4 bytes a row instead of K / 2
  const bool int6 = k % 32 == 0 && packed.size(1) == cpk::int6_bytes_per_column(k);
  TORCH_CHECK(!int6 || (v.int6 && n % cpk::kPanel == 0), "w4a8_linear: int6 panels on ", v.name,
              ", which has none, or N not a multiple of 16");
  TORCH_CHECK((int6 || packed.size(1) * 2 == k) && group % (int6 ? 8 : 32) == 0 && groups * group == k,
              "w4a8_linear: bad shapes");
  const cpk::GroupScales s =
      group_scales(scales, scale_super, offsets, offset_super, mid, n, groups, "w4a8_linear scales and offsets");
  auto out = torch::empty({xc.size(0), n}, torch::kFloat32);
  cpk::w4a8_linear(v, torch_parallel(), input_of(xc), packed.data_ptr<uint8_t>(), s, groups, n,
                   out.data_ptr<float>(), act_groups, int6 ? 2 : 0);
  return finish(out, bias, x.scalar_type());
}

// x [M, K] (fp32, bf16 or fp16), packed as pack_float gives it ([panels, K, 16] fp32, bf16 or fp16,
// the same for every variant), n output columns: out [M, N] in x's dtype, fp32 sums.
torch::Tensor float_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                           const Variant& v) {
  auto xc = x.contiguous();
  const int64_t k = xc.size(1);
  TORCH_CHECK(xc.dim() == 2 && packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == cpk::panel_count(n) &&
                  packed.size(1) == k && packed.size(2) == cpk::kPanel,
              "float_linear: the weight must be as pack_float gives it for [", n, ", ", k, "]");
  auto out = torch::empty({xc.size(0), n}, torch::kFloat32);
  cpk::float_linear(v, torch_parallel(), input_of(xc), packed.data_ptr(), float_dtype(packed, "float_linear weight"),
                    n, out.data_ptr<float>());
  return finish(out, bias, x.scalar_type());
}

namespace {

// A float weight [N, K] -> [panels, K, 16] float panels of its own dtype (float_panels.h).
torch::Tensor pack_float(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_float: the weight must be [N, K]");
  auto src = w.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  float_dtype(src, "pack_float");
  auto out = torch::empty({cpk::panel_count(n), k, cpk::kPanel}, src.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, src.scalar_type(), "pack_float", [&] {
    const scalar_t* s = src.data_ptr<scalar_t>();
    scalar_t* d = out.data_ptr<scalar_t>();
    at::parallel_for(0, cpk::panel_count(n), 16, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) cpk::pack_float_panel(s, n, k, p, d);
    });
  });
  return out;
}

// int8 [N, K] -> the variant's W8A8 weight: the same int8 (rows), int8 panels (SignedPanels) or
// uint8 w + 128 panels (OffsetPanels), [N, quad_k(K)].
torch::Tensor pack_int8(torch::Tensor q, const Variant& v) {
  if (!cpk::is_panels(v.int8)) return q.contiguous();
  const bool offset = v.int8 == cpk::Int8Layout::OffsetPanels;
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

// Group scales [N, G] (W4A8, grouped W8A8) in the variant's order: as they are, or in panel order
// (a variant's int8 and int4 layouts are both panels or both rows). fp32, or codes of their own dtype
// (uint8, int8, fp16) and their super-block factors [N, G / per] alike.
torch::Tensor pack_scales(torch::Tensor scales, const Variant& v) {
  const auto type = scales.scalar_type();
  auto src = (type == torch::kUInt8 || type == torch::kInt8 || type == torch::kHalf ? scales : scales.to(torch::kFloat32))
                 .contiguous();
  if (!cpk::is_panels(v.int4)) return src;
  const int64_t n = scales.size(0), groups = scales.size(1);
  auto out = torch::empty({n, groups}, src.options());
  auto pack = [&](auto tag) {
    using T = decltype(tag);
    const T* from = static_cast<const T*>(src.data_ptr());
    T* to = static_cast<T*>(out.data_ptr());
    at::parallel_for(0, cpk::panel_count(n), 64, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) cpk::pack_scales_panel(from, n, groups, p, to);
    });
  };
  if (src.element_size() == 1)
    pack(uint8_t{});
  else if (src.element_size() == 2)
    pack(uint16_t{});
  else
    pack(float{});
  return out;
}

// [N, K / 2] uint8 in the variant's int4 layout; nibble(c, i) reads column c's input i as an offset
// nibble (w + 8), row(c, dst) packs one row in a row layout.
template <typename Nibble, typename Row>
torch::Tensor pack_int4_with(const Variant& v, int64_t n, int64_t k, const Nibble& nibble, const Row& row) {
  auto out = torch::empty({n, k / 2}, torch::kUInt8);
  uint8_t* dst = out.data_ptr<uint8_t>();
  if (cpk::is_panels(v.int4)) {
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
torch::Tensor pack_int4(torch::Tensor q, const Variant& v) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(k % 32 == 0, "pack_int4: K must be a multiple of 32");
  auto src_t = q.contiguous();
  const int8_t* src = src_t.data_ptr<int8_t>();
  return pack_int4_with(
      v, n, k, [&](int64_t c, int64_t i) { return uint8_t(src[c * k + i] + 8); },
      [&](int64_t c, uint8_t* dst) { cpk::pack_int4_row(src + c * k, k, dst, v.int4); });
}

// int8 values in [-32, 31], [N, K] (N a multiple of 16, K of 32) -> int6 panels, uint8 [N, 3K / 4]
// (panel_layout.h), for a variant with Variant::int6.
torch::Tensor pack_int6(torch::Tensor q, const Variant& v) {
  const int64_t n = q.size(0), k = q.size(1);
  TORCH_CHECK(v.int6, "pack_int6: ", v.name, " has no int6 panels");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && n % cpk::kPanel == 0 && k % 32 == 0,
              "pack_int6: int8 [N, K] with N a multiple of 16 and K of 32");
  auto src_t = q.contiguous();
  const int8_t* src = src_t.data_ptr<int8_t>();
  auto out = torch::empty({n, cpk::int6_bytes_per_column(k)}, torch::kUInt8);
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::atomic<bool> outside{false};
  at::parallel_for(0, n / cpk::kPanel, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      cpk::pack_int6_panel(k, p, dst, [&](int64_t c, int64_t i) {
        const int v = src[c * k + i] + 32;
        if (v < 0 || v > 63) outside = true;
        return uint8_t(v & 63);
      });
  });
  TORCH_CHECK(!outside, "pack_int6: values outside [-32, 31]");
  return out;
}

// compressed-tensors pack-quantized int32 words [N, W] (word j holds k = 8j..8j+7 as value + 8 at
// bits 4i) -> the variant's int4 layout, uint8 [N, K / 2], without an int8 copy.
torch::Tensor words_to_nibbles(torch::Tensor words, int64_t k, const Variant& v) {
  const int64_t n = words.size(0), w = words.size(1);
  TORCH_CHECK(k % 32 == 0 && w * 8 >= k, "words_to_nibbles: K must be a multiple of 32 and fit the words");
  auto src_t = words.contiguous();
  const uint32_t* src = reinterpret_cast<const uint32_t*>(src_t.data_ptr<int32_t>());
  return pack_int4_with(
      v, n, k, [&](int64_t c, int64_t i) { return uint8_t((src[c * w + i / 8] >> (4 * (i % 8))) & 0x0F); },
      [&](int64_t c, uint8_t* dst) { cpk::words_to_nibbles_row(src + c * w, k, dst, v.int4); });
}

const Variant& variant(const std::string& name) {
  const Variant* v = cpk::variant_by_name(name);
  TORCH_CHECK(v != nullptr, "cpuserve kernels: no variant '", name, "' is compiled in");
  return *v;
}

// `rounds` rounds of the variant's dot-peak loop on every thread of torch's pool at once: the
// lanes' sum over all threads (the multiply-adds done; dot_peak.h).
int64_t dot_peak(const Variant& v, int64_t rounds) {
  TORCH_CHECK(v.dot_peak != nullptr, "dot_peak: ", v.name, " has no peak loop (a twin row)");
  TORCH_CHECK(cpk::runs_here(v), "dot_peak: this CPU cannot run ", v.name);
  // each round adds at most 8 to an int32 lane (avx2 and i8mm; 4 elsewhere)
  TORCH_CHECK(rounds >= 0 && rounds <= INT32_MAX / 8, "dot_peak: rounds must be in [0, ", INT32_MAX / 8, "]");
  const cpk::Parallel par = torch_parallel();
  std::atomic<int64_t> total{0};
  par.for_range(0, par.threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) total.fetch_add(v.dot_peak(rounds), std::memory_order_relaxed);
  });
  return total.load();
}

// {variant: {op: calls}} for every count that is not zero.
pybind11::dict dispatch_counts() {
  pybind11::dict out;
  for (const Variant* v : cpk::all_variants()) {
    pybind11::dict ops;
    for (int op = 0; op < cpk::kOpCount; ++op)
      if (const uint64_t c = cpk::dispatch_counts[v->index][op].load(std::memory_order_relaxed))
        ops[cpk::op_name(op)] = c;
    if (!ops.empty()) out[v->name] = ops;
  }
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module& mod);      // layer_ops.cpp
void register_decoder_layers(pybind11::module& mod);  // decoder_layers.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  namespace py = pybind11;
  // A row of the variant table; the table owns it. Equal to another handle of the same row or to
  // its name, and hashed as its name, so code that held names keeps working with handles.
  py::class_<Variant, std::unique_ptr<Variant, py::nodelete>>(mod, "Variant")
      .def_property_readonly("name", [](const Variant& v) { return std::string(v.name); })
      .def_property_readonly("twin", [](const Variant& v) { return v.twin; }, py::return_value_policy::reference)
      .def_property_readonly("int8_layout", [](const Variant& v) { return int8_layout_name(v.int8); })
      .def_property_readonly("int4_layout", [](const Variant& v) { return int4_layout_name(v.int4); })
      .def_property_readonly("int6", [](const Variant& v) { return v.int6; })
      .def_property_readonly("runs_here", [](const Variant& v) { return cpk::runs_here(v); })
      .def_property_readonly("dot_peak_macs", [](const Variant& v) { return v.dot_peak_macs; })
      .def("__eq__", [](const Variant& v, const Variant& o) { return &v == &o; })
      .def("__eq__", [](const Variant& v, const std::string& name) { return name == v.name; })
      .def("__eq__", [](const Variant&, const py::object&) { return false; })
      .def("__hash__", [](const Variant& v) { return py::hash(py::str(v.name)); })
      .def("__str__", [](const Variant& v) { return std::string(v.name); })
      .def("__repr__", [](const Variant& v) { return "<Variant " + std::string(v.name) + ">"; });
  register_layer_ops(mod);
  register_decoder_layers(mod);
  mod.def("variant", &variant, py::return_value_policy::reference, "the table row of a compiled variant, by name");
  // The linears let go of the GIL while they run (no Python inside).
  mod.def("w8a8_linear", &w8a8_linear, py::call_guard<py::gil_scoped_release>(),
          "W8A8 linear, channel-wise or in groups", py::arg("x"), py::arg("qweight"), py::arg("scales"),
          py::arg("bias"), py::arg("variant"), py::arg("offsets") = py::none(), py::arg("act_groups") = false,
          py::arg("scale_super") = py::none(), py::arg("offset_super") = py::none(), py::arg("mid") = 0.0);
  mod.def("w4a8_linear", &w4a8_linear, py::call_guard<py::gil_scoped_release>(), "W4A8 group-wise linear",
          py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("variant"),
          py::arg("offsets") = py::none(), py::arg("act_groups") = false, py::arg("scale_super") = py::none(),
          py::arg("offset_super") = py::none(), py::arg("mid") = 0.0);
  mod.def("float_linear", &float_linear, py::call_guard<py::gil_scoped_release>(),
          "unquantized linear on float panels (fp32 sums, weights widened in registers)", py::arg("x"),
          py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("variant"));
  mod.def("pack_float", &pack_float, "a float weight [N, K] as float panels [panels, K, 16] of its dtype");
  mod.def("pack_int8", &pack_int8, "the variant's W8A8 weight layout (int8 rows, int8 or uint8 + 128 panels)");
  mod.def("int8_layout", [](const Variant& v) { return int8_layout_name(v.int8); },
          "signed, signed_panel or offset_panel: how the variant stores W8A8 weights");
  mod.def("pack_scales", &pack_scales, "W4A8 scales in the variant's order (panel order for panel variants)");
  mod.def("pack_int4", &pack_int4, "repack int4 values into the variant's nibble layout");
  mod.def("pack_int6", &pack_int6, "int8 values in [-32, 31] as int6 panels (w4a8_linear reads them)");
  mod.def("words_to_nibbles", &words_to_nibbles, "pack-quantized int32 words -> the variant's nibble layout");
  mod.def("int4_layout", [](const Variant& v) { return int4_layout_name(v.int4); },
          "offset, twos_complement or offset_panel: how the variant stores int4 nibbles");
  mod.def("variants", [] {
    std::vector<std::string> names;
    for (const Variant* v : cpk::compiled_variants()) names.push_back(v->name);
    return names;
  }, "selectable variants compiled in, generic first, best last (the CPU decides which can run)");
  mod.def("best_variant", [] { return std::string(cpk::best_variant().name); },
          "the best variant for this CPU, as the kernel's feature detector sees it");
  mod.def("dot_peak", &dot_peak, py::call_guard<py::gil_scoped_release>(),
          "rounds of the variant's int8 dot-peak loop on every thread: the multiply-adds done", py::arg("variant"),
          py::arg("rounds"));
#if defined(__x86_64__)
  mod.def("amx_usable", &cpk::amx_usable, "the CPU has AMX-INT8 and the OS grants its tiles to this process");
  mod.def("set_amx", &cpk::set_amx, "AMX tiles on or off for avx512_vnni's batched linears: the previous setting",
          py::arg("on"));
  mod.def("amx_rows", [] { return cpk::kAmxRows; }, "rows from which avx512_vnni's linears may run on AMX tiles");
  mod.def("amx_enabled", &cpk::amx_enabled, "AMX tiles granted here and not switched off (set_amx)");
  mod.def("amx_switched_on", &cpk::amx_switched_on, "the set_amx switch, read without probing the CPU");
  mod.def("amx_tile_calls", &cpk::amx_tile_calls, "linear kernel calls (a thread's panels) that ran on AMX tiles");
#else
  mod.def("amx_usable", [] { return false; }, "the CPU has AMX-INT8 and the OS grants its tiles (never on Arm)");
  mod.def("set_amx", [](bool) { return false; }, "AMX tiles on or off (none on Arm)", py::arg("on"));
  mod.def("amx_rows", [] { return int64_t(0); }, "rows from which linears may run on AMX tiles (none on Arm)");
  mod.def("amx_enabled", [] { return false; }, "AMX tiles granted here and not switched off (never on Arm)");
  mod.def("amx_switched_on", [] { return false; }, "the set_amx switch (none on Arm)");
  mod.def("amx_tile_calls", [] { return uint64_t(0); }, "linear kernel calls that ran on AMX tiles (none on Arm)");
#endif
  mod.def("dispatch_counts", &dispatch_counts, "calls per variant and op since the last reset");
  mod.def("reset_dispatch_counts", &cpk::reset_dispatch_counts, "zero the dispatch counters");
}
