"""Native kernels: built once by the set-up step (`python -m cpuserve.kernels.build`), loaded here
without ever compiling; absent kernels mean the pure-torch reference path, said once in the log."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
from functools import cache
from types import ModuleType

log = logging.getLogger(__name__)

# Compiled variant names, best first per architecture; "reference" means the pure-torch scheme.
VARIANTS = ("avx512_vnni", "avx2", "neon_i8mm", "neon_dotprod", "neon", "generic")
# Platform-layer names (platform/plan.py) -> the kernel that serves them. AVX-VNNI runs the AVX2
# kernels; SVE2 cores run the NEON I8MM kernels: on the cores we target (Cortex-A720/A520, Neoverse
# V2) SVE's vector length is 128 bits, NEON's, so SVE2 brings no wider dot products (docs/kernels.md).
PLATFORM_TO_KERNEL = {"avx_vnni": "avx2", "sve2_i8mm": "neon_i8mm", "scalar": "generic"}


@cache
def native() -> ModuleType | None:
    from cpuserve.kernels.build import built_library

    path = built_library()
    if path is None:
        log.warning("native kernels are not built (run ./run setup); using the pure-torch reference path")
        return None
    import torch  # noqa: F401  (the extension needs torch's symbols loaded first)

    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@cache
def selected_variant() -> str:
    """CPUSERVE_ISA if set (a name in VARIANTS, or reference), else the platform's choice."""
    override = os.environ.get("CPUSERVE_ISA")
    if override:
        if override not in (*VARIANTS, "reference"):
            from cpuserve.errors import ConfigError

            raise ConfigError(f"CPUSERVE_ISA={override!r}: expected one of {', '.join((*VARIANTS, 'reference'))}")
        return override
    from cpuserve.platform.machine import detect_machine
    from cpuserve.platform.overrides import read_overrides
    from cpuserve.platform.plan import plan_kernel

    chosen = plan_kernel(detect_machine().cpu, read_overrides(os.environ)).variant
    return PLATFORM_TO_KERNEL.get(chosen, chosen if chosen in VARIANTS else "generic")


def runnable_variants() -> list[str]:
    """The compiled variants this CPU can execute (generic always)."""
    from cpuserve.platform.machine import detect_machine
    from cpuserve.platform.plan import KERNEL_VARIANTS

    module = native()
    if module is None:
        return []
    cpu = detect_machine().cpu
    supported = {name for name, needs in KERNEL_VARIANTS.get(cpu.arch, []) if needs <= cpu.features}
    supported |= {PLATFORM_TO_KERNEL[name] for name in supported if name in PLATFORM_TO_KERNEL}
    return [v for v in module.variants() if v == "generic" or v in supported]
