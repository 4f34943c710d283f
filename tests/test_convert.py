"""`cpuserve convert`: GGUF tensors, config and tokenizer land in an HF directory exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cpuserve.errors import CheckpointError
from cpuserve.model import checkpoint
from cpuserve.model.loader import load_model
from cpuserve.offline.gguf_convert import convert_gguf, hf_name
from cpuserve.tokenizer import GenerationDefaults, Tokenizer
from tests.gguf_fixtures import HEADS, KV_HEADS, LAYER_TYPES, llama_permute, slow_dequantize, write_tiny_llama


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_llama(path)
    return path, weights


def test_every_tensor_type_dequantizes_exactly(tiny_gguf, tmp_path):
    path, original = tiny_gguf
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    converted = load_file(str(out / "model.safetensors"))
    reader = gguf.GGUFReader(str(path))
    seen_types = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))
        expected = slow_dequantize(t.data, t.tensor_type, shape)
        heads = HEADS if t.name.endswith("attn_q.weight") else KV_HEADS if t.name.endswith("attn_k.weight") else 0
        if heads:  # put rows back where HF keeps them: gguf row i holds HF row perm[i]
            perm = llama_permute(np.arange(shape[0])[:, None], heads).ravel()
            unpermuted = np.empty_like(expected)
            unpermuted[perm] = expected
            expected = unpermuted
        want = torch.from_numpy(np.array(expected)).to(torch.bfloat16)
        assert converted[name].dtype == torch.bfloat16
        assert torch.equal(converted[name], want), f"{t.name} ({t.tensor_type.name})"
        # And it is the weight the file was made from, within that type's rounding.
        tol = {"F32": 0.0, "F16": 1e-3, "BF16": 4e-3, "Q8_0": 4e-3}.get(t.tensor_type.name, 0.06)
        err = (converted[name].float() - torch.from_numpy(original[name])).abs().max().item()
        assert err <= tol + 4e-3, f"{t.name}: {err}"
        seen_types.add(t.tensor_type)
    assert set(LAYER_TYPES.values()) <= seen_types


def test_config_tokenizer_and_generation_config(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (64, 4, 2)
    assert cfg["rope_parameters"]["rope_theta"] == 50000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is False
    tok = Tokenizer(out)
    assert [tok.id_to_token(i) for i in tok.encode(" the in", add_special_tokens=False)] == ["Ġthe", "Ġ", "in"]
    assert tok.encode("<|im_start|>hi", add_special_tokens=False)[0] == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"
    assert GenerationDefaults.load(out).eos_token_ids == (2,)
    model = load_model(out, "float32")
    assert model(torch.tensor([[3, 4, 5]])).shape == (1, 3, cfg["vocab_size"])


def test_tied_gguf_gives_tied_config(tmp_path):
    path = tmp_path / "tied.gguf"
    write_tiny_llama(path, tied=True)
    out = convert_gguf(path, tmp_path / "hf", progress=False)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(str(out / "model.safetensors"))
    model = load_model(out, "float32", pack_float=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    packed = load_model(out, "float32")  # the head's own float panels, of the embedding's values
    x = torch.randn(3, 64)
    assert torch.allclose(packed.lm_head(x), x @ packed.model.embed_tokens.weight.T, rtol=1e-5, atol=1e-5)


def test_converted_smollm2_matches_transformers_reading_the_gguf(our_smol):
    """transformers dequantizes the GGUF itself (fp32) and un-permutes q/k itself: an independent
    check of the whole conversion. Our weights went through bf16, hence the wider budget."""
    transformers = pytest.importorskip("transformers")
    from cpuserve.model.resolve import bundled_gguf

    path = bundled_gguf()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.tensor([[504, 3575, 282, 4649, 314, 253, 2634, 282, 16462, 30]])
    with torch.inference_mode():
        expected = ref(ids).logits[0]
    got = our_smol(ids)[0]
    err = (got - expected).abs().max().item()
    assert err < 0.35, f"max |logit diff| {err:.3f}"  # logits span about +-30
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


# ---- bad input ---------------------------------------------------------------------------------


def test_truncated_gguf_is_one_clear_error(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    for size in (len(data) - 100, len(data) // 2, 40):
        cut.write_bytes(data[:size])
        with pytest.raises(CheckpointError, match=r"cut\.gguf.*(truncated|not a readable GGUF)"):
            convert_gguf(cut, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()


def test_interrupted_convert_leaves_nothing_that_looks_complete(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_existing_output_needs_force(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    (tmp_path / "out").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_gguf(path, tmp_path / "out", progress=False)
    convert_gguf(path, tmp_path / "out", force=True, progress=False)
    assert (tmp_path / "out" / "config.json").is_file()


def test_non_llama_gguf_is_refused(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"general\.architecture 'gpt2' is not supported"):
        convert_gguf(path, tmp_path / "out", progress=False)


def test_cli_convert_error_is_one_line_without_traceback(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:1000])
    cmd = [sys.executable, "-m", "cpuserve", "convert", str(cut), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cpuserve: error: ") and "cut.gguf" in lines[0]
    debug = subprocess.run(
        [sys.executable, "-m", "cpuserve", "--debug", *cmd[3:]], capture_output=True, text=True, timeout=120
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr
