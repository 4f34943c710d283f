"""Build the native kernels for another architecture (aarch64, on an x86-64 machine) against that
architecture's torch wheel, with Debian's cross compiler: how the arm64 wheel and image get their
kernels. Compiling under emulation instead would take the better part of an hour per build.

    python -m cpuserve.kernels.cross_build [TORCH_WHEEL]   (default: PyPI's aarch64 torch, downloaded)

The library lands in _build/ under the name an aarch64 machine with that torch computes
(build.library_name), with its built_for.json, exactly as a native build would leave it. The
sources, flags and libraries are those torch's extension build uses natively (build.py); the
Python headers are this interpreter's (CPython 3.11's ABI is the same on both 64-bit Linuxes)."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cpuserve.kernels.build import BINDINGS, BUILD_DIR, BUILT_FOR, CFLAGS, CORE, CSRC, built_for, library_name

COMPILERS = {"aarch64": "aarch64-linux-gnu-g++"}
# pyproject.toml's torch pin on aarch64: PyPI's later aarch64 torch wheels are CUDA builds.
AARCH64_TORCH = "2.10.0"
# What the binding links, as torch's extension build links it (build.ninja's ldflags).
TORCH_LIBS = ("c10", "torch_cpu", "torch", "torch_python")


def wheel_target(torch_wheel: Path) -> dict[str, str]:
    """The torch version and machine a torch wheel is for, from its file name
    (torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl)."""
    m = re.fullmatch(r"torch-([^-]+)-cp\d+-cp\d+-\w*?(aarch64|x86_64)\.whl", torch_wheel.name)
    if m is None:
        raise ValueError(f"{torch_wheel.name}: not a Linux torch wheel for aarch64 or x86_64")
    return {"torch": m.group(1).split("+")[0], "machine": m.group(2)}


def download_aarch64_torch(into: Path) -> Path:
    """PyPI's aarch64 CPU torch wheel (AARCH64_TORCH) for CPython 3.11, into a folder (pip's cache
    makes a second download a copy)."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd += ["--platform", "manylinux_2_28_aarch64", "--python-version", "3.11", "-d", str(into)]
    done = subprocess.run([*cmd, f"torch=={AARCH64_TORCH}"], capture_output=True, text=True)
    wheels = sorted(into.glob(f"torch-{AARCH64_TORCH}-*aarch64.whl"))
    if done.returncode != 0 or not wheels:
        raise RuntimeError(f"pip could not download torch {AARCH64_TORCH} for aarch64:\n{done.stderr[-2000:]}")
    return wheels[0]


def _unpack_torch(torch_wheel: Path, into: Path) -> Path:
    """torch/include and the libraries the binding links, out of the wheel."""
    wanted = tuple(f"torch/lib/lib{name}.so" for name in TORCH_LIBS)
    with zipfile.ZipFile(torch_wheel) as whl:
        for member in whl.namelist():
            if member.startswith("torch/include/") or member in wanted:
                whl.extract(member, into)
    missing = [w for w in wanted if not (into / w).is_file()]
    if missing:
        raise ValueError(f"{torch_wheel.name} has no {', '.join(missing)}")
    return into / "torch"


def cross_build(torch_wheel: Path, jobs: int = 2) -> Path:
    """Compile and link the kernel library for the wheel's machine; returns the library's path."""
    target = wheel_target(torch_wheel)
    compiler = shutil.which(COMPILERS.get(target["machine"], ""))
    if compiler is None:
        raise RuntimeError(f"no cross compiler for {target['machine']} ({COMPILERS.get(target['machine'])})")
    name = library_name(target)
    out = BUILD_DIR / name
    out.mkdir(parents=True, exist_ok=True)
    # Two builds of one library at once (the test suite's two lanes, two image builds) compile it
    # once: the second waits here and finds it done.
    with open(out / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[cross] waiting for another build of {name} to finish", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        return _cross_build_locked(torch_wheel, target, compiler, jobs)


def _cross_build_locked(torch_wheel: Path, target: dict[str, str], compiler: str, jobs: int) -> Path:
    name = library_name(target)
    out = BUILD_DIR / name
    library = out / f"{name}.so"
    if library.is_file() and (out / BUILT_FOR).is_file():  # renamed into place only when complete
        return library
    machine = target["machine"]
    print(f"[cross] compiling native kernels for {machine}, torch {target['torch']} into {out}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="cpuserve-cross-") as tmp:
        torch_dir = _unpack_torch(torch_wheel, Path(tmp))
        includes = [torch_dir / "include", torch_dir / "include/torch/csrc/api/include"]
        includes.append(Path(sysconfig.get_paths()["include"]))
        cflags = [
            f"-DTORCH_EXTENSION_NAME={name}",
            "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-isystem{p}" for p in includes),
            "-fPIC",
            "-std=c++20",
            *CFLAGS,
        ]
        sources = [CSRC / n for n in BINDINGS] + CORE
        objects = [Path(tmp) / f"{src.stem}.o" for src in sources]

        def compile_one(pair: tuple[Path, Path]) -> None:
            src, obj = pair
            done = subprocess.run([compiler, *cflags, "-c", str(src), "-o", str(obj)], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{src.relative_to(CSRC)} did not compile for {machine}:\n{done.stderr[-3000:]}")

        with ThreadPoolExecutor(jobs) as pool:
            list(pool.map(compile_one, zip(sources, objects, strict=True)))
        link = [compiler, *map(str, objects), "-shared", "-fopenmp", f"-L{torch_dir / 'lib'}"]
        partial = out / f".{library.name}.partial"
        link += [f"-l{lib}" for lib in TORCH_LIBS] + ["-o", str(partial)]
        done = subprocess.run(link, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the {machine} kernel library did not link:\n{done.stderr[-3000:]}")
        (out / BUILT_FOR).write_text(json.dumps(built_for(target["torch"], target["machine"])))
        partial.rename(library)
    return library


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("torch_wheel", type=Path, nargs="?", help="the target's torch wheel (default: downloaded)")
    wheel = parser.parse_args().torch_wheel
    if wheel is None:
        with tempfile.TemporaryDirectory(prefix="cpuserve-torch-") as tmp:
            print(cross_build(download_aarch64_torch(Path(tmp))))
    else:
        print(cross_build(wheel))
