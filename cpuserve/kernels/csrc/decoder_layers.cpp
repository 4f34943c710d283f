// A whole decode step through every decoder layer in one native call: the same ops, in the same
// order, as the Python decoder with native ops (model/decoder.py), minus ~20 Python-level calls and
// views per layer that cost more than the ops themselves on a small model (SmolLM2: 30 layers of
// 576 wide). Only steps where every sequence brings one new token come here; prefill stays in Python.

#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "ops.h"

namespace {

// A linear as its quant method holds it after loading (quant/methods.py): kind 0 float (torch's linear, no
// variant), 1 W8A8 (pack_int8's layout), 2 W4A8 (pack_int4's layout) of the variant it was packed for,
// 3 float panels (pack_float's layout, n output columns).
// offsets: the per-group additive terms of a GGUF format with a minimum (w = s * q + offset), or none.
struct Linear {
  int64_t kind;
  torch::Tensor weight, scales;
  c10::optional<torch::Tensor> bias;
  const Variant* variant;
  c10::optional<torch::Tensor> offsets;
  bool act_groups;  // activations quantized per group (GGUF's schemes)
  int64_t n;        // output columns (float panels: the padded weight does not say)

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case 0:
        return torch::linear(x, weight, bias);
      case 1:
        return w8a8_linear(x, weight, scales, bias, *variant, offsets, act_groups);
      case 3:
        return float_linear(x, weight, n, bias, *variant);
      default:
        return w4a8_linear(x, weight, scales, bias, *variant, offsets, act_groups);
    }
  }
};

struct LayerPlan {
  Linear qkv, o, gate_up, down;
  torch::Tensor input_norm, post_norm;
  double eps, residual_scale;
  int64_t num_heads, num_kv_heads, head_dim;
};

// x [T, Hkv, D] (D contiguous) into cache [B, S, Hkv, D] at [batch[t], pos[t]]: one copy per head row.
void store_kv(const torch::Tensor& cache, const torch::Tensor& x, const int64_t* batch, const int64_t* pos) {
  TORCH_CHECK(cache.scalar_type() == x.scalar_type() && cache.stride(3) == 1 && x.stride(2) == 1,
              "decode_layers: the KV cache must have the model's dtype");
  const int64_t t = x.size(0), heads = x.size(1), row = x.size(2) * x.element_size();
  TORCH_CHECK(cache.size(2) == heads && cache.size(3) == x.size(2), "decode_layers: KV cache shape mismatch");
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t es = x.element_size();
  for (int64_t j = 0; j < t; ++j) {
    TORCH_CHECK(batch[j] >= 0 && batch[j] < cache.size(0) && pos[j] >= 0 && pos[j] < cache.size(1),
                "decode_layers: write position outside the cache");
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (batch[j] * cache.stride(0) + pos[j] * cache.stride(1) + h * cache.stride(2)) * es,
                  src + (j * x.stride(0) + h * x.stride(1)) * es, row);
  }
}

// x [T, Hkv, D] into an int8 cache [B, S, Hkv, D] at [batch[t], pos[t]], each (token, head) row as
// round(x / s) with s = its largest magnitude / 127 (1 for a zero row), s into scales [B, S, Hkv]: the
// same fp32 arithmetic as the Python path (engine/kv_int8.py), so both write the same bytes.
void store_kv_int8(const torch::Tensor& cache, const torch::Tensor& scales, const torch::Tensor& x,
                   const int64_t* batch, const int64_t* pos) {
  TORCH_CHECK(cache.scalar_type() == torch::kInt8 && cache.stride(3) == 1 && scales.scalar_type() == torch::kFloat32,
              "decode_layers: an int8 KV cache needs fp32 scales");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  TORCH_CHECK(cache.size(2) == heads && cache.size(3) == d && scales.dim() == 3 &&
                  scales.sizes() == cache.sizes().slice(0, 3),
              "decode_layers: KV cache or scales shape mismatch");
  const auto xf = x.to(torch::kFloat32).contiguous();
  const float* src = xf.data_ptr<float>();
  int8_t* dst = cache.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  for (int64_t j = 0; j < t; ++j) {
    TORCH_CHECK(batch[j] >= 0 && batch[j] < cache.size(0) && pos[j] >= 0 && pos[j] < cache.size(1),
                "decode_layers: write position outside the cache");
    for (int64_t h = 0; h < heads; ++h) {
      const float* row = src + (j * heads + h) * d;
      float top = 0.f;
      for (int64_t i = 0; i < d; ++i) top = std::max(top, std::fabs(row[i]));
      const float s = top > 0.f ? top / 127.f : 1.f;
      int8_t* out = dst + batch[j] * cache.stride(0) + pos[j] * cache.stride(1) + h * cache.stride(2);
      for (int64_t i = 0; i < d; ++i) out[i] = int8_t(std::clamp(std::nearbyint(row[i] / s), -127.f, 127.f));
      sc[batch[j] * scales.stride(0) + pos[j] * scales.stride(1) + h * scales.stride(2)] = s;
    }
  }
}

}  // namespace

