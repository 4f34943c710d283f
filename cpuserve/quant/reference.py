"""The quant schemes' reference forward: exactly the integer arithmetic of the contract (kernels.md).

Activations quantized per token, s_a = amax / 127, q_a = round(x / s_a) in [-127, 127]; per group an
exact integer dot product; y = s_a * sum_g s_w[g] * acc_g. It is the oracle of the native kernels
and the path a linear takes without one (CPUSERVE_ISA=reference, or shapes no kernel takes).
"""

from __future__ import annotations

import torch

# Integer partial sums stay exact in fp32 while |sum| < 2^24: 127 * 127 * 1024 < 2^24.
EXACT_CHUNK = 1024


def _per_group_forward(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor | None,
    block: int = 1,
) -> torch.Tensor:
    """y = sum_g s_a[g] * (s_w[g] * acc_g + offset_g * sum_g(q_a)), the activations of each block
    of `block` groups quantized on their own; group sums exact (g <= EXACT_CHUNK), combined in
    float64."""
    m, k = x.shape
    n, groups = scales.shape
    g = k // groups
    xb = x.float().view(m, groups // block, block * g)
    sa = xb.abs().amax(dim=-1).clamp(min=1e-8) / 127.0  # [M, blocks]
    qa = torch.round(xb / sa.unsqueeze(-1)).clamp(-127, 127).view(m, groups, g)
    sa = sa.repeat_interleave(block, dim=1)  # [M, groups]
    qw = qweight.float().view(n, groups, g)
    out = torch.empty(m, n, dtype=torch.float64)
    rows = max(1, (1 << 24) // max(1, n * groups))
    for start in range(0, m, rows):
        a = qa[start : start + rows]
        acc = torch.einsum("mgk,ngk->mng", a, qw).double() * scales.double()  # exact sums, then scales
        if offsets is not None:
            acc = acc + a.double().sum(-1).unsqueeze(1) * offsets.double()
        out[start : start + rows] = (acc * sa[start : start + rows].double().unsqueeze(1)).sum(-1)
    y = out.float()
    return y + bias.float() if bias is not None else y


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (as float values in [-127, 127]) and scales [M, 1]."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x / scale).clamp(-127, 127), scale


@torch.inference_mode()
def reference_forward(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    offsets: torch.Tensor | None = None,
    act_groups: bool = False,
    act_block: int = 1,
) -> torch.Tensor:
    """offsets [N, groups]: w = s * q + offset per group, so y gains s_a * sum_g offset_g * sum_g(q_a).
    act_groups: activations quantized per group (one scale per token and group), not per token;
    act_block groups per scale (a K-quant's super-block: quant/scale_codes.py activation_block)."""
    lead, k = x.shape[:-1], x.shape[-1]
    n, groups = scales.shape
    g = k // groups
    if act_groups and groups > 1:
        return (
            _per_group_forward(x.reshape(-1, k), qweight, scales, bias, offsets, act_block).to(x.dtype).view(*lead, n)
        )
    qa, sa = quantize_activations(x.reshape(-1, k).float())
    m = qa.shape[0]
    chunk = next(g // f for f in range(1, g + 1) if g % f == 0 and g // f <= EXACT_CHUNK)
    qw = qweight.float().view(n, k // chunk, chunk)
    per_group = g // chunk
    out = torch.empty(m, n, dtype=torch.float64 if per_group > 1 else torch.float32)
    rows = max(1, (1 << 24) // max(1, n * (k // chunk)))  # bound the [rows, N, chunks] temporary
    for start in range(0, m, rows):
        a = qa[start : start + rows].view(-1, k // chunk, chunk)
        acc = torch.einsum("mck,nck->mnc", a, qw)  # exact integer sums per chunk
        if per_group > 1:  # channel-wise with long K: add chunks exactly, in float64
            acc = acc.double().view(acc.shape[0], n, groups, per_group).sum(-1)
        out[start : start + rows] = (acc * scales.to(acc.dtype)).sum(-1)
    if offsets is not None:  # group sums of the int8 activations are exact integers
        sums = qa.double().view(m, groups, g).sum(-1)
        out = out.double() + sums @ offsets.double().t()
    y = (out * sa.to(out.dtype)).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*lead, n)
