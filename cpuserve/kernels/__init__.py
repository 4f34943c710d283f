"""Native kernels: built once by the set-up step (`python -m cpuserve.kernels.build`), loaded here
without ever compiling; absent kernels mean the pure-torch reference path, said once in the log.

The variant is chosen once (`selected_variant`): the platform layer's choice for this CPU, or
CPUSERVE_ISA, validated there (platform/overrides.py, platform/plan.py). Its name is resolved to a
row of the kernels' variant table (`native().variant(name)`, a `Variant` that equals its name), and
that row is what the quantized linears (KernelChoice), NativeLinear, the float ops and decode
attention pass to every native call: nothing below looks a variant up by name, or reads the
environment but CPUSERVE_AMX, applied once where the kernels load."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
from functools import cache
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)


@cache
def native() -> ModuleType | None:
    from cpuserve.kernels.build import build, built_library, compiler, other_builds

    path = built_library()
    if path is None and other_builds():
        # A wheel's kernels for another torch (or other sources): say so, and build them for this
        # one only when a compiler is there (about a minute, once).
        _, meta = other_builds()[0]
        import torch

        was = f"torch {meta.get('torch', '?')} on {meta.get('machine', '?')}"
        if meta.get("torch") == torch.__version__ and meta.get("machine") == os.uname().machine:
            was, now = "other kernel sources", "these"  # the same torch: the sources changed
        else:
            was, now = f"{was}, not torch {torch.__version__}", "this torch"
        if compiler() is None:
            log.warning("native kernels were built for %s; no C++ compiler here: pure-torch reference path", was)
            return None
        log.warning("native kernels were built for %s: building them for %s now", was, now)
        path = build()
    if path is None:
        log.warning("native kernels are not built (run ./run setup); using the pure-torch reference path")
        return None
    import torch

    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    from cpuserve.platform.overrides import amx_override

    if amx_override(os.environ) is False:
        module.set_amx(False)
    else:  # probe now, from the loading thread, before the weights make the probe's fork dearer
        module.amx_usable()
    return module


def amx_note() -> str:
    """What the AMX tiles do in this process, for the start-up log and doctor: avx512_vnni's
    linears of amx_rows() rows and more (W8A8, and groups in whole 64-input chunks) run on them
    where the CPU has AMX-INT8, the OS grants the tile state and CPUSERVE_AMX is not 0."""
    module = native()
    if module is None:
        return "no AMX tiles (the native kernels are not built)"
    if module.amx_enabled():
        rows = module.amx_rows()
        return f"AMX tiles for avx512_vnni's linears of {rows}+ rows (W8A8, groups in whole 64-input chunks)"
    if not module.amx_switched_on():
        return "AMX tiles off (CPUSERVE_AMX=0): batched linears on VNNI"
    return "no AMX tiles (not on this CPU, or not granted by the OS)"


def selected_variant_name() -> str:
    """CPUSERVE_ISA if set (a variant this CPU supports, or reference), else the platform's choice."""
    from cpuserve.platform.machine import detect_machine
    from cpuserve.platform.overrides import read_overrides
    from cpuserve.platform.plan import plan_kernel

    return plan_kernel(detect_machine().cpu, read_overrides(os.environ)).variant


@cache
def selected_variant() -> Any:
    """The chosen variant's table row (a `Variant`, equal to its name) when the kernels are built;
    else its name ("reference" included). Resolved once; tests that switch CPUSERVE_ISA clear it."""
    name = selected_variant_name()
    module = native() if name != "reference" else None
    return module.variant(name) if module is not None else name


def runnable_variants() -> list[str]:
    """The compiled variants this CPU can execute (generic always), by the platform layer's view."""
    from cpuserve.platform.machine import detect_machine
    from cpuserve.platform.plan import KERNEL_VARIANTS

    module = native()
    if module is None:
        return []
    cpu = detect_machine().cpu
    supported = {name for name, needs in KERNEL_VARIANTS.get(cpu.arch, []) if needs <= cpu.features}
    return [v for v in module.variants() if v == "generic" or v in supported]
