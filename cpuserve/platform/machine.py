"""The machine as detected, and applying a thread plan to this process."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from cpuserve.platform.cpu import CpuInfo, detect_cpu
from cpuserve.platform.plan import ThreadPlan
from cpuserve.platform.resources import Resources, detect_resources
from cpuserve.platform.sysfs import SystemFiles, format_cpulist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Machine:
    cpu: CpuInfo
    resources: Resources


def detect_machine(root: Path = Path("/")) -> Machine:
    files = SystemFiles(root)
    cpu = detect_cpu(files)
    return Machine(cpu=cpu, resources=detect_resources(files, cpu.ids))


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Size and pin torch's OpenMP pool. Pinning per thread needs GOMP_CPU_AFFINITY before the
    OpenMP runtime loads (before `import torch`); the process mask is set either way."""
    if "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(plan.count)
        if plan.pinned:
            os.environ["GOMP_CPU_AFFINITY"] = " ".join(str(c) for c in plan.cpus)
    elif plan.pinned:
        log.debug("torch already imported: threads share the CPU mask instead of one CPU each")
    if plan.pinned:
        try:
            os.sched_setaffinity(0, plan.cpus)
        except OSError as exc:
            log.warning("could not pin to CPUs %s: %s", format_cpulist(plan.cpus), exc)
    import torch

    torch.set_num_threads(plan.count)