void register_decoder_layers(pybind11::module& mod) {
  namespace py = pybind11;
  py::class_<Linear>(mod, "NativeLinear")
      .def(py::init([](int64_t kind, torch::Tensor weight, torch::Tensor scales, c10::optional<torch::Tensor> bias,
                       const Variant* variant, c10::optional<torch::Tensor> offsets, bool act_groups, int64_t n) {
             TORCH_CHECK(kind == 0 || variant != nullptr, "NativeLinear: a packed linear needs its variant");
             TORCH_CHECK(kind != 3 || n > 0, "NativeLinear: float panels need their output columns");
             return Linear{kind, weight, scales, bias, variant, offsets, act_groups, n};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("bias"), py::arg("variant"),
           py::arg("offsets") = py::none(), py::arg("act_groups") = false, py::arg("n") = 0);
  py::class_<LayerPlan, std::shared_ptr<LayerPlan>>(mod, "LayerPlan")
      .def(py::init([](Linear qkv, Linear o, Linear gate_up, Linear down, torch::Tensor input_norm,
                       torch::Tensor post_norm, double eps, double residual_scale, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim) {
             return std::make_shared<LayerPlan>(LayerPlan{qkv, o, gate_up, down, input_norm, post_norm, eps,
                                                          residual_scale, num_heads, num_kv_heads, head_dim});
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("post_norm"), py::arg("eps"), py::arg("residual_scale"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"));
  // h [T, H] embeddings of the new tokens -> final-norm hidden states [T, H]; every float op and
  // attention run as `variant` (the linears as the variant each was packed for).
  // k_caches / v_caches: per layer [B, S, Hkv, D] views of the cache; token t's K/V go to
  // [write_batch[t], write_pos[t]]; it attends to lengths[t] positions of batch t (slots: None) or of
  // batch 0 at slots[t, :] (the paged cache). k_scales / v_scales: per layer [B, S, Hkv] row scales
  // of an int8 cache, or empty for a cache in the model's dtype.
  mod.def(
      "decode_layers",
      [](const std::vector<std::shared_ptr<LayerPlan>>& plans, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
         const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
         const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
         torch::Tensor write_batch, torch::Tensor write_pos, torch::Tensor lengths,
         c10::optional<torch::Tensor> slots, torch::Tensor final_norm, double final_eps, const Variant& variant) {
        TORCH_CHECK(!plans.empty() && plans.size() == k_caches.size() && plans.size() == v_caches.size(),
                    "decode_layers: one plan and one cache per layer");
        const bool int8 = !k_scales.empty();
        TORCH_CHECK(!int8 || (k_scales.size() == plans.size() && v_scales.size() == plans.size()),
                    "decode_layers: one k and one v scale tensor per layer for an int8 cache");
        TORCH_CHECK(h.dim() == 2, "decode_layers: h must be [T, H]");
        const int64_t t = h.size(0);
        auto wb = write_batch.to(torch::kLong).contiguous(), wp = write_pos.to(torch::kLong).contiguous();
        TORCH_CHECK(wb.numel() == t && wp.numel() == t, "decode_layers: one write position per token");
        const int64_t* wbp = wb.data_ptr<int64_t>();
        const int64_t* wpp = wp.data_ptr<int64_t>();
        torch::Tensor normed = rms_norm(h, plans[0]->input_norm, plans[0]->eps, variant);
        for (size_t i = 0; i < plans.size(); ++i) {
          const LayerPlan& p = *plans[i];
          const int64_t q_size = p.num_heads * p.head_dim, kv_size = p.num_kv_heads * p.head_dim;
          torch::Tensor qkv = p.qkv(normed);
          auto q = qkv.narrow(1, 0, q_size).view({t, p.num_heads, p.head_dim});
          auto k = qkv.narrow(1, q_size, kv_size).view({t, p.num_kv_heads, p.head_dim});
          auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, p.num_kv_heads, p.head_dim});
          rope_(q, cos, sin, variant);
          rope_(k, cos, sin, variant);
          const torch::Tensor& kc = k_caches[i];
          const torch::Tensor& vc = v_caches[i];
          c10::optional<torch::Tensor> ks, vs;
          if (int8) {
            ks = k_scales[i], vs = v_scales[i];
            store_kv_int8(kc, *ks, k, wbp, wpp);
            store_kv_int8(vc, *vs, v, wbp, wpp);
          } else {
            store_kv(kc, k, wbp, wpp);
            store_kv(vc, v, wbp, wpp);
          }
          auto attn =
              decode_attention(q, kc, vc, slots, lengths, 1.0 / std::sqrt(double(p.head_dim)), variant, ks, vs);
          auto o = p.o(attn.view({t, q_size}));
          auto mid = add_rms_norm(h, o, p.residual_scale, p.post_norm, p.eps, variant);
          auto gu = p.gate_up(mid[1]);
          const int64_t inter = gu.size(1) / 2;
          auto down = p.down(silu_mul(gu.narrow(1, 0, inter), gu.narrow(1, inter, inter), variant));
          const bool last = i + 1 == plans.size();
          auto out = add_rms_norm(mid[0], down, p.residual_scale, last ? final_norm : plans[i + 1]->input_norm,
                                  last ? final_eps : plans[i + 1]->eps, variant);
          h = out[0];
          normed = out[1];
        }
        return normed;
      },
      // No Python inside: other threads (grammar masks, tokenizing, the event loop) run meanwhile.
      py::call_guard<py::gil_scoped_release>(),
      "every decoder layer for one new token per sequence; returns the final-norm hidden states");
}
