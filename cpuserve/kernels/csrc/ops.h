// The torch-level entry points of the native kernels (qlinear.cpp, layer_ops.cpp), declared once so
// decoder_layers.cpp can chain them without going back to Python.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant);
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          c10::optional<torch::Tensor> bias, std::string variant);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor delta, double scale, torch::Tensor weight,
                                        double eps);
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> slots,
                               torch::Tensor lengths, double scale);
