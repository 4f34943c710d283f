"""A linear layer whose weights belong to its quant method (quant/methods.py).

The layer holds what every method shares (sizes, the output sizes of fused shards, the bias); the
method creates the weight tensors with the checkpoint's names, fills them shard by shard as the
loader reads the checkpoint, packs them once for the chosen kernel, and runs the forward. Nothing
outside the method reads or writes its tensors: native decode asks `native_linear()` for an opaque
handle.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, method: Any) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.method = method
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        method.create_weights(self)

    @property
    def quant(self):  # type: ignore[no-untyped-def]
        """The WeightQuant of a quantized layer, None for a float one."""
        return self.method.quant

    @property
    def variant(self) -> str:
        """The kernel variant a quantized layer runs on ("reference": the pure-torch forward)."""
        kernel = getattr(self, "kernel", None)
        return kernel.variant if kernel is not None else "reference"

    def int_weight(self) -> torch.Tensor:
        """A quantized layer's int8 values [N, K], whatever layout holds them."""
        return self.method.int_weight(self)

    def weight_scales(self) -> torch.Tensor:
        """A quantized layer's scales [N, G] in the checkpoint's order, whatever layout holds them."""
        return self.method.weight_scales(self)

    def weight_offsets(self) -> torch.Tensor | None:
        """A quantized layer's offsets [N, G] in the checkpoint's order, or None for a scheme without."""
        return self.method.weight_offsets(self)

    def shard_rows(self, shard: int) -> slice:
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_bias(self, shard: int, tensor: torch.Tensor) -> None:
        """One shard's bias, in the compute dtype (as every float tensor of the model)."""
        if self.bias.is_meta:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=self.method.dtype), requires_grad=False)
        self.bias.data[self.shard_rows(shard)] = tensor.to(self.method.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def native_linear(self, kernels: Any) -> Any | None:
        """The handle the native decode step runs this layer with, or None if it cannot."""
        return self.method.native_linear(self, kernels)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, output_sizes={self.output_sizes}, method={self.method.name}"
