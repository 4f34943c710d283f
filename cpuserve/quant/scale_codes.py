"""Group scales and offsets kept as GGUF's blocks store them: a small code per group (a K-quant's
6-bit sub-block scale and minimum, Q6_K's int8 scale, or a simple type's fp16 scale) times one fp16
factor per super-block of `per` groups (the K-quants' d and -dmin, as the file holds them; none for
the simple types).

    scale[n, g]  = scale_super[n, g // per] * scale_code[n, g]     (no super: the code itself)
    offset[n, g] = mid * scale[n, g] + offset_super[n, g // per] * offset_code[n, g]

Why: fp32 per group cost a Q4_K weight 2 of its 6 bits and a Q6_K weight 2 of its 10, and decode
reads every byte of them each step. A code takes a byte (a factor 2 bytes per 8 or 16 groups; an
fp16 code 2 bytes): Q4_K 4.625 bits a weight instead of 6, Q6_K (as int6 panels) 6.56, the file's.
Both products are exact in float32 (an fp16 times an 8-bit integer) and the sum is rounded once, as
the file's own arithmetic, so the kernels' results do not change: the driver expands the codes of a
few panels at a time right before the kernels read them (linear_driver.h, GroupScales). These
functions are its reference (quant/gguf_blocks.py decodes through them, tests/test_gguf_quant.py
checks both against gguf-py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CODE_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, "float16": torch.float16}


@dataclass(frozen=True)
class ScaleCoding:
    """How one GGUF type codes its scales (and offsets, if it has a minimum)."""

    code: str  # of the scales: a CODE_DTYPES key
    per: int  # groups per super-block factor; 0: no factors
    offset_code: str | None = None  # of the offsets; None: no offsets
    mid: float = 0.0  # offset = mid * scale + the coded part

    @property
    def code_dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.code]

    @property
    def offset_dtype(self) -> torch.dtype:
        return CODE_DTYPES[self.offset_code or self.code]

    def parts(self) -> list[str]:
        """The checkpoint tensors (suffixes after the module name) that hold them."""
        names = ["weight_scale_code"] + (["weight_scale_super"] if self.per else [])
        if self.offset_code is not None:
            names += ["weight_offset_code"] + (["weight_offset_super"] if self.per else [])
        return names

    def part_shape(self, part: str, n: int, groups: int) -> tuple[int, int]:
        return (n, groups // self.per) if part.endswith("super") else (n, groups)


def activation_block(coding: ScaleCoding | None, group: int) -> int:
    """Groups per activation scale of a linear with activations per group: a K-quant's super-block
    (8-bit codes under factors, an integral mid; llama.cpp's Q8_K), so the x86 kernels fold each
    super-block in int32 (linear_driver.h, GroupScales::fold_per: the same rule); 1 otherwise."""
    if coding is None or coding.code not in ("uint8", "int8") or not coding.per or group * coding.per > 256:
        return 1
    if coding.offset_code is not None and (
        coding.offset_code not in ("uint8", "int8") or not 0 <= coding.mid <= 128 or coding.mid != int(coding.mid)
    ):
        return 1
    return coding.per


def expand_scales(codes: torch.Tensor, supers: torch.Tensor | None, per: int) -> torch.Tensor:
    """fp32 scales [N, G] from codes [N, G] and factors [N, G / per] (or none)."""
    scales = codes.float()
    if supers is not None:
        scales = supers.float().repeat_interleave(per, dim=1) * scales
    return scales


def expand_offsets(
    scales: torch.Tensor, codes: torch.Tensor, supers: torch.Tensor | None, per: int, mid: float
) -> torch.Tensor:
    """fp32 offsets [N, G]: mid * scales + the coded part (one rounding: both products are exact)."""
    return mid * scales + expand_scales(codes, supers, per)
