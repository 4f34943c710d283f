"""cpuserve's packed-panel linears as vLLM linear kernels (imported only inside vLLM).

Two kernels go first in vLLM's CPU lists, through `register_linear_kernel`:
- `CpuserveW4A8LinearKernel` (mixed precision): compressed-tensors W4A8 with int8 dynamic
  per-token symmetric activations, int-quantized (vLLM's CompressedTensorsW4A8Int, int4 values in
  int8) or pack-quantized (CompressedTensorsWNA8Int, int32 words), groups or per channel.
- `CpuserveInt8LinearKernel` (scaled mm): W8A8 per channel, dynamic per-token symmetric activations.

vLLM's mixed-precision config does not say whether activations are quantized (W4A16 and W4A8
pack-quantized layers look alike there), so the two W4A8 schemes' `create_weights` are wrapped to
name the activation contract of the layer being built; without it the kernel declines and vLLM's
own kernel takes the layer (a weight-only layer is never given int8 activations).

At `process_weights_after_loading` each layer's int values and scales go into a cpuserve `Linear`
with the `IntWeightMethod` of its scheme: the same packing and forward the cpuserve engine runs
(one implementation, two front doors). vLLM's copies of the weights are then dropped. After vLLM
loads a model (BaseModelLoader.load_model wrapped), the log and `<cache>/vllm-plugin.json` say how
many linears the plugin took and why it declined others.
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
from cpuserve.quant.methods import IntWeightMethod, KernelChoice

log = logging.getLogger("vllm.plugins.cpuserve")

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Activations:
    """The activation quantization a W4A8 scheme declared for the layer being built."""

    int8: bool
    dynamic: bool
    per_token: bool
    symmetric: bool

    def problem(self) -> str | None:
        if not (self.int8 and self.dynamic and self.per_token and self.symmetric):
            return "cpuserve's W4A8 kernels take int8 dynamic per-token symmetric activations only"
        return None


_building: contextvars.ContextVar[Activations | None] = contextvars.ContextVar("cpuserve_w4a8_acts", default=None)
_kernel: KernelChoice | None = None
_taken: Counter[str] = Counter()
_declined: Counter[str] = Counter()
_layers: list[str] = []


def _holder(quant: WeightQuant, n: int, k: int, dtype: torch.dtype) -> Linear:
    """A cpuserve Linear of the scheme; the caller puts the layer's int values and scales in it."""
    return Linear(k, [n], False, IntWeightMethod(quant, dtype))


def _finish(layer: Any, lin: Linear, drop: tuple[str, ...]) -> None:
    """Pack for the chosen variant, keep the cpuserve layer beside vLLM's (not as a submodule),
    drop vLLM's copies of the weight."""
    lin.method.process_weights_after_loading(lin, _kernel)
    if lin.kernel is None:
        log.warning(
            "cpuserve plugin: %s (%d x %d) does not fit the kernels' shapes; it runs the reference forward",
            getattr(layer, "prefix", "?"),
            lin.out_features,
            lin.in_features,
        )
    object.__setattr__(layer, "_cpuserve_linear", lin)
    layer._cpuserve_handle = len(_linears)
    _linears.append(lin)
    for name in drop:
        if name in layer._parameters:
            delattr(layer, name)
    _taken[lin.method.name] += 1
    _layers.append(getattr(layer, "prefix", "?"))


# The packed layers, by handle: the custom op below takes a handle (an int) so that torch.compile
# (vLLM's default, without --enforce-eager) sees one opaque op per linear instead of a pybind call.
_linears: list[Linear] = []


@torch.library.custom_op("cpuserve::vllm_linear", mutates_args=())
def linear_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    return _linears[handle](x)


@linear_op.register_fake
def _linear_shape(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], _linears[handle].out_features))


