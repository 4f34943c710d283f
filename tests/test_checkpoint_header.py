"""The safetensors header reader: one parse per file, and as strict as safetensors itself about
what it accepts (every refusal names the file and says why)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cpuserve.errors import CheckpointError
from cpuserve.model.checkpoint import SafetensorsCheckpoint, read_header


def _write(path, header: dict | bytes, data: bytes) -> None:  # type: ignore[no-untyped-def]
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_file_safetensors_wrote_reads_as_safetensors_reads_it(tmp_path):
    tensors = {"b": torch.arange(6, dtype=torch.int8).view(2, 3), "a": torch.randn(4, 5).to(torch.bfloat16)}
    tensors["z"] = torch.zeros(0, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsCheckpoint(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert ckpt.names() == list(f.keys())
        for name in f.keys():  # noqa: SIM118
            assert torch.equal(ckpt.get(name), f.get_tensor(name)) and ckpt.shape(name) == tuple(
                f.get_tensor(name).shape
            )


GOOD = {"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


@pytest.mark.parametrize(
    "header,data,why",
    [
        (
            {
                "x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            16,
            "overlap",
        ),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16, "leave a gap"),
        (GOOD, 20, "cover 16 bytes of data but the file holds 20"),
        ({"x": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, 16, "has shape"),
        ({"x": {"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}}, 16, "has shape"),
        ({"x": {"dtype": "F32", "shape": "22", "data_offsets": [0, 16]}}, 16, "has shape"),
        ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", "16"]}}, 16, "has data_offsets"),
        ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0.0, 16]}}, 16, "has data_offsets"),
        ({"x": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}, 16, r"byte range \[0, 12\) for 16 bytes"),
        (
            {"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}},
            2,
            "dtype F8_E4M3, which cpuserve does not read",
        ),
        (b'["x"]', 0, "not a JSON object"),
        (b"\xff\xfe{}", 0, "codec can't decode"),
    ],
)
def test_malformed_headers_are_refused_naming_the_file(tmp_path, header, data, why):
    path = tmp_path / "model.safetensors"
    _write(path, header, bytes(data))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{why}"):
        read_header(path)


def test_a_header_length_past_the_file_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(CheckpointError, match="the header length is out of range"):
        read_header(path)


def test_written_checkpoints_are_readable_by_others_as_the_umask_allows(tmp_path):
    import os

    import torch

    from cpuserve.model.checkpoint import ShardWriter

    old = os.umask(0o022)
    try:
        writer = ShardWriter(tmp_path)
        writer.add("w", torch.zeros(4))
        writer.finish()
    finally:
        os.umask(old)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644  # safetensors alone makes 0600
