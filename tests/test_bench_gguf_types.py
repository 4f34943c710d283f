"""`cpuserve bench gguf-types`'s report parts that need no llama.cpp: a file's matrix tensors by
type (read with cpuserve's own header reader), and the refusals of types and files it cannot use.
The comparison itself runs llama.cpp (benchmarks/run's peer), so it is a benchmark, not a test."""

from __future__ import annotations

from cpuserve.bench.gguf_types import tensor_types
from cpuserve.cli import main
from tests.gguf_fixtures import write_tiny_llama


def test_matrix_tensors_are_counted_by_type_most_first(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    # two layers of q F32, k F16, v Q8_0, o Q4_0, gate Q4_1, up BF16, down Q4_0; the embedding in Q8_0
    # and the head in Q4_1; the norms (one dimension) are not matrices. Equal counts: first seen first.
    assert tensor_types(path) == "Q4_0 4, Q8_0 3, Q4_1 3, F32 2, F16 2, BF16 2"


def test_unknown_types_and_missing_files_are_refused(tmp_path, capsys):
    assert main(["bench", "gguf-types", "--llamacpp-python", "python3", "--types", "Q4_0,Q3_K"]) == 1
    assert "--types Q3_K: expected some of Q4_0,Q4_1,Q8_0,Q4_K_M,Q5_K_M,Q6_K" in capsys.readouterr().err
    missing = tmp_path / "none.gguf"
    assert main(["bench", "gguf-types", "--llamacpp-python", "python3", "--file", f"x={missing}"]) == 1
    assert "expected LABEL=FILE.gguf, an existing file" in capsys.readouterr().err
