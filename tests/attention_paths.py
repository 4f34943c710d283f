"""The attention paths the attention tests run on, selected as a start-up would (CPUSERVE_ISA)."""

from __future__ import annotations

import pytest

# "host": this CPU's own variant (AVX-512's blocks where it has AVX-512); "avx2": AVX2's blocks
# (CPUSERVE_ISA=avx2); "portable": the template loops (CPUSERVE_ISA=generic).
ATTENTION_PATHS = ["host", "avx2", "portable"]


def select_attention_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    from cpuserve.kernels import runnable_variants

    if path == "avx2" and "avx2" not in runnable_variants():
        pytest.skip("this CPU lacks AVX2")
    if path != "host":
        monkeypatch.setenv("CPUSERVE_ISA", "generic" if path == "portable" else path)
