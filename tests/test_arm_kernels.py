"""The kernel core without torch: natively, and cross-compiled for aarch64 and run under qemu-user on
three CPU models (Armv9 with I8MM, Armv8.2 with dotprod, plain Armv8.0). Each run selects its variant
from the CPU's HWCAPs and checks it (under Armv9: every Arm variant) against the scalar twin on odd
shapes (M 1..17, several N, K 128..4096, groups 32/64/128 and channel-wise), and its decode and
prefill attention (the NEON blocks, shared by the Arm variants: checked once) and the generic loops
against a double-precision softmax; budgets in kernel_check.cpp. And the whole torch-bound library
cross-built for aarch64."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cpuserve.kernels.cross_check import QEMU_CPUS, build_check, cross_tools, finish_check, run_check, start_check


def _can_install() -> bool:
    return os.geteuid() == 0 and shutil.which("apt-get") is not None


@pytest.fixture(scope="module")
def arm_binary(tmp_path_factory):
    missing = [name for name, path in cross_tools().items() if path is None]
    if missing:
        if _can_install():  # `./run test` installs them on such a machine: their absence is a failure
            pytest.fail(f"{', '.join(missing)} missing; apt-get install g++-aarch64-linux-gnu qemu-user")
        pytest.skip(f"{', '.join(missing)} missing and cannot be installed here")
    return build_check(tmp_path_factory.mktemp("arm"), "aarch64")


@pytest.fixture(scope="module")
def qemu_runs(arm_binary):
    """The three CPU models' checks, started at once: each runs on one thread (about 250 s one
    after the other, about 150 s side by side on two cores)."""
    runs = {cpu: start_check(arm_binary, cpu, None if cpu == "max" else variant) for cpu, variant in QEMU_CPUS.items()}
    yield runs
    for process in runs.values():
        process.kill()
        process.communicate()


@pytest.mark.parametrize("cpu", list(QEMU_CPUS))
def test_arm_variants_equal_the_scalar_twin_under_qemu(qemu_runs, cpu):
    """Under `max` (Armv9) every Arm variant is checked; under the smaller CPU models the variant
    they select, which must also run there (an instruction beyond the model's features traps)."""
    expected = QEMU_CPUS[cpu]
    result = finish_check(qemu_runs[cpu])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"selected variant: {expected}\n" in result.stdout
    assert f"ok {expected} (two's-complement int4):" in result.stdout and "[selected]" in result.stdout
    assert "FAILED" not in result.stdout
    if cpu == "max":
        assert all(f"ok {v} (" in result.stdout for v in (*QEMU_CPUS.values(), "generic")), result.stdout


def test_the_torch_binding_cross_compiles_and_links_for_aarch64(tmp_path_factory):
    """The whole kernel library (the torch bindings included) compiled with the aarch64 compiler
    against PyPI's aarch64 torch wheel's headers and linked as a shared library with its libraries,
    as the arm64 wheel and image carry it (the image test then reuses this build). Symbols are
    resolved when it loads (the arm64 image test's doctor loads it under qemu)."""
    if shutil.which("aarch64-linux-gnu-g++") is None:
        if _can_install():
            pytest.fail("aarch64-linux-gnu-g++ missing; apt-get install g++-aarch64-linux-gnu")
        pytest.skip("aarch64-linux-gnu-g++ missing and cannot be installed here")
    from cpuserve.kernels.build import BUILT_FOR, library_name
    from cpuserve.kernels.cross_build import AARCH64_TORCH, cross_build, download_aarch64_torch

    library = cross_build(download_aarch64_torch(tmp_path_factory.mktemp("torch-aarch64")))
    target = {"torch": AARCH64_TORCH, "machine": "aarch64"}
    assert library.name == f"{library_name(target)}.so"
    header = library.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    assert json.loads((library.parent / BUILT_FOR).read_text()) == target


def test_native_variants_equal_the_scalar_twin_without_torch(tmp_path):
    result = run_check(build_check(tmp_path, "native"))
    print(result.stdout)
    assert result.returncode == 0 and "[selected]" in result.stdout, result.stdout + result.stderr
