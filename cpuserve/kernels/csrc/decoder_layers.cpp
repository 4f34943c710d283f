// A whole decode step through every decoder layer in one native call: the same ops, in the same
// order, as the Python decoder with native ops (model/decoder.py), minus ~20 Python-level calls and
// views per layer that cost more than the ops themselves on a small model (SmolLM2: 30 layers of
// 576 wide; Gemma 3 270M: 18 of 640). Only steps where every sequence brings one new token come
// here; prefill stays in Python.

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
// variant), 1 W8A8 (pack_int8's layout), 2 W4A8 (pack_int4's layout, or pack_int6's) of the variant it was packed for,
// 3 float panels (pack_float's layout, n output columns).
// offsets: the per-group additive terms of a GGUF format with a minimum (w = s * q + offset), or none;
// scales and offsets fp32 or codes with their super-block factors and mid (linear_driver.h, GroupScales).
struct Linear {
  int64_t kind;
  torch::Tensor weight, scales;
  c10::optional<torch::Tensor> bias;
  const Variant* variant;
  c10::optional<torch::Tensor> offsets;
  bool act_groups;  // activations quantized per group (GGUF's schemes)
  int64_t n;        // output columns (float panels: the padded weight does not say)
  c10::optional<torch::Tensor> scale_super, offset_super;
  double mid;

  torch::Tensor operator()(const torch::Tensor& x) const {
    switch (kind) {
      case 0:
        return torch::linear(x, weight, bias);
      case 1:
        return w8a8_linear(x, weight, scales, bias, *variant, offsets, act_groups, scale_super, offset_super, mid);
      case 3:
        return float_linear(x, weight, n, bias, *variant);
      default:
        return w4a8_linear(x, weight, scales, bias, *variant, offsets, act_groups, scale_super, offset_super, mid);
    }
  }
};

// One decoder layer. Llama's: input_norm, attention, residual add fused with mlp_norm, SwiGLU MLP.
// The switches of Gemma 3 (and Mistral's window): norms x * (1 + w) (unit_offset), per-head q/k
// norms before rope, a norm on the attention output and one on the MLP output (sandwich), GeGLU,
// an attention scale other than D ** -0.5, a sliding window, the local rope table.
// qkv: one fused linear, or q, k and v apart; gate_up: one, or gate and up apart (a GGUF file's
// types can differ within a layer: Q4_K_M keeps attn_v and ffn_down in Q6_K on some layers).
struct LayerPlan {
  std::vector<Linear> qkv;
  Linear o;
  std::vector<Linear> gate_up;
  Linear down;
  torch::Tensor input_norm, mlp_norm;
  double eps, residual_scale;
  int64_t num_heads, num_kv_heads, head_dim;
  bool unit_offset = false;
  c10::optional<torch::Tensor> q_norm, k_norm, attn_out_norm, mlp_out_norm;
  bool gelu = false;
  double attention_scale = 0;  // 0: D ** -0.5
  bool windowed = false;       // attends through the window's context (decode_layers' window_*)
  bool local_rope = false;     // rotates with the local table (decode_layers' cos_local, sin_local)

  torch::Tensor norm(const torch::Tensor& x, const torch::Tensor& w, const Variant& variant) const {
    return rms_norm(x, w, eps, variant, unit_offset);
  }
};

// x [T, Hkv, D] (D contiguous) into cache [B, S, Hkv, D] at [batch[t], pos[t]]: one copy per head row.
// A 16-bit cache under a float32 model gets x rounded to its dtype as it is copied (c10's conversion,
// round to nearest even: the bits torch's .to() gives for every number, infinities and subnormals
// included; a NaN stays a NaN, with c10's quiet-NaN bits rather than ATen's vectorized payload).
// Rounded by an ATen op first, the two rows cost 3-4 us a layer in the AVX2 case, more than the copy.
template <typename To>
void store_rows_from_float(const torch::Tensor& cache, const torch::Tensor& x, const int64_t* batch,
                           const int64_t* pos) {
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2);
  To* dst = static_cast<To*>(cache.data_ptr());
  const float* src = x.data_ptr<float>();
  for (int64_t j = 0; j < t; ++j)
    for (int64_t h = 0; h < heads; ++h) {
      To* out = dst + batch[j] * cache.stride(0) + pos[j] * cache.stride(1) + h * cache.stride(2);
      const float* row = src + j * x.stride(0) + h * x.stride(1);
      for (int64_t i = 0; i < d; ++i) out[i] = To(row[i]);
    }
}

