"""Calibrated quantization: SmoothQuant folding and GPTQ error compensation, layer by layer.

Round-to-nearest alone loses too much on small models: per-token int8 activations suffer from a few
outlier channels, and 4-bit weights from rounding error that nothing compensates. With a calibration
text, each decoder layer in turn (inputs carried through the layers already quantized):

- SmoothQuant: per input channel j of the linears fed by one producer (q/k/v by input_layernorm,
  gate/up by post_attention_layernorm, down by up_proj), s_j = max|x_j|^a / max|w_j|^(1-a); the
  producer's weight is divided by s and the consumers' columns multiplied by it. The network computes
  the same function; activations lose their outliers; the checkpoint contract is unchanged.
- GPTQ: quantize columns one by one, spreading each column's rounding error over the columns not
  yet quantized through the inverse Hessian of the layer's inputs (H = X^T X). Columns go in
  act-order (largest H diagonal first: the most active inputs are rounded while the most columns are
  left to absorb their error) with static groups: a group is still the format's contiguous columns,
  so the checkpoint needs no g_idx and reads as any other (the contract refuses g_idx). A group's
  scale is chosen (as RTN does) on its already-updated weights when its first column comes up.

The result is still symmetric weights with bf16 scales and dynamic per-token int8 activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from cpuserve.model.decoder import CausalLM, ContiguousAttention, DecoderLayer
from cpuserve.quant.config import WeightQuant
from cpuserve.quant.linear import Linear

Quantizer = Callable[[torch.Tensor, WeightQuant], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class CalibrationOptions:
    smoothquant_alpha: float | None = 0.65  # None: no smoothing; 0.65 measured best for SmolLM2 W8A8
    gptq: bool = True
    damp: float = 0.01  # fraction of the mean Hessian diagonal added to it
    block: int = 128  # GPTQ columns updated together
    act_order: bool = True  # visit columns by decreasing Hessian diagonal (groups stay contiguous)


class _InputStats:
    """Per-channel max |x| and X^T X of one linear's inputs, accumulated over calibration batches."""

    def __init__(self, k: int) -> None:
        self.absmax = torch.zeros(k, dtype=torch.float64)
        self.hessian = torch.zeros(k, k, dtype=torch.float64)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0).double())
        self.hessian += (x.T @ x).double()  # fp32 products, as GPTQ's reference accumulates
        self.count += x.shape[0]


def _record_inputs(layer: DecoderLayer, run: Callable[[], object]) -> dict[str, _InputStats]:
    """Input statistics of every linear in the layer over one call of run(). Linears fed the same
    tensor (q/k/v, gate/up) share one _InputStats: X^T X is computed once per distinct input."""
    stats: dict[str, _InputStats] = {}
    last: list = [None, None]  # the last input tensor seen and its statistics

    def hook(name: str, x: torch.Tensor) -> None:
        if last[0] is not x:
            last[0], last[1] = x, _InputStats(x.shape[-1])
            last[1].add(x)
        stats[name] = last[1]

    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: hook(name, args[0]))
        for name, module in layer.named_modules()
        if isinstance(module, Linear)
    ]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return stats


