"""What `--dtype auto` computes in on this CPU, and why.

16-bit activations pay only where the CPU multiplies 16-bit values natively (x86 AVX512_BF16 or
AMX-BF16, AVX512-FP16; Arm BF16, FP16 arithmetic). Elsewhere torch converts every bf16 element
in and out of float32 around each op: with torch held to AVX2 a bf16 matmul of 256 rows by
SmolLM2's output head took 587 ms against 89 ms in float32 (docs/benchmarks.md, "Serving under load").
So `auto` keeps the checkpoint's 16-bit dtype only where the CPU, and torch on it, has the dot
products for it, and computes in float32 otherwise. torch held below AVX-512 (ATEN_CPU_CAPABILITY=avx2) cannot use
AVX512_BF16 even where the CPU has it, so that counts too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The features that give native dot products of each 16-bit type, as /proc/cpuinfo spells them.
NATIVE_16BIT = {
    ("x86_64", "bfloat16"): ("avx512_bf16", "amx_bf16"),
    ("x86_64", "float16"): ("avx512_fp16",),
    ("aarch64", "bfloat16"): ("bf16",),
    ("aarch64", "float16"): ("asimdhp",),
}
# torch's CPU capabilities (torch.backends.cpu.get_cpu_capability()) below which its kernels use
# no AVX-512 instruction, whatever the CPU has.
TORCH_BELOW_AVX512 = ("DEFAULT", "AVX2", "NO AVX")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # "bfloat16" | "float16" | "float32"
    reason: str


def choose_auto_dtype(checkpoint_dtype: str, arch: str, features: frozenset[str], torch_capability: str) -> DtypeChoice:
    """The compute dtype `--dtype auto` gives a checkpoint stored in `checkpoint_dtype` here."""
    if checkpoint_dtype not in ("bfloat16", "float16"):
        return DtypeChoice("float32", f"the checkpoint is {checkpoint_dtype}")
    held = arch == "x86_64" and torch_capability.upper() in TORCH_BELOW_AVX512
    candidates = [checkpoint_dtype] + (["bfloat16"] if checkpoint_dtype == "float16" else [])
    for dtype in candidates:
        have = [f for f in NATIVE_16BIT.get((arch, dtype), ()) if f in features]
        if have and not held:
            why = f"the CPU has {'/'.join(have)}"
            if dtype != checkpoint_dtype:
                why += f" but no native {checkpoint_dtype} dot products"
            return DtypeChoice(dtype, f"{why}; the checkpoint is {checkpoint_dtype}")
        if have and held:
            return DtypeChoice(
                "float32",
                f"the CPU has {'/'.join(have)} but torch runs at {torch_capability} (no AVX-512 kernels): "
                f"{checkpoint_dtype} would be converted around every op",
            )
    wanted = "/".join(f for d in candidates for f in NATIVE_16BIT.get((arch, d), ())) or "none known"
    return DtypeChoice(
        "float32",
        f"no native {checkpoint_dtype} dot products ({wanted}): {checkpoint_dtype} would be converted around every op",
    )


@functools.lru_cache(maxsize=4)
def host_auto_dtype(checkpoint_dtype: str) -> DtypeChoice:
    """choose_auto_dtype for this machine (detected once)."""
    import torch

    from cpuserve.platform.cpu import detect_cpu
    from cpuserve.platform.sysfs import SystemFiles

    cpu = detect_cpu(SystemFiles())
    return choose_auto_dtype(checkpoint_dtype, cpu.arch, cpu.features, torch.backends.cpu.get_cpu_capability())
