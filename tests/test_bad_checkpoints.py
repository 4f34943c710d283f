"""A broken model directory gives one error that names the file or tensor and what was expected."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from cpuserve.errors import CheckpointError, ConfigError
from cpuserve.model.loader import load_model

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 40,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


def _weights() -> dict[str, torch.Tensor]:
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (40, 32),
        "model.norm.weight": (32,),
        p + "input_layernorm.weight": (32,),
        p + "post_attention_layernorm.weight": (32,),
        p + "self_attn.q_proj.weight": (32, 32),
        p + "self_attn.k_proj.weight": (16, 32),
        p + "self_attn.v_proj.weight": (16, 32),
        p + "self_attn.o_proj.weight": (32, 32),
        p + "mlp.gate_proj.weight": (48, 32),
        p + "mlp.up_proj.weight": (48, 32),
        p + "mlp.down_proj.weight": (32, 48),
    }
    return {name: torch.randn(shape) * 0.1 for name, shape in shapes.items()}


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    return tmp_path


def _edit_config(model_dir, **changes):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def _edit_weights(model_dir, name, tensor=None):
    weights = load_file(str(model_dir / "model.safetensors"))
    if tensor is None:
        del weights[name]
    else:
        weights[name] = tensor
    save_file(weights, str(model_dir / "model.safetensors"))


def test_valid_directory_loads(model_dir):
    assert load_model(model_dir, "float32")(torch.tensor([[1, 2, 3]])).shape == (1, 3, 40)


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json: missing"):
        load_model(model_dir)


def test_unsupported_architecture(model_dir):
    _edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ConfigError, match="architecture 'GPT2LMHeadModel' is not supported"):
        load_model(model_dir)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"hidden_size": None}, "field 'hidden_size' is missing"),
        ({"num_hidden_layers": "two"}, "field 'num_hidden_layers' is 'two', expected int"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method 'gptq' is not supported"),
    ],
)
def test_bad_config_field(model_dir, changes, message):
    _edit_config(model_dir, **changes)
    with pytest.raises(ConfigError, match=message):
        load_model(model_dir)


def test_malformed_config_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_model(model_dir)


def test_wrong_shape_names_tensor_and_expectation(model_dir):
    _edit_weights(model_dir, "model.layers.0.self_attn.k_proj.weight", torch.zeros(32, 32))
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[32, 32\], "
        r"expected \[16, 32\]",
    ):
        load_model(model_dir)


def test_wrong_dtype_names_tensor(model_dir):
    _edit_weights(model_dir, "model.norm.weight", torch.ones(32, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has dtype torch\.int32, expected a floating"):
        load_model(model_dir)


def test_missing_tensor(model_dir):
    _edit_weights(model_dir, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.up_proj\.weight' is missing"):
        load_model(model_dir)


def test_unexpected_tensor(model_dir):
    _edit_weights(model_dir, "model.layers.1.mlp.up_proj.weight", torch.zeros(48, 32))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(model_dir)


def test_truncated_safetensors(model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(model_dir)


def test_pickled_weights_are_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: pickled weights are never loaded"):
        load_model(model_dir)


def test_sharded_index_naming_a_missing_shard(model_dir):
    shutil.move(model_dir / "model.safetensors", model_dir / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "model.embed_tokens.weight": "model-00002-of-00002.safetensors",
        }
    }
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing"):
        load_model(model_dir)


def test_cli_reports_one_line_and_exit_code(model_dir, smol_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, model_dir / name)
    _edit_weights(model_dir, "model.norm.weight", torch.ones(31))
    cmd = [sys.executable, "-m", "cpuserve", "generate", str(model_dir), "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("cpuserve: error: ")
    assert "Traceback" not in proc.stderr
    assert "'model.norm.weight' has shape [31]" in proc.stderr


def test_cli_missing_model_path(tmp_path):
    cmd = [sys.executable, "-m", "cpuserve", "generate", str(tmp_path / "nope"), "--prompt", "hi"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"cpuserve: error: {tmp_path / 'nope'}: no such model directory or .gguf file "
        "(models load from local paths only)"
    )
