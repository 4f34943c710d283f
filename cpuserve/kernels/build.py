"""Build the native kernels into the package (`python -m cpuserve.kernels.build`), keyed by a hash
of the sources and the torch version, so an unchanged build is skipped in milliseconds. The
library lives next to this file: nothing depends on an absolute path."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
CSRC = HERE / "csrc"
# The torch bindings; everything else under csrc/ is the torch-free core (common code, the generic
# twins, arch/x86 and arch/arm: each arch's files compile to nothing on the other), which
# kernel_check.cpp links too. Every source is hashed, so a new arch file needs no entry here.
BINDINGS = ("qlinear.cpp", "layer_ops.cpp", "decoder_layers.cpp")
CHECK = "kernel_check.cpp"
# What the library is built from, and hashed (kernel_check.cpp is not part of it).
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h") and p.name != CHECK)
CORE = [p for p in SOURCES if p.suffix == ".cpp" and p.name not in BINDINGS]
# torch's extension build names each object after its file: the names must differ across folders.
assert len({p.name for p in CORE}) == len(CORE), "csrc/: two .cpp files share a name"
# No fused multiply-add contraction of scalar code: the twins' float order is part of the contract.
# -fno-trapping-math changes no value (no reassociation, no contraction): it lets GCC turn float
# compares and selects (clamps, NaN cases) into vector blends on AVX2, where it otherwise leaves
# such loops scalar ("control flow in loop"; AVX-512's masks did not need it).
CFLAGS = ["-O3", "-fopenmp", "-Wall", "-ffp-contract=off", "-fno-trapping-math"]
BUILD_DIR = HERE / "_build"
BUILT_FOR = "built_for.json"  # next to each library: the torch version and machine it was built for


def built_for(torch_version: str | None = None, machine: str | None = None) -> dict[str, str]:
    """The torch version and machine a library is for: this one's unless given (a cross build)."""
    import importlib.metadata
    import platform

    return {"torch": torch_version or importlib.metadata.version("torch"), "machine": machine or platform.machine()}


def _key(target: dict[str, str]) -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(str(src.relative_to(CSRC)).encode())
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())  # a flag changes the code: a new library
    h.update(target["torch"].encode())
    h.update(target["machine"].encode())
    return h.hexdigest()[:16]


def library_name(target: dict[str, str] | None = None) -> str:
    """The library's name (and folder) for these sources, torch and machine: this one's unless given."""
    return f"cpuserve_kernels_{_key(target or built_for())}"


def built_library() -> Path | None:
    matches = sorted((BUILD_DIR / library_name()).glob(f"{library_name()}*.so"))
    return matches[0] if matches else None


def build(verbose: bool = False) -> Path:
    existing = built_library()
    if existing is not None:
        return existing
    from torch.utils.cpp_extension import load

    out = BUILD_DIR / library_name()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[setup] compiling native kernels into {out.relative_to(HERE.parent.parent)} (once)", file=sys.stderr)
    load(
        name=library_name(),
        sources=[str(CSRC / name) for name in BINDINGS] + [str(s) for s in CORE],
        build_directory=str(out),
        # torch's own libgomp has the same soname, so the loader reuses it: one OpenMP runtime.
        extra_cflags=CFLAGS,
        extra_ldflags=["-fopenmp"],
        verbose=verbose,
    )
    path = built_library()
    if path is None:
        raise RuntimeError(f"the kernel build produced no library in {out}")
    (out / BUILT_FOR).write_text(json.dumps(built_for()))
    return path


def other_builds() -> list[tuple[Path, dict[str, str]]]:
    """Libraries built for other sources, another torch or another machine (a wheel built elsewhere):
    each with what it says it was built for."""
    found = []
    for lib in sorted(BUILD_DIR.glob("cpuserve_kernels_*/cpuserve_kernels_*.so")):
        if lib.parent.name != library_name():
            meta = lib.parent / BUILT_FOR
            found.append((lib, json.loads(meta.read_text()) if meta.is_file() else {}))
    return found


def compiler() -> str | None:
    """The C++ compiler torch's extension build would use, if there is one."""
    import os
    import shutil

    return shutil.which(os.environ.get("CXX", "c++"))


if __name__ == "__main__":
    print(build(verbose="--verbose" in sys.argv))
