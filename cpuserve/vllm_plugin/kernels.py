"""cpuserve's packed-panel linears as vLLM linear kernels (imported only inside vLLM).

Two kernels go first in vLLM's CPU lists, through `register_linear_kernel`:
- `CpuserveW4A8LinearKernel` (mixed precision): compressed-tensors W4A8 with int8 dynamic
  per-token symmetric activations, int-quantized (vLLM's CompressedTensorsW4A8Int, int4 values in
  int8) or pack-quantized (CompressedTensorsWNA8Int, int32 words), in groups (any multiple of 32
  dividing the input size: 32, 64, 128, ...) or per channel.
- `CpuserveInt8LinearKernel` (scaled mm): compressed-tensors W8A8 per channel, dynamic per-token
  symmetric activations; a layer whose shape the kernels do not take goes to vLLM's own int8 kernel.

vLLM's kernel configs do not say which scheme asks (W4A16 and W4A8 pack-quantized layers look alike
in the mixed-precision one; Quark's int8 layers use the same int8 list), so the three
compressed-tensors schemes' `create_weights` are wrapped to name the layer being built; without that
the kernels decline and vLLM's own take the layer (a weight-only layer never gets int8 activations).

At `process_weights_after_loading` each layer's int values and scales go into a cpuserve `Linear`
with the `IntWeightMethod` of its scheme, which packs them as the cpuserve engine does; its kernel
operands become buffers of vLLM's layer, and the forward is one custom op (cpuserve::int_linear)
calling the same native linear with the same operands as the engine (one implementation, two front
doors; torch.compile sees an opaque op with tensor inputs). vLLM's weight parameters are replaced by
empty ones (code that asks a layer for its weight's device still finds one). After vLLM loads a
model (BaseModelLoader.load_model wrapped), the log and `<cache>/vllm-plugin.json` say how many
linears the plugin took and why it declined others.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from cpuserve.quant.config import WeightQuant
from cpuserve.quant.linear import Linear
from cpuserve.quant.methods import IntWeightMethod, KernelChoice, native_int_linear

log = logging.getLogger("vllm.plugins.cpuserve")

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Building:
    """The compressed-tensors scheme of the layer being built, and its activation quantization."""

    scheme: str  # "w4a8" | "w8a8"
    int8: bool
    dynamic: bool
    per_token: bool
    symmetric: bool

    def problem(self) -> str | None:
        """Why cpuserve's kernels cannot honour these activations, or None."""
        if not (self.int8 and self.dynamic and self.per_token and self.symmetric):
            return "cpuserve's kernels take int8 dynamic per-token symmetric activations only"
        return None


_building: contextvars.ContextVar[Building | None] = contextvars.ContextVar("cpuserve_building", default=None)
_kernel: KernelChoice | None = None
_taken: Counter[str] = Counter()
_declined: Counter[str] = Counter()
_layers: list[str] = []


# The schemes taken here have neither GGUF's per-group offsets nor per-group activations (a checkpoint
# asking for those is declined), and the variant is the process's (_kernel, chosen once): the op
# takes tensors, the bit width and the size.
@torch.library.custom_op(
    "cpuserve::int_linear",
    mutates_args=(),
    schema="(Tensor x, Tensor weight, Tensor scales, Tensor? bias, int bits, int out_features) -> Tensor",
)
def int_linear(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, bits: int, out_features: int
) -> torch.Tensor:
    """cpuserve's W4A8 / W8A8 native linear on operands packed by IntWeightMethod."""
    return native_int_linear(_kernel, bits, x, weight, scales, bias, None, False, out_features)


@int_linear.register_fake
def _int_linear_shape(x, weight, scales, bias, bits, out_features):  # type: ignore[no-untyped-def]
    return x.new_empty((*x.shape[:-1], out_features))


def _pack(layer: Any, quant: WeightQuant, fill: Any, n: int, k: int, drop: tuple[str, ...]) -> bool:
    """Pack the layer's weights the engine's way and hang the operands on vLLM's layer; False (and
    nothing changed) when the kernels do not take its shape."""
    lin = Linear(k, [n], False, IntWeightMethod(quant, torch.float32))
    fill(lin)
    lin.method.process_weights_after_loading(lin, _kernel)
    if lin.kernel is None:
        return False
    weight, scales = lin.method.kernel_operands(lin)
    layer.register_buffer("cpuserve_weight", weight, persistent=False)
    layer.register_buffer("cpuserve_scales", scales, persistent=False)
    layer.cpuserve_op = (quant.bits, n)
    for name in drop:
        old = layer._parameters.get(name)
        if old is not None:
            setattr(layer, name, torch.nn.Parameter(old.new_empty(0), requires_grad=False))
    _taken[quant.name] += 1
    _layers.append(getattr(layer, "prefix", "?"))
    return True


