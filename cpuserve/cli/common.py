"""What several sub-commands share: the model arguments, and the thread plan made before torch loads."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("cpuserve")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where converted models are kept (default: $CPUSERVE_CACHE_DIR or ~/.cache/cpuserve)",
    )
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (default: auto)")


def platform_plan(args: argparse.Namespace):
    """Detect the machine, read overrides, size and pin the thread pool; log what was chosen."""
    import os

    from cpuserve.platform.machine import apply_thread_plan, detect_machine
    from cpuserve.platform.overrides import log_not_needed, read_overrides
    from cpuserve.platform.plan import plan_kernel, plan_threads
    from cpuserve.platform.sysfs import format_cpulist

    machine = detect_machine()
    overrides = read_overrides(os.environ)
    log_not_needed(overrides)
    threads = plan_threads(machine.cpu, machine.resources, overrides)
    kernel = plan_kernel(machine.cpu, overrides)
    apply_thread_plan(threads)
    where = f"pinned to {format_cpulist(threads.cpus)}" if threads.pinned else "not pinned"
    log.info(
        "%s, %s; %d threads %s (%s); kernel variant %s",
        machine.cpu.model_name,
        machine.cpu.arch,
        threads.count,
        where,
        threads.reason,
        kernel.variant,
    )
    if kernel.variant == "avx512_vnni":
        from cpuserve.kernels import amx_note

        log.info("%s", amx_note())
    return machine, overrides, threads
