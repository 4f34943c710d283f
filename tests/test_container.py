"""The container image: built with podman from a debootstrapped Debian base (no registry is reachable
here), run with no arguments it serves the bundled model as a non-root user, answers a chat, passes
its health check and exits 0 on SIGTERM. Needs root and Debian's podman (installed by
container/build.sh); skipped, saying why, where those cannot be had."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("apt-get") is None, reason="needs root and apt-get for podman")
def test_the_image_builds_serves_and_drains(tmp_path):
    env = {**os.environ, "CPUSERVE_PODMAN_DIR": str(tmp_path / "podman")}
    tag = "localhost/cpuserve:test"
    build = subprocess.run([str(ROOT / "container" / "build.sh"), tag], env=env, capture_output=True, text=True)
    if build.returncode == 3:
        pytest.skip(f"podman cannot run here: {build.stderr.strip().splitlines()[-1]}")
    assert build.returncode == 0, build.stderr[-2000:]
    smoke = subprocess.run([str(ROOT / "container" / "smoke.sh"), tag], env=env, capture_output=True, text=True)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert "SIGTERM -> exit 0" in smoke.stderr and "Paris" in smoke.stderr
