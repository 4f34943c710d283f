"""The container images: built with podman from a debootstrapped Debian base (no registry is reachable
here). The amd64 image, run with no arguments, serves the bundled model as a non-root user, answers
a chat, passes its health check and exits 0 on SIGTERM. The arm64 image is built under qemu-user
(binfmt) with cross-compiled kernels, and its doctor, run under qemu with two CPU models, picks
the kernel variant each CPU supports. Needs root and Debian's podman (installed by
container/build.sh); skipped, saying why, where those cannot be had."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NO_PODMAN = os.geteuid() != 0 or shutil.which("apt-get") is None
pytestmark = [pytest.mark.slow, pytest.mark.skipif(NO_PODMAN, reason="needs root and apt-get for podman")]


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One podman store for both images (build.sh writes its settings there)."""
    return {**os.environ, "CPUSERVE_PODMAN_DIR": str(tmp_path_factory.mktemp("podman"))}


def _build(env: dict[str, str], tag: str, *arch: str) -> str:
    build = subprocess.run([str(ROOT / "container" / "build.sh"), tag, *arch], env=env, capture_output=True, text=True)
    if build.returncode == 3:
        pytest.skip(f"podman cannot run here: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr[-2000:]
    print(build.stderr.strip().splitlines()[-1])  # the timings
    return build.stderr


def test_the_image_builds_serves_and_drains(podman_env):
    tag = "localhost/cpuserve:test"
    _build(podman_env, tag)
    smoke = subprocess.run([str(ROOT / "container" / "smoke.sh"), tag], env=podman_env, capture_output=True, text=True)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert "SIGTERM -> exit 0" in smoke.stderr and "Paris" in smoke.stderr


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the arm64 image is built under emulation on x86-64")
def test_the_arm64_image_builds_under_qemu_and_picks_each_cpus_kernels(podman_env):
    tag = "localhost/cpuserve:test-arm64"
    _build(podman_env, tag, "arm64")
    w = podman_env["CPUSERVE_PODMAN_DIR"]
    podman = ["podman", "run", "--rm", "--arch", "arm64"]
    env = {**podman_env, "CONTAINERS_CONF": f"{w}/containers.conf", "CONTAINERS_STORAGE_CONF": f"{w}/storage.conf"}
    # qemu-user reads QEMU_CPU: the emulated CPU model, whose HWCAPs the platform layer and kernels see
    # (torch 2.10's aarch64 wheel itself needs Armv8.2: an Armv8.0 model such as cortex-a53 dies in it)
    for qemu_cpu, variant in (("max", "neon_i8mm"), ("neoverse-n1", "neon_dotprod")):
        doctor = subprocess.run(
            [*podman, "-e", f"QEMU_CPU={qemu_cpu}", tag, "cpuserve", "doctor", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert doctor.returncode == 0, doctor.stderr[-2000:]
        report = json.loads(doctor.stdout)
        assert report["machine"]["arch"] == "aarch64"
        assert report["decisions"]["kernel"]["variant"] == variant, (qemu_cpu, report["decisions"]["kernel"])
        # the wheel's cross-compiled library loaded (nothing was compiled in the image): the linears on it
        linear = next(v for k, v in report["model"]["kernels"].items() if k.startswith("linear"))
        assert f"native {variant}" in linear, linear