void store_kv(const torch::Tensor& cache, const torch::Tensor& input, const int64_t* batch, const int64_t* pos) {
  TORCH_CHECK(cache.is_floating_point() && cache.element_size() <= input.element_size(),
              "decode_layers: a float KV cache holds the model's dtype or a 16-bit one");
  TORCH_CHECK(cache.stride(3) == 1 && input.stride(2) == 1, "decode_layers: K/V rows must be contiguous");
  const int64_t t = input.size(0), heads = input.size(1);
  TORCH_CHECK(cache.size(2) == heads && cache.size(3) == input.size(2), "decode_layers: KV cache shape mismatch");
  for (int64_t j = 0; j < t; ++j)
    TORCH_CHECK(batch[j] >= 0 && batch[j] < cache.size(0) && pos[j] >= 0 && pos[j] < cache.size(1),
                "decode_layers: write position outside the cache");
  if (cache.scalar_type() != input.scalar_type() && input.scalar_type() == torch::kFloat32) {
    if (cache.scalar_type() == torch::kBFloat16) return store_rows_from_float<c10::BFloat16>(cache, input, batch, pos);
    if (cache.scalar_type() == torch::kHalf) return store_rows_from_float<c10::Half>(cache, input, batch, pos);
  }
  const torch::Tensor x = cache.scalar_type() == input.scalar_type() ? input : input.to(cache.scalar_type());
  const int64_t row = x.size(2) * x.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  const int64_t es = x.element_size();
  for (int64_t j = 0; j < t; ++j)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + (batch[j] * cache.stride(0) + pos[j] * cache.stride(1) + h * cache.stride(2)) * es,
                  src + (j * x.stride(0) + h * x.stride(1)) * es, row);
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
                       const Variant* variant, c10::optional<torch::Tensor> offsets, bool act_groups, int64_t n,
                       c10::optional<torch::Tensor> scale_super, c10::optional<torch::Tensor> offset_super,
                       double mid) {
             TORCH_CHECK(kind == 0 || variant != nullptr, "NativeLinear: a packed linear needs its variant");
             TORCH_CHECK(kind != 3 || n > 0, "NativeLinear: float panels need their output columns");
             return Linear{kind, weight, scales, bias, variant, offsets, act_groups, n, scale_super, offset_super, mid};
           }),
           py::arg("kind"), py::arg("weight"), py::arg("scales"), py::arg("bias"), py::arg("variant"),
           py::arg("offsets") = py::none(), py::arg("act_groups") = false, py::arg("n") = 0,
           py::arg("scale_super") = py::none(), py::arg("offset_super") = py::none(), py::arg("mid") = 0.0);
  py::class_<LayerPlan, std::shared_ptr<LayerPlan>>(mod, "LayerPlan")
      .def(py::init([](std::vector<Linear> qkv, Linear o, std::vector<Linear> gate_up, Linear down,
                       torch::Tensor input_norm,
                       torch::Tensor mlp_norm, double eps, double residual_scale, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, bool unit_offset,
                       c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                       c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> mlp_out_norm,
                       bool gelu, double attention_scale, bool windowed, bool local_rope) {
             TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "LayerPlan: q and k norms come together");
             TORCH_CHECK(qkv.size() == 1 || qkv.size() == 3, "LayerPlan: qkv is one fused linear or q, k, v");
             TORCH_CHECK(gate_up.size() == 1 || gate_up.size() == 2, "LayerPlan: gate_up is one linear or gate, up");
             return std::make_shared<LayerPlan>(LayerPlan{qkv, o, gate_up, down, input_norm, mlp_norm, eps,
                                                          residual_scale, num_heads, num_kv_heads, head_dim,
                                                          unit_offset, q_norm, k_norm, attn_out_norm, mlp_out_norm,
                                                          gelu, attention_scale, windowed, local_rope});
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("input_norm"),
           py::arg("mlp_norm"), py::arg("eps"), py::arg("residual_scale"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("unit_offset") = false,
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("attn_out_norm") = py::none(),
           py::arg("mlp_out_norm") = py::none(), py::arg("gelu") = false, py::arg("attention_scale") = 0.0,
           py::arg("windowed") = false, py::arg("local_rope") = false);
  // h [T, H] embeddings of the new tokens -> final-norm hidden states [T, H]; every float op and
  // attention run as `variant` (the linears as the variant each was packed for).
  // k_caches / v_caches: per layer [B, S, Hkv, D] views of the cache; token t's K/V go to
  // [write_batch[t], write_pos[t]]; it attends to lengths[t] positions of batch t (slots: None) or of
  // batch 0 at slots[t, :] (the paged cache). k_scales / v_scales: per layer [B, S, Hkv] row scales
  // of an int8 cache, or empty for a cache in the model's dtype. A windowed layer attends to
  // window_lengths[t] positions instead: at window_slots[t, :], or without slots from position
  // window_first on. cos_local / sin_local: the table of layers with local_rope.
  mod.def(
      "decode_layers",
      [](const std::vector<std::shared_ptr<LayerPlan>>& plans, torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
         const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
         const std::vector<torch::Tensor>& k_scales, const std::vector<torch::Tensor>& v_scales,
         torch::Tensor write_batch, torch::Tensor write_pos, torch::Tensor lengths,
         c10::optional<torch::Tensor> slots, torch::Tensor final_norm, double final_eps, const Variant& variant,
         c10::optional<torch::Tensor> cos_local, c10::optional<torch::Tensor> sin_local,
         c10::optional<torch::Tensor> window_slots, c10::optional<torch::Tensor> window_lengths,
         int64_t window_first) {
        TORCH_CHECK(!plans.empty() && plans.size() == k_caches.size() && plans.size() == v_caches.size(),
                    "decode_layers: one plan and one cache per layer");
        const bool int8 = !k_scales.empty();
        TORCH_CHECK(!int8 || (k_scales.size() == plans.size() && v_scales.size() == plans.size()),
                    "decode_layers: one k and one v scale tensor per layer for an int8 cache");
        TORCH_CHECK(h.dim() == 2, "decode_layers: h must be [T, H]");
        for (const auto& p : plans) {
          TORCH_CHECK(!p->local_rope || (cos_local.has_value() && sin_local.has_value()),
                      "decode_layers: a layer with the local rope needs cos_local and sin_local");
          TORCH_CHECK(!p->windowed || (window_lengths.has_value() && slots.has_value() == window_slots.has_value()),
                      "decode_layers: a windowed layer needs the window's lengths (and slots with a paged cache)");
        }
        const int64_t t = h.size(0);
        auto wb = write_batch.to(torch::kLong).contiguous(), wp = write_pos.to(torch::kLong).contiguous();
        TORCH_CHECK(wb.numel() == t && wp.numel() == t, "decode_layers: one write position per token");
        const int64_t* wbp = wb.data_ptr<int64_t>();
        const int64_t* wpp = wp.data_ptr<int64_t>();
        torch::Tensor normed = plans[0]->norm(h, plans[0]->input_norm, variant);
        for (size_t i = 0; i < plans.size(); ++i) {
          const LayerPlan& p = *plans[i];
          const int64_t q_size = p.num_heads * p.head_dim, kv_size = p.num_kv_heads * p.head_dim;
          torch::Tensor q, k, v;
          if (p.qkv.size() == 1) {
            torch::Tensor qkv = p.qkv[0](normed);
            q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size), v = qkv.narrow(1, q_size + kv_size, kv_size);
          } else {
            q = p.qkv[0](normed), k = p.qkv[1](normed), v = p.qkv[2](normed);
          }
          q = q.view({t, p.num_heads, p.head_dim});
          k = k.view({t, p.num_kv_heads, p.head_dim});
          v = v.view({t, p.num_kv_heads, p.head_dim});
          if (p.q_norm.has_value()) {  // per head, before rope (fresh tensors, rotated in place below)
            q = p.norm(q, *p.q_norm, variant);
            k = p.norm(k, *p.k_norm, variant);
          }
          const torch::Tensor& c = p.local_rope ? *cos_local : cos;
          const torch::Tensor& s = p.local_rope ? *sin_local : sin;
          rope_(q, c, s, variant);
          rope_(k, c, s, variant);
          torch::Tensor kc = k_caches[i];
          torch::Tensor vc = v_caches[i];
          c10::optional<torch::Tensor> ks, vs;
          if (int8) {
            ks = k_scales[i], vs = v_scales[i];
            store_kv_int8(kc, *ks, k, wbp, wpp);
            store_kv_int8(vc, *vs, v, wbp, wpp);
          } else {
            store_kv(kc, k, wbp, wpp);
            store_kv(vc, v, wbp, wpp);
          }
          const double scale = p.attention_scale > 0 ? p.attention_scale : 1.0 / std::sqrt(double(p.head_dim));
          c10::optional<torch::Tensor> context = slots;
          torch::Tensor context_lengths = lengths;
          if (p.windowed) {  // the window's keys only: its slots, or the cache from window_first on
            context = window_slots;
            context_lengths = *window_lengths;
            if (!slots.has_value() && window_first > 0) {
              kc = kc.narrow(1, window_first, kc.size(1) - window_first);
              vc = vc.narrow(1, window_first, vc.size(1) - window_first);
              if (int8) {
                ks = ks->narrow(1, window_first, ks->size(1) - window_first);
                vs = vs->narrow(1, window_first, vs->size(1) - window_first);
              }
            }
          }
          auto attn = decode_attention(q, kc, vc, context, context_lengths, scale, variant, ks, vs);
          auto o = p.o(attn.view({t, q_size}));
          if (p.attn_out_norm.has_value()) o = p.norm(o, *p.attn_out_norm, variant);
          auto mid = add_rms_norm(h, o, p.residual_scale, p.mlp_norm, p.eps, variant, p.unit_offset);
          torch::Tensor gate, up;
          if (p.gate_up.size() == 1) {
            auto gu = p.gate_up[0](mid[1]);
            const int64_t inter = gu.size(1) / 2;
            gate = gu.narrow(1, 0, inter), up = gu.narrow(1, inter, inter);
          } else {
            gate = p.gate_up[0](mid[1]), up = p.gate_up[1](mid[1]);
          }
          auto down = p.down(p.gelu ? gelu_tanh_mul(gate, up, variant) : silu_mul(gate, up, variant));
          if (p.mlp_out_norm.has_value()) down = p.norm(down, *p.mlp_out_norm, variant);
          const bool last = i + 1 == plans.size();
          auto out = add_rms_norm(mid[0], down, p.residual_scale, last ? final_norm : plans[i + 1]->input_norm,
                                  last ? final_eps : plans[i + 1]->eps, variant,
                                  last ? p.unit_offset : plans[i + 1]->unit_offset);
          h = out[0];
          normed = out[1];
        }
        return normed;
      },
      // No Python inside: other threads (grammar masks, tokenizing, the event loop) run meanwhile.
      py::call_guard<py::gil_scoped_release>(),
      py::arg("plans"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("k_caches"), py::arg("v_caches"),
      py::arg("k_scales"), py::arg("v_scales"), py::arg("write_batch"), py::arg("write_pos"), py::arg("lengths"),
      py::arg("slots"), py::arg("final_norm"), py::arg("final_eps"), py::arg("variant"),
      py::arg("cos_local") = py::none(), py::arg("sin_local") = py::none(), py::arg("window_slots") = py::none(),
      py::arg("window_lengths") = py::none(), py::arg("window_first") = 0,
      "every decoder layer for one new token per sequence; returns the final-norm hidden states");
}
