"""The kernel core without torch: natively, and cross-compiled for aarch64 and run under qemu-user on
three CPU models (Armv9 with I8MM, Armv8.2 with dotprod, plain Armv8.0). Each run selects its variant
from the CPU's HWCAPs and checks it (under Armv9 also the portable loops) against the scalar twin on odd
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


# Each Arm variant under the smallest CPU model that has its features (an instruction beyond them
# traps), and the portable loops (generic; aarch64's plain char is unsigned) under Armv9. Under `max`
# the neon and neon_dotprod rows would run the same instructions again (they did until session 30:
# the `max` run was 200 s of the 287 this file took in a fresh clone).
QEMU_RUNS = [("max", "neon_i8mm"), ("max", "generic"), ("neoverse-n1", "neon_dotprod"), ("cortex-a53", "neon")]


@pytest.fixture(scope="module")
def qemu_runs(arm_binary):
    """Every run started at once: each is one thread, and they share the cores."""
    runs = {run: start_check(arm_binary, *run) for run in QEMU_RUNS}
    yield runs
    for process in runs.values():
        process.kill()
        process.communicate()


def test_every_arm_variant_has_a_qemu_run():
    assert {variant for _, variant in QEMU_RUNS} == {*QEMU_CPUS.values(), "generic"}
    assert {cpu for cpu, _ in QEMU_RUNS} == set(QEMU_CPUS)


@pytest.mark.parametrize("cpu,variant", QEMU_RUNS)
def test_arm_variants_equal_the_scalar_twin_under_qemu(qemu_runs, cpu, variant):
    """Each CPU model selects its variant from its HWCAPs; the variant named is checked there."""
    result = finish_check(qemu_runs[(cpu, variant)])
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"selected variant: {QEMU_CPUS[cpu]}\n" in result.stdout
    assert "FAILED" not in result.stdout
    if variant == "generic":
        assert "ok generic (" in result.stdout, result.stdout
    else:  # the Arm rows hold int4 as two's complement; the one the CPU selects is marked
        assert f"ok {variant} (two's-complement int4):" in result.stdout
        assert ("[selected]" in result.stdout) == (variant == QEMU_CPUS[cpu])


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
