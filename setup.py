"""The wheel carries the native kernels: `pip wheel . --no-build-isolation --no-deps` (torch 2.13.0
installed, as `./run setup` installs it) compiles them for the build machine's architecture
baseline (the per-ISA variants inside are chosen at run time, as always) and ships the library
with the sources it was built from. Editable installs (`./run setup`) and builds without torch
skip this: the kernels are then built by `python -m cpuserve.kernels.build`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py


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
        sys.path.insert(0, str(Path(__file__).parent))
        from cpuserve.kernels.build import BUILT_FOR, build, built_for

        library = build()
        builds = Path(self.build_lib) / "cpuserve" / "kernels" / "_build"
        shutil.rmtree(builds, ignore_errors=True)  # a build/ left by an earlier wheel may hold other libraries
        target = builds / library.parent.name
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, target / library.name)
        (target / BUILT_FOR).write_text(json.dumps(built_for()))
        print(f"[wheel] native kernels packed: {library.name}", file=sys.stderr)


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=BinaryDistribution)
