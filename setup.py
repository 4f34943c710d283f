"""The wheel carries the native kernels: `pip wheel . --no-build-isolation --no-deps` (torch 2.13.0
installed, as `./run setup` installs it) compiles them for the build machine's architecture
baseline (the per-ISA variants inside are chosen at run time, as always) and ships the library
with the sources it was built from. Editable installs (`./run setup`) and builds without torch
skip this: the kernels are then built by `python -m cpuserve.kernels.build`.

CPUSERVE_WHEEL_TORCH=/path/to/torch-X-cp311-cp311-manylinux_2_28_aarch64.whl makes the wheel for
that torch wheel's machine instead (kernels cross-compiled, cpuserve/kernels/cross_build.py; the
wheel tagged linux_aarch64): how the arm64 image is built on an x86-64 machine."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

sys.path.insert(0, str(Path(__file__).parent))  # cpuserve's kernel build, from this checkout
CROSS_TORCH = os.environ.get("CPUSERVE_WHEEL_TORCH")


class BinaryDistribution(Distribution):
    """A wheel for this platform and Python (it carries a compiled library), not `py3-none-any`."""

    def has_ext_modules(self) -> bool:
        return True


class BuildPyWithKernels(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        try:
            import torch  # noqa: F401
        except ImportError:
            print("[wheel] torch is not importable here: the wheel carries no compiled kernels", file=sys.stderr)
            return
        if CROSS_TORCH:
            from cpuserve.kernels.cross_build import cross_build

            library = cross_build(Path(CROSS_TORCH))
        else:
            from cpuserve.kernels.build import build

            library = build()
        builds = Path(self.build_lib) / "cpuserve" / "kernels" / "_build"
        shutil.rmtree(builds, ignore_errors=True)  # a build/ left by an earlier wheel may hold other libraries
        target = builds / library.parent.name
        target.mkdir(parents=True, exist_ok=True)
        for part in library.parent.iterdir():  # the library and its built_for.json
            if part.suffix in (".so", ".json"):
                shutil.copy2(part, target / part.name)
        print(f"[wheel] native kernels packed: {library.name}", file=sys.stderr)


class WheelForTarget(bdist_wheel):
    """With CPUSERVE_WHEEL_TORCH, the wheel is tagged for that torch wheel's machine."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if CROSS_TORCH:
            from cpuserve.kernels.cross_build import wheel_target

            plat = f"linux_{wheel_target(Path(CROSS_TORCH))['machine']}"
        return python, abi, plat


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": WheelForTarget}, distclass=BinaryDistribution)
