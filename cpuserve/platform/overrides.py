"""Environment overrides, read once at start: vLLM's names, cpuserve's own, and the reference
image's variables that cpuserve does not need."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from cpuserve.errors import ConfigError
from cpuserve.platform.sysfs import parse_cpulist

log = logging.getLogger(__name__)

# (cpuserve name, vLLM name): the cpuserve name wins when both are set.
KVCACHE_SPACE = ("CPUSERVE_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")
THREADS_BIND = ("CPUSERVE_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND")
NUM_THREADS = ("CPUSERVE_NUM_THREADS", "OMP_NUM_THREADS")
ISA = ("CPUSERVE_ISA",)  # a kernel variant the CPU supports, or reference
REPLACED = {"CPUSERVE_KERNEL_VARIANT": "CPUSERVE_ISA"}  # old name -> the one that replaced it
QUANTIZE_LM_HEAD = ("CPUSERVE_QUANTIZE_LM_HEAD",)
AMX = ("CPUSERVE_AMX",)  # 0 / off: avx512_vnni's batched linears stay on VNNI where AMX tiles are granted
ON_OFF = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False}
LM_HEAD_KINDS = ("int8", "int4")
NOT_NEEDED = {
    "FLAGGEMS_VENDOR": "CPU features are detected",
    "TRITON_CPU_BACKEND": "no Triton: kernels are precompiled",
    "VLLM_PLUGINS": "no plugins: the quantized kernels are built in",
    "TRITON_CACHE_DIR": "nothing is compiled at run time",
    "MKL_NUM_THREADS": "MKL is not used; threads come from the plan",
    "A720_CORES": "big cores are detected",
}


@dataclass(frozen=True)
class Overrides:
    kvcache_bytes: int | None = None
    bind: str = "auto"  # "auto", "nobind" or "list"
    bind_cpus: tuple[int, ...] = ()
    num_threads: int | None = None
    kernel_variant: str | None = None  # CPUSERVE_ISA
    quantize_lm_head: str | None = None  # CPUSERVE_QUANTIZE_LM_HEAD: "int8" | "int4" | "none"; None: not set
    amx: bool | None = None  # CPUSERVE_AMX; None: not set (the tiles run where granted)
    sources: dict[str, str] = field(default_factory=dict)  # setting -> "NAME=value" it came from
    not_needed: dict[str, str] = field(default_factory=dict)  # NAME=value -> why


def _pick(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value.strip() != "":
            return name, value.strip()
    return None


def amx_override(env: Mapping[str, str]) -> bool | None:
    """CPUSERVE_AMX alone (the kernels read it where they load, without the other overrides): on,
    off, or None when unset; any other value is a ConfigError."""
    picked = _pick(env, AMX)
    if picked is None:
        return None
    if picked[1].lower() not in ON_OFF:
        raise ConfigError(f"{picked[0]}={picked[1]!r}: expected 1 or 0 (on or off)")
    return ON_OFF[picked[1].lower()]


def read_overrides(env: Mapping[str, str]) -> Overrides:
    """Parse and validate; a bad value is a ConfigError that says what was asked and what works."""
    kv_bytes = bind_cpus = num_threads = variant = None
    bind = "auto"
    sources: dict[str, str] = {}
    for old, new in REPLACED.items():
        if _pick(env, (old,)):
            raise ConfigError(f"{old} was replaced by {new}; set {new}={env[old].strip()} instead")
    if picked := _pick(env, KVCACHE_SPACE):
        name, value = picked
        try:
            gib = float(value)
        except ValueError:
            gib = math.nan
        if not math.isfinite(gib) or gib <= 0:
            raise ConfigError(f"{name}={value!r}: expected the KV cache size in GiB, a number > 0 (e.g. 4)")
        kv_bytes = int(gib * 1024**3)
        sources["kvcache"] = f"{name}={value}"
    if picked := _pick(env, THREADS_BIND):
        name, value = picked
        if value in ("auto", "nobind"):
            bind = value
        elif "|" in value:
            raise ConfigError(
                f"{name}={value!r}: '|' separates tensor-parallel ranks; cpuserve runs one process, "
                "give one CPU list (e.g. 0-7)"
            )
        else:
            try:
                bind_cpus = tuple(parse_cpulist(value))
            except ValueError as exc:
                raise ConfigError(f"{name}={value!r}: {exc}; expected a CPU list, 'auto' or 'nobind'") from None
            if not bind_cpus:
                raise ConfigError(f"{name}={value!r}: the CPU list is empty")
            bind = "list"
        sources["bind"] = f"{name}={value}"
    if picked := _pick(env, NUM_THREADS):
        name, value = picked
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{name}={value!r}: expected a whole number of threads >= 1")
        num_threads = int(value)
        sources["threads"] = f"{name}={value}"
    if picked := _pick(env, ISA):
        variant = picked[1]
        sources["kernel"] = f"{picked[0]}={variant}"
    lm_head = None
    if picked := _pick(env, QUANTIZE_LM_HEAD):
        if picked[1] not in (*LM_HEAD_KINDS, "none"):
            raise ConfigError(f"{picked[0]}={picked[1]!r}: expected one of {', '.join(LM_HEAD_KINDS)} or none")
        lm_head = picked[1]
        sources["lm_head"] = f"{picked[0]}={lm_head}"
    amx = amx_override(env)
    if amx is not None:
        sources["amx"] = "{}={}".format(*_pick(env, AMX))
    not_needed = {f"{k}={env[k]}": why for k, why in NOT_NEEDED.items() if k in env}
    return Overrides(
        kvcache_bytes=kv_bytes,
        bind=bind,
        bind_cpus=bind_cpus or (),
        num_threads=num_threads,
        kernel_variant=variant,
        quantize_lm_head=lm_head,
        amx=amx,
        sources=sources,
        not_needed=not_needed,
    )


_logged = False


def log_not_needed(overrides: Overrides) -> None:
    """Log the reference image's variables once per process: accepted, not needed."""
    global _logged
    if _logged:
        return
    _logged = True
    for setting, why in overrides.not_needed.items():
        log.info("%s is not needed by cpuserve (%s); ignored", setting, why)