def _smooth(
    producer: torch.Tensor,
    consumers: list[Linear],
    absmax: torch.Tensor,
    alpha: float,
    producer_is_rows: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Fold s into the producer (a norm weight [K], or a linear's output rows [K, ...]) and the
    consumers' input columns; return s (float64) so the recorded statistics can follow."""
    wmax = torch.stack([c.weight.detach().abs().amax(dim=0) for c in consumers]).amax(dim=0).double()
    s = absmax.clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
    s = s.clamp(min=1e-5)
    with torch.no_grad():
        if producer_is_rows:
            producer.copy_((producer.double() / s.unsqueeze(1)).to(dtype).to(producer.dtype))
        else:
            producer.copy_((producer.double() / s).to(dtype).to(producer.dtype))
        for c in consumers:
            c.weight.copy_(c.weight.double() * s)
    return s


def gptq_quantize(
    w: torch.Tensor, hessian: torch.Tensor, quant: WeightQuant, quantizer: Quantizer, opts: CalibrationOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [N, K] and bf16 scales [N, G] of w [N, K] with GPTQ's error feedback.

    Columns are visited in the order opts.act_order picks (largest Hessian diagonal first, or left to
    right); groups stay the contiguous columns of the checkpoint's format whatever the order. A
    group's scale is chosen when the first of its columns is visited, on the group's weights as the
    error feedback has left them by then (pending block updates included)."""
    n, k = w.shape
    g = quant.group_size or k
    w = w.double().clone()
    h = hessian.clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if opts.act_order else torch.arange(k)
    position = torch.empty_like(order)
    position[order] = torch.arange(k)
    if opts.act_order:  # left to right: no copies of w and H
        w, h = w.index_select(1, order), h[order.unsqueeze(1), order]
    h += torch.eye(k, dtype=h.dtype) * opts.damp * torch.diagonal(h).mean()
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q_all = torch.zeros(n, k, dtype=torch.int8)  # in visiting order
    scales = torch.zeros(n, k // g, dtype=torch.bfloat16)
    if not quant.group_size:  # channel-wise: one scale per row, chosen up front
        _, scales = quantizer(w.float(), quant)
    group_quant = WeightQuant(quant.bits, g, quant.packed)
    chosen = torch.zeros(k // g, dtype=torch.bool)
    qmax, qmin = (1 << (quant.bits - 1)) - 1, -(1 << (quant.bits - 1))
    block = max(opts.block, g) if quant.group_size else opts.block
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            group = int(order[i1 + i]) // g
            if quant.group_size and not chosen[group]:
                cols = position[group * g : (group + 1) * g]  # none visited yet: all at i1 + i or later
                current = torch.empty(n, g, dtype=w.dtype)
                inside = cols < i2
                current[:, inside] = w1[:, cols[inside] - i1]
                later = cols[~inside]
                current[:, ~inside] = w.index_select(1, later)
                if i > 0 and len(later):
                    current[:, ~inside] -= err1[:, :i] @ hinv[i1 : i1 + i, later]
                _, sc = quantizer(current.float(), group_quant)
                scales[:, group] = sc[:, 0]
                chosen[group] = True
            s = scales[:, group].double()
            safe = torch.where(s.abs() < 1e-30, torch.ones_like(s), s)
            q = torch.round(w1[:, i] / safe).clamp(qmin, qmax)
            q_all[:, i1 + i] = q.to(torch.int8)
            e = (w1[:, i] - q * safe) / hinv1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return q_all[:, position], scales


def calibrate_and_quantize(
    model: CausalLM,
    windows: torch.Tensor,
    targets: dict[str, WeightQuant],
    quantizer: Quantizer,
    opts: CalibrationOptions,
    storage_dtype: torch.dtype,
    progress: bool = True,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    """Quantize the target linears of a float model (fp32) calibrated on token windows [B, T].

    Returns (module name -> (int8 values, bf16 scales)) and the float tensors that smoothing changed
    (parameter name -> tensor in storage_dtype), which replace the source checkpoint's."""
    spec = model.spec
    t = windows.shape[1]
    tables = model.rope_tables(torch.arange(t))  # each layer's (longrope: attention-scaled)
    backend = ContiguousAttention(None, 0)
    with torch.no_grad():
        h = model.model.embed_tokens(windows).float()
        if spec.embedding_scale != 1.0:
            h = h * spec.embedding_scale
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    changed: dict[str, torch.Tensor] = {}
    layers = list(enumerate(model.model.layers))
    for i, layer in tqdm(layers, desc="calibrating", unit="layer", disable=not progress):
        prefix = f"model.layers.{i}."

        def run(layer: DecoderLayer = layer, i: int = i, h: torch.Tensor = h) -> torch.Tensor:
            with torch.no_grad():
                return layer(h, *tables[i], i, backend)

        stats = _record_inputs(layer, run)
        mlp = layer.mlp
        if opts.smoothquant_alpha is not None:
            groups = [
                (layer.input_layernorm.weight, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], False),
                (layer.post_attention_layernorm.weight, ["mlp.gate_proj", "mlp.up_proj"], False),
                (mlp.up_proj.weight, ["mlp.down_proj"], True),
            ]
            for producer, names, rows in groups:
                if not all(prefix + n in targets for n in names):
                    continue
                consumers = [layer.get_submodule(n) for n in names]
                if rows and mlp.up_proj.bias is not None:
                    continue  # a bias on the producer would need scaling too; leave such layers alone
                st = stats[names[0]]  # shared by every consumer of this producer
                s = _smooth(producer, consumers, st.absmax, opts.smoothquant_alpha, rows, storage_dtype)
                st.absmax /= s
                st.hessian /= s.unsqueeze(0) * s.unsqueeze(1)
            changed[prefix + "input_layernorm.weight"] = layer.input_layernorm.weight.detach().to(storage_dtype)
            changed[prefix + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.detach().to(
                storage_dtype
            )
            if prefix + "mlp.up_proj" not in targets:
                changed[prefix + "mlp.up_proj.weight"] = mlp.up_proj.weight.detach().to(storage_dtype)
        for name, module in layer.named_modules():
            full = prefix + name
            if not isinstance(module, Linear) or full not in targets:
                continue
            quant = targets[full]
            w = module.weight.detach()
            if opts.gptq:
                q, scale = gptq_quantize(w, stats[name].hessian, quant, quantizer, opts)
            else:
                q, scale = quantizer(w.float(), quant)
            quantized[full] = (q, scale)
            g = quant.group_size or w.shape[1]
            deq = (q.float().view(w.shape[0], -1, g) * scale.float().unsqueeze(-1)).view_as(w)
            with torch.no_grad():
                module.weight.copy_(deq)  # later layers calibrate on what this layer will compute
        del stats
        h = run()
    return quantized, changed