def _apply(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    bits, n = layer.cpuserve_op
    return int_linear(x, layer.cpuserve_weight, layer.cpuserve_scales, bias, bits, n)


def _decline(reason: str) -> tuple[bool, str]:
    _declined[reason] += 1
    return False, f"cpuserve: {reason}"


def _kernel_classes() -> tuple[type, type]:
    from vllm.model_executor.kernels.linear import (
        CPUInt8ScaledMMLinearKernel,
        Int8ScaledMMLinearKernel,
        MPLinearKernel,
        MPLinearLayerConfig,
    )
    from vllm.platforms import current_platform
    from vllm.scalar_type import scalar_types

    class CpuserveW4A8LinearKernel(MPLinearKernel):
        """compressed-tensors W4A8 (int4 weights in groups or per channel, int8 per-token activations)."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            building = _building.get()
            if building is None or building.scheme != "w4a8":
                return False, "cpuserve: not a compressed-tensors W4A8 layer (weight-only or another scheme)"
            if (problem := building.problem()) is not None:
                return _decline(problem)
            if c.weight_type not in (scalar_types.int4, scalar_types.uint4b8):
                return _decline(f"weight type {c.weight_type} is not int4")
            if c.zero_points:
                return _decline("asymmetric weights (zero points)")
            if c.act_type not in ACT_DTYPES:
                return _decline(f"activation dtype {c.act_type}")
            if tuple(c.partition_weight_shape) != tuple(c.full_weight_shape):
                return _decline("tensor-parallel shards")
            k = c.partition_weight_shape[0]
            group = k if c.group_size == -1 else c.group_size
            if k % 32 or group % 32 or k % group:
                return _decline(f"input size {k} / group {group} not multiples of 32")
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            c = self.config
            k, n = c.partition_weight_shape
            words = getattr(layer, self.w_q_name).data
            scales = getattr(layer, self.w_s_name).data.float().reshape(n, -1)
            quant = WeightQuant(
                bits=4, group_size=None if c.group_size in (-1, k) else c.group_size, packed=words.dtype == torch.int32
            )

            def fill(lin: Linear) -> None:
                if quant.packed:  # compressed-tensors' int32 words, as a pack-quantized checkpoint holds them
                    lin.weight_words = words.contiguous()
                else:  # int4 values one per int8
                    lin.qweight = words.to(torch.int8).contiguous()
                lin.scales = scales.contiguous()

            drop = (self.w_q_name, "weight", self.w_s_name, "weight_shape")
            if not _pack(layer, quant, fill, n, k, drop):  # can_implement checked the shapes: cannot happen
                raise RuntimeError(f"cpuserve plugin: {getattr(layer, 'prefix', '?')} did not pack")

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return _apply(layer, x, bias)

    class CpuserveInt8LinearKernel(Int8ScaledMMLinearKernel):
        """compressed-tensors W8A8: int8 weights per output channel, int8 dynamic per-token symmetric
        activations. A shape the kernels do not take stays on vLLM's CPUInt8ScaledMMLinearKernel."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if current_platform.is_cpu() else (False, "cpuserve: CPU only")

        @classmethod
        def can_implement(cls, c: Any) -> tuple[bool, str | None]:
            building = _building.get()
            if building is None or building.scheme != "w8a8":
                return False, "cpuserve: not a compressed-tensors W8A8 layer"
            if c.is_static_input_scheme:
                return _decline("static activation scales")
            if not c.input_symmetric:
                return _decline("asymmetric activations")
            if not c.is_channelwise:
                return _decline("per-tensor weight scales")
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            self.fallback = None
            w_name, s_name, *_ = self.layer_param_names
            weight = getattr(layer, w_name).data
            n, k = weight.shape
            scales = getattr(layer, s_name).data.float().reshape(n, 1)

            def fill(lin: Linear) -> None:
                lin.qweight, lin.scales = weight.contiguous(), scales.contiguous()

            if not _pack(layer, WeightQuant(bits=8, group_size=None, packed=False), fill, n, k, (w_name, s_name)):
                _declined[f"shape {n} x {k}: vLLM's int8 kernel"] += 1
                self.fallback = CPUInt8ScaledMMLinearKernel(self.config, self.layer_param_names)
                self.fallback.process_weights_after_loading(layer)

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            if self.fallback is not None:
                return self.fallback.apply_weights(layer, x, bias)
            return _apply(layer, x, bias)

    return CpuserveW4A8LinearKernel, CpuserveInt8LinearKernel


def _declaring(create_weights: Any, building: Any) -> Any:
    """Wrap a compressed-tensors scheme's create_weights so the kernel choice inside it knows the
    scheme and activations of the layer."""

    @functools.wraps(create_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _building.set(building(self))
        try:
            return create_weights(self, *args, **kwargs)
        finally:
            _building.reset(token)

    return wrapper


def _int_quantized_w4a8(scheme: Any) -> Building:
    # CompressedTensorsW4A8Int is only chosen for int8 dynamic per-token activations
    return Building("w4a8", True, not scheme.is_static_input_scheme, True, scheme.input_symmetric)


def _pack_quantized_w4a8(scheme: Any) -> Building:
    q = scheme.input_quant
    if q is None:
        return Building("w4a8", False, False, False, False)
    strategy = getattr(q.strategy, "value", q.strategy)
    return Building("w4a8", q.num_bits == 8, bool(q.dynamic), strategy == "token", bool(q.symmetric))


def _w8a8(scheme: Any) -> Building:
    # CompressedTensorsW8A8Int8 is chosen for int8 activations, per token when dynamic
    return Building("w8a8", True, not scheme.is_static_input_scheme, True, scheme.input_symmetric)


def _reporting(load_model: Any) -> Any:
    """Wrap vLLM's model loading: once a model is loaded (every layer packed), say and record
    what the plugin took, including nothing."""

    @functools.wraps(load_model)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _taken.clear()
        _declined.clear()
        _layers.clear()
        model = load_model(*args, **kwargs)
        try:
            report()
        except Exception:  # the record is for doctor; it never stops vLLM
            log.exception("cpuserve plugin: could not record what it took")
        return model

    return wrapper


def report() -> None:
    """Log and record (for doctor) what the plugin took in the model just loaded."""
    from cpuserve.vllm_plugin import vllm_version
    from cpuserve.vllm_plugin.status import record_active

    total = sum(_taken.values())
    schemes = ", ".join(f"{n} {s}" for s, n in sorted(_taken.items()))
    declined = ", ".join(f"{n} ({r})" for r, n in sorted(_declined.items())) or "none"
    variant = str(_kernel.variant) if _kernel else "?"
    log.info(
        "cpuserve plugin took %d linears (%s) on the %s kernels; declined: %s",
        total,
        schemes or "none",
        variant,
        declined,
    )
    record_active(vllm_version(), variant, dict(_taken), dict(_declined), _layers)


def install(kernel: KernelChoice, schemes: tuple[str, ...]) -> None:
    """Put the kernels of `schemes` first in vLLM's CPU lists and mark the compressed-tensors
    schemes' layers."""
    global _kernel
    from vllm.model_executor.kernels import linear as vllm_linear
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a8_int as w4a8_int,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_int8 as w8a8_int8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa8 as wna8,
    )
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.platforms import PlatformEnum

    _kernel = kernel
    w4a8, int8 = _kernel_classes()
    for scheme, cls, kind, table in (
        ("w4a8", w4a8, "mp", "_POSSIBLE_KERNELS"),
        ("w8a8", int8, "int8", "_POSSIBLE_INT8_KERNELS"),
    ):
        if scheme not in schemes:
            continue
        vllm_linear.register_linear_kernel(cls, PlatformEnum.CPU, kind)
        kernels = getattr(vllm_linear, table)[PlatformEnum.CPU]  # registration appends: ours goes first
        kernels.insert(0, kernels.pop(kernels.index(cls)))
    for module, cls_name, building in (
        (w4a8_int, "CompressedTensorsW4A8Int", _int_quantized_w4a8),
        (wna8, "CompressedTensorsWNA8Int", _pack_quantized_w4a8),
        (w8a8_int8, "CompressedTensorsW8A8Int8", _w8a8),
    ):
        cls = getattr(module, cls_name)
        cls.create_weights = _declaring(cls.create_weights, building)
    BaseModelLoader.load_model = _reporting(BaseModelLoader.load_model)
