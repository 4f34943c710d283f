"""Round-to-nearest symmetric weight quantization with compressed-tensors' conventions: what
`cpuserve quantize` writes, and what `--quantize-lm-head` does to the output head at load."""

from __future__ import annotations

import torch

from cpuserve.errors import ConfigError
from cpuserve.quant.config import WeightQuant


def quantize_weight(w: torch.Tensor, quant: WeightQuant, method: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [N, K] and bf16 scales [N, G] for a float weight [N, K].

    minmax: compressed-tensors' rule, scale = amax / ((2^bits - 1) / 2).
    mse: per group, the scale among candidates around amax / 2^(bits-1), either sign, whose
    round-to-nearest reconstruction error is smallest; a negative scale lets the largest-magnitude
    weight land exactly on -2^(bits-1) whichever its sign (as llama.cpp's Q4_0 does). Still
    symmetric round-to-nearest: w ~ q * s.
    """
    n, k = w.shape
    g = quant.group_size or k
    wf = w.float().view(n, k // g, g)
    qmax, qmin = (1 << (quant.bits - 1)) - 1, -(1 << (quant.bits - 1))
    amax = wf.abs().amax(dim=-1)
    if method == "minmax":
        candidates = [amax / ((2**quant.bits - 1) / 2)]
    elif method == "mse":
        # Signed max: the value of largest magnitude, with its sign.
        idx = wf.abs().argmax(dim=-1, keepdim=True)
        signed_max = wf.gather(-1, idx).squeeze(-1)
        candidates = [amax / ((2**quant.bits - 1) / 2)]
        for d in torch.linspace(-0.5, 1.0, 7).tolist():
            candidates.append(signed_max / (qmin - d))  # negative qmin: maps the extreme near -2^(bits-1)
    else:
        raise ConfigError(f"--scale-method {method!r}: expected mse or minmax")
    best_q, best_scale, best_err = None, None, None
    for cand in candidates:
        scale = cand.to(torch.bfloat16)
        safe = torch.where(scale.float().abs() < 1e-30, torch.ones_like(scale.float()), scale.float()).unsqueeze(-1)
        q = torch.round(wf / safe).clamp(qmin, qmax)
        err = ((q * safe - wf) ** 2).sum(dim=-1)
        if best_err is None:
            best_q, best_scale, best_err = q, scale, err
        else:
            better = err < best_err
            best_q = torch.where(better.unsqueeze(-1), q, best_q)
            best_scale = torch.where(better, scale, best_scale)
            best_err = torch.minimum(err, best_err)
    return best_q.to(torch.int8).view(n, k), best_scale


def quantize_weight_in_chunks(
    w: torch.Tensor, quant: WeightQuant, method: str = "mse", rows: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_weight a block of rows at a time: the same result (rows are independent) with a
    bounded working set; a 130k-row output head otherwise needs several GB of fp32 temporaries."""
    parts = [quantize_weight(w[i : i + rows], quant, method) for i in range(0, w.shape[0], rows)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])
