"""What this process may use: allowed CPUs, cgroup CPU quota, and memory (cgroup limits included)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from cpuserve.platform.sysfs import SystemFiles, parse_cpulist

_UNLIMITED = 1 << 60  # cgroup v1 spells "no limit" as a huge number


@dataclass(frozen=True)
class Resources:
    allowed_cpus: tuple[int, ...]
    cpu_quota: float | None  # CPUs' worth of time per period, None when unlimited
    cgroup_version: int | None
    mem_total: int  # bytes: the machine's memory, or the cgroup limit when lower
    mem_available: int  # bytes this process can still take without swapping or being killed
    mem_limit: int | None  # the cgroup memory limit, None when unlimited

    @property
    def cpu_quota_threads(self) -> int | None:
        return None if self.cpu_quota is None else max(1, math.floor(self.cpu_quota + 1e-9))


def _meminfo(files: SystemFiles) -> dict[str, int]:
    values = {}
    for line in (files.read("proc/meminfo") or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def _cgroup_paths(files: SystemFiles) -> tuple[str | None, dict[str, str]]:
    """The process's cgroup v2 path and its v1 paths per controller, from /proc/self/cgroup."""
    v2, v1 = None, {}
    for line in (files.read("proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        for controller in parts[1].split(","):
            if controller:
                v1[controller] = parts[2]
    return v2, v1


def _first_existing(files: SystemFiles, candidates: list[str]) -> str | None:
    for rel in candidates:
        if files.read(rel) is not None:
            return rel
    return None


def _cgroup_dirs(base: str, path: str | None) -> list[str]:
    # Inside a container the recorded path may not exist under the mount: fall back to its root.
    dirs = [f"{base}/{path.strip('/')}".rstrip("/")] if path and path != "/" else []
    return [*dirs, base]


def _read_limits(files: SystemFiles) -> tuple[int | None, float | None, int | None, int | None]:
    """(cgroup version, cpu quota, memory limit, memory in use excluding reclaimable cache)."""
    v2_path, v1_paths = _cgroup_paths(files)
    if files.read("sys/fs/cgroup/cgroup.controllers") is not None:
        dirs = _cgroup_dirs("sys/fs/cgroup", v2_path)
        quota = None
        cpu_max = _first_existing(files, [f"{d}/cpu.max" for d in dirs])
        if cpu_max:
            fields = (files.read(cpu_max) or "").split()
            if len(fields) == 2 and fields[0] != "max":
                quota = int(fields[0]) / int(fields[1])
        limit, used = None, None
        mem_max = _first_existing(files, [f"{d}/memory.max" for d in dirs])
        if mem_max:
            text = (files.read(mem_max) or "").strip()
            limit = int(text) if text.isdigit() else None
            base = mem_max.rsplit("/", 1)[0]
            used = _used(files, f"{base}/memory.current", f"{base}/memory.stat", "inactive_file")
        return 2, quota, limit, used
    quota = None
    cpu_dir = _first_existing(
        files, [f"{d}/cpu.cfs_quota_us" for d in _cgroup_dirs("sys/fs/cgroup/cpu", v1_paths.get("cpu"))]
    )
    if cpu_dir:
        q = files.read_int(cpu_dir)
        period = files.read_int(cpu_dir.replace("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if q and q > 0 and period:
            quota = q / period
    limit, used = None, None
    mem = _first_existing(
        files,
        [f"{d}/memory.limit_in_bytes" for d in _cgroup_dirs("sys/fs/cgroup/memory", v1_paths.get("memory"))],
    )
    if mem:
        value = files.read_int(mem)
        limit = value if value is not None and value < _UNLIMITED else None
        base = mem.rsplit("/", 1)[0]
        used = _used(files, f"{base}/memory.usage_in_bytes", f"{base}/memory.stat", "total_inactive_file")
    version = 1 if v1_paths else None
    return version, quota, limit, used


def _used(files: SystemFiles, current: str, stat: str, reclaimable_key: str) -> int | None:
    value = files.read_int(current)
    if value is None:
        return None
    for line in (files.read(stat) or "").splitlines():
        key, _, num = line.partition(" ")
        if key == reclaimable_key and num.strip().isdigit():
            return max(0, value - int(num))
    return value


def _allowed_cpus(files: SystemFiles, online: list[int]) -> list[int]:
    if files.live:
        allowed = sorted(os.sched_getaffinity(0))
    else:
        allowed = None
        for line in (files.read("proc/self/status") or "").splitlines():
            if line.startswith("Cpus_allowed_list:"):
                allowed = parse_cpulist(line.split(":", 1)[1])
        if allowed is None:
            allowed = online
    v2_path, _ = _cgroup_paths(files)
    cpuset = _first_existing(files, [f"{d}/cpuset.cpus.effective" for d in _cgroup_dirs("sys/fs/cgroup", v2_path)])
    if cpuset:
        effective = files.read_cpulist(cpuset)
        if effective:
            allowed = [c for c in allowed if c in effective]
    return [c for c in allowed if c in online] or online


def detect_resources(files: SystemFiles, online: list[int]) -> Resources:
    info = _meminfo(files)
    total = info.get("MemTotal", 0)
    available = info.get("MemAvailable", info.get("MemFree", 0))
    version, quota, limit, used = _read_limits(files)
    if limit is not None:
        total = min(total, limit) if total else limit
        if used is not None:
            available = min(available, max(0, limit - used))
    return Resources(
        allowed_cpus=tuple(_allowed_cpus(files, online)),
        cpu_quota=quota,
        cgroup_version=version,
        mem_total=total,
        mem_available=available,
        mem_limit=limit,
    )
