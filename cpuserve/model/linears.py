"""Which quant method each linear of a model gets, and which projections are fused at build time.

The decoder asks for its linears by checkpoint name. q/k/v (and gate/up) become one layer
(`qkv_proj`, `gate_up_proj`) when fusing is on and all parts get the same method; the loader then
fills the fused layer shard by shard from the parts' checkpoint tensors (CausalLM's
`packed_modules_mapping` names them), so nothing is concatenated or repacked after loading. One
call instead of three (or two) per layer: the activations are quantized once, the thread pool is
entered once, and the weights are read in one pass; each output row depends only on its own weight
row, so a fused layer computes exactly what the parts did.
"""

from __future__ import annotations

import dataclasses

import torch

from cpuserve.errors import ConfigError
from cpuserve.quant.config import QuantConfig, WeightQuant
from cpuserve.quant.linear import Linear
from cpuserve.quant.methods import DenseMethod, IntWeightMethod, method_for


class LinearFactory:
    def __init__(
        self,
        dtype: torch.dtype = torch.float32,
        quant_config: QuantConfig | None = None,
        fuse: bool = False,
        tied_lm_head: bool = False,
        source: str = "config.json",
    ) -> None:
        self.dtype, self.quant_config, self.fuse = dtype, quant_config, fuse
        self.tied_lm_head, self.source = tied_lm_head, source

    def method(self, name: str, in_features: int) -> DenseMethod | IntWeightMethod:
        quant: WeightQuant | None = self.quant_config.scheme_for(name) if self.quant_config else None
        if quant is not None:
            if name == "lm_head" and self.tied_lm_head:
                raise ConfigError(
                    f"{self.source}: lm_head is tied to the embeddings and cannot be quantized; add it to ignore"
                )
            if quant.group_size and in_features % quant.group_size:
                raise ConfigError(
                    f"{self.source}: {name} ({quant.name}): input size {in_features} is not a multiple "
                    f"of group_size {quant.group_size}"
                )
        return method_for(quant, self.dtype)

    def __call__(self, name: str, in_features: int, out_features: int, bias: bool) -> Linear:
        return Linear(in_features, [out_features], bias, self.method(name, in_features))

    def fused(self, prefix: str, parts: list[str], in_features: int, sizes: list[int], bias: bool) -> Linear | None:
        """One layer for parts that read the same input, or None (not fusing, or methods differ)."""
        methods = [self.method(f"{prefix}{part}", in_features) for part in parts]
        # int6 says how the values may be held, not what they are: Q5_0 (int6) and Q8_0 parts are one
        # int8 scheme and fuse, held as int8 unless every part's values fit int6
        plain = [_without_int6(m) for m in methods]
        if not self.fuse or any(m != plain[0] for m in plain):
            return None
        method = methods[0] if all(m == methods[0] for m in methods) else plain[0]
        return Linear(in_features, sizes, bias, method)


def _without_int6(method: DenseMethod | IntWeightMethod) -> DenseMethod | IntWeightMethod:
    """The method with its scheme's int6 flag cleared (a dense method as it is)."""
    if method.quant is None or not method.quant.int6:
        return method
    return dataclasses.replace(method, quant=dataclasses.replace(method.quant, int6=False))