def _apply(layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.cpuserve.vllm_linear(x, layer._cpuserve_handle)
    return y if bias is None else y + bias


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
    from cpuserve.vllm_plugin import vllm_version
    from cpuserve.vllm_plugin.status import record_active

    total = sum(_taken.values())
    schemes = ", ".join(f"{n} {s}" for s, n in sorted(_taken.items()))
    declined = ", ".join(f"{n} ({r})" for r, n in sorted(_declined.items())) or "none"
    log.info(
        "cpuserve plugin took %d linears (%s) on the %s kernels; declined: %s",
        total,
        schemes or "none",
        _kernel.variant if _kernel else "?",
        declined,
    )
    record_active(vllm_version(), str(_kernel.variant if _kernel else "?"), dict(_taken), dict(_declined), _layers)


def _decline(reason: str) -> tuple[bool, str]:
    _declined[reason] += 1
    return False, f"cpuserve: {reason}"


def _kernel_classes() -> tuple[type, type]:
    from vllm.model_executor.kernels.linear import MPLinearKernel, MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    class CpuserveW4A8LinearKernel(MPLinearKernel):
        """compressed-tensors W4A8 (int4 weights in groups or per channel, int8 per-token activations)."""

        @classmethod
        def get_min_capability(cls) -> int:
            return -1

        @classmethod
        def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
            acts = _building.get()
            if acts is None:
                return False, "cpuserve: not a W4A8 layer (weight-only or another scheme)"
            if (problem := acts.problem()) is not None:
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
            group = None if c.group_size in (-1, k) else c.group_size
            words = getattr(layer, self.w_q_name).data
            scales = getattr(layer, self.w_s_name).data.float().reshape(n, -1)
            quant = WeightQuant(bits=4, group_size=group, packed=words.dtype == torch.int32)
            lin = _holder(quant, n, k, c.act_type)
            if quant.packed:  # compressed-tensors' int32 words, as a pack-quantized checkpoint holds them
                lin.weight_words = words.contiguous()
            else:  # int4 values one per int8
                lin.qweight = words.to(torch.int8).contiguous()
            lin.scales = scales.contiguous()
            _finish(layer, lin, (self.w_q_name, "weight", self.w_s_name, "weight_shape"))

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return _apply(layer, x, bias)

    from vllm.model_executor.kernels.linear import Int8ScaledMMLinearKernel
    from vllm.platforms import current_platform

    class CpuserveInt8LinearKernel(Int8ScaledMMLinearKernel):
        """W8A8: int8 weights per output channel, int8 dynamic per-token symmetric activations."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if current_platform.is_cpu() else (False, "cpuserve: CPU only")

        @classmethod
        def can_implement(cls, c: Any) -> tuple[bool, str | None]:
            if c.is_static_input_scheme:
                return _decline("static activation scales")
            if not c.input_symmetric:
                return _decline("asymmetric activations")
            if not c.is_channelwise:
                return _decline("per-tensor weight scales")
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            w_name, s_name, *_ = self.layer_param_names
            weight = getattr(layer, w_name).data
            n, k = weight.shape
            lin = _holder(WeightQuant(bits=8, group_size=None, packed=False), n, k, torch.float32)
            lin.qweight = weight.contiguous()
            lin.scales = getattr(layer, s_name).data.float().reshape(n, 1).contiguous()
            _finish(layer, lin, (w_name, s_name))

        def apply_weights(
            self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
        ) -> torch.Tensor:
            return _apply(layer, x, bias)

    return CpuserveW4A8LinearKernel, CpuserveInt8LinearKernel


def _declaring(create_weights: Any, activations: Any) -> Any:
    """Wrap a W4A8 scheme's create_weights so the kernel choice inside it knows the activations."""

    @functools.wraps(create_weights)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _building.set(activations(self))
        try:
            return create_weights(self, *args, **kwargs)
        finally:
            _building.reset(token)

    return wrapper


def _int_quantized_acts(scheme: Any) -> Activations:
    # CompressedTensorsW4A8Int is only chosen for int8 dynamic per-token activations
    return Activations(True, not scheme.is_static_input_scheme, True, scheme.input_symmetric)


def _pack_quantized_acts(scheme: Any) -> Activations:
    q = scheme.input_quant
    if q is None:
        return Activations(False, False, False, False)
    strategy = getattr(q.strategy, "value", q.strategy)
    return Activations(q.num_bits == 8, bool(q.dynamic), strategy == "token", bool(q.symmetric))


def install(kernel: KernelChoice, schemes: tuple[str, ...] = ("w4a8", "w8a8")) -> None:
    """Put the kernels of `schemes` first in vLLM's CPU lists and mark the W4A8 schemes' layers."""
    global _kernel
    from vllm.model_executor.kernels import linear as vllm_linear
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a8_int as w4a8_int,
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
    w4a8_int.CompressedTensorsW4A8Int.create_weights = _declaring(
        w4a8_int.CompressedTensorsW4A8Int.create_weights, _int_quantized_acts
    )
    wna8.CompressedTensorsWNA8Int.create_weights = _declaring(
        wna8.CompressedTensorsWNA8Int.create_weights, _pack_quantized_acts
    )
    BaseModelLoader.load_model = _reporting(BaseModelLoader.load_model)
