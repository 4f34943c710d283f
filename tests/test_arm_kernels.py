"""The kernel core without torch: natively, and cross-compiled for aarch64 and run under qemu-user on
three CPU models (Armv9 with I8MM, Armv8.2 with dotprod, plain Armv8.0). Each run selects its variant
from the CPU's HWCAPs and checks every variant it can run against the scalar twin on odd shapes
(M 1..17, several N, K 128..4096, groups 32/64/128 and channel-wise); budgets in kernel_check.cpp."""

from __future__ import annotations

import os
import shutil

import pytest

from cpuserve.kernels.cross_check import QEMU_CPUS, build_check, cross_tools, run_check


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


@pytest.mark.parametrize("cpu", list(QEMU_CPUS))
def test_arm_variants_equal_the_scalar_twin_under_qemu(arm_binary, cpu):
    result = run_check(arm_binary, cpu)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    expected = QEMU_CPUS[cpu]
    assert f"selected variant: {expected}\n" in result.stdout
    assert f"ok {expected} (two's-complement int4):" in result.stdout and "[selected]" in result.stdout
    assert "ok generic (offset int4):" in result.stdout and "FAILED" not in result.stdout


def test_the_torch_binding_compiles_for_aarch64(arm_binary):
    """The same qlinear.cpp that `./run setup` builds on an Arm machine, compiled here for aarch64
    against this torch's headers (no object: torch's aarch64 libraries are not on this machine)."""
    from cpuserve.kernels.cross_check import compile_binding_for_aarch64

    result = compile_binding_for_aarch64()
    assert result.returncode == 0, result.stderr[-3000:]
    assert " error" not in result.stderr


def test_native_variants_equal_the_scalar_twin_without_torch(tmp_path):
    result = run_check(build_check(tmp_path, "native"))
    print(result.stdout)
    assert result.returncode == 0 and "[selected]" in result.stdout, result.stdout + result.stderr
