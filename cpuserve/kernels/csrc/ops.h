// The torch-level entry points of the native kernels (qlinear.cpp, layer_ops.cpp), declared once so
// decoder_layers.cpp can chain them without going back to Python. Each takes the variant's table
// row, resolved once in Python (kernels.variant(name)).
#pragma once

#include <torch/types.h>

#include <vector>

#include "float_types.h"
#include "parallel.h"
#include "variant.h"

using cpk::Variant;

// offsets: groups x N in the driver's column chunks (quant/offsets_layout.py; w = s * q + offset), or
// none; act_groups: activations quantized per group (a K-quant's codes: per super-block) instead of
// per token; scales and offsets fp32, or
// codes with their super-block factors and a coded offset's mid (linear_driver.h, GroupScales).
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, const Variant& variant,
                          c10::optional<torch::Tensor> offsets = c10::nullopt, bool act_groups = false,
                          c10::optional<torch::Tensor> scale_super = c10::nullopt,
                          c10::optional<torch::Tensor> offset_super = c10::nullopt, double mid = 0.0);
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, const Variant& variant,
                          c10::optional<torch::Tensor> offsets = c10::nullopt, bool act_groups = false,
                          c10::optional<torch::Tensor> scale_super = c10::nullopt,
                          c10::optional<torch::Tensor> offset_super = c10::nullopt, double mid = 0.0);
torch::Tensor float_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                           const Variant& variant);
// unit_offset: Gemma's norm, x * (1 + w) in fp32 before rounding (model/ops.py).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, const Variant& variant,
                       bool unit_offset = false);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, double scale, torch::Tensor weight,
                                        double eps, const Variant& variant, bool unit_offset = false);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, const Variant& variant);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, const Variant& variant);
torch::Tensor gelu_tanh_mul(torch::Tensor gate, torch::Tensor up, const Variant& variant);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                               torch::Tensor lengths, double scale, const Variant& variant,
                               c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                                int64_t context, int64_t window, double scale, const Variant& variant,
                                c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale);

// torch's pinned OpenMP pool (at::parallel_for) as the kernels' Parallel: no second runtime.
cpk::Parallel torch_parallel();
// A tensor's float dtype for the torch-free code (fp32, bf16 or fp16; else an error naming `what`).
cpk::DType float_dtype(const torch::Tensor& t, const char* what);
