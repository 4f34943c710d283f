"""Build the stand-alone kernel check (csrc/kernel_check.cpp, no torch) natively or cross-compiled
for aarch64, and run it: natively, or under qemu-user with a chosen CPU model. This is how the Arm
kernels are proven on a machine without Arm hardware (`python -m cpuserve.kernels.cross_check`).

The qemu CPU models used and what the kernel selects on each:
  max          Armv9 with SVE2 and I8MM   -> neon_i8mm
  neoverse-n1  Armv8.2 with dotprod       -> neon_dotprod
  cortex-a53   Armv8.0                    -> neon
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cpuserve.kernels.build import CHECK, CORE, CSRC

QEMU_CPUS = {"max": "neon_i8mm", "neoverse-n1": "neon_dotprod", "cortex-a53": "neon"}
# GCC 12's AVX-512 headers trip -Wuninitialized on their own placeholders; nothing of ours.
FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-Wall", "-Wno-uninitialized", "-Wno-maybe-uninitialized"]


def cross_tools() -> dict[str, str | None]:
    return {name: shutil.which(name) for name in ("aarch64-linux-gnu-g++", "qemu-aarch64")}


def build_check(out_dir: Path, target: str = "native") -> Path:
    """Compile kernel_check.cpp with the torch-free core (the driver, the variant table, both arches'
    files) for `native` or `aarch64` (static, so qemu needs no sysroot). The sources compile one per
    allowed CPU at a time, then link (the native check, built and run, took 41 s in CI with one g++
    over all sources, 28-31 s so on 2 cores)."""
    if target not in ("native", "aarch64"):
        raise ValueError(f"target {target!r}: native or aarch64")
    compiler = "g++" if target == "native" else "aarch64-linux-gnu-g++"
    objects_dir = out_dir / f"objects-{target}"
    objects_dir.mkdir(parents=True, exist_ok=True)
    sources = [CSRC / CHECK, *CORE]
    objects = [objects_dir / f"{s.stem}.o" for s in sources]  # names unique: build.py asserts it for CORE

    def compile_one(pair: tuple[Path, Path]) -> None:
        source, obj = pair
        _run([compiler, *FLAGS, "-c", "-o", str(obj), str(source)], source.name)

    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        list(pool.map(compile_one, zip(sources, objects, strict=True)))
    binary = out_dir / f"kernel_check-{target}"
    static = ["-static"] if target == "aarch64" else []
    _run([compiler, *static, "-o", str(binary), *map(str, objects)], f"linking {binary.name}")
    return binary


def _run(cmd: list[str], what: str) -> None:
    """A compiler step; its error output goes into the exception a failing test shows."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed on {what}:\n{done.stderr[-4000:]}")


def start_check(binary: Path, qemu_cpu: str | None = None, variant: str | None = None) -> subprocess.Popen:
    """Start the check (under qemu with `qemu_cpu`, on one `variant` or all that run): it runs on one
    thread, so the tests start their qemu runs at once and each waits for its own."""
    cmd = (["qemu-aarch64", "-cpu", qemu_cpu] if qemu_cpu else []) + [str(binary)] + ([variant] if variant else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_check(process: subprocess.Popen, timeout: float = 900) -> subprocess.CompletedProcess:
    """Wait for a started check (killed and reaped if it runs past `timeout`)."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_check(binary: Path, qemu_cpu: str | None = None, variant: str | None = None) -> subprocess.CompletedProcess:
    return finish_check(start_check(binary, qemu_cpu, variant), timeout=600)


def main() -> int:
    import tempfile

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("native", None)]
        if all(cross_tools().values()):
            runs += [("aarch64", cpu) for cpu in QEMU_CPUS]
        else:
            print("no aarch64-linux-gnu-g++ / qemu-aarch64: Debian packages g++-aarch64-linux-gnu qemu-user")
        binaries: dict[str, Path] = {}
        for target, cpu in runs:
            binaries.setdefault(target, build_check(Path(tmp), target))
            result = run_check(binaries[target], cpu)
            print(f"== {target}{f' under qemu -cpu {cpu}' if cpu else ''}\n{result.stdout}", end="")
            ok &= result.returncode == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
