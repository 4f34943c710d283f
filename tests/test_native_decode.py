"""The native decode step (all layers in one call) against the Python layer loop running the same
native ops: bit-identical logits in bf16 and fp32, float and quantized weights, on the contiguous
cache and through the engine's paged cache, float or int8 (where steps mixing prefill and decode
stay in Python); layers whose q/k/v and gate/up cannot fuse (a GGUF's types differ within a layer,
as Q4_K_M's attn_v on some layers) run natively too, each linear apart."""

from __future__ import annotations

import pytest
import torch

from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.model import native_decode
from cpuserve.model.loader import load_model
from cpuserve.model.resolve import resolve_model
from cpuserve.offline.quantize import quantize_checkpoint
from cpuserve.tokenizer import GenerationDefaults, Tokenizer
from tests.gguf_fixtures import LAYER_TYPES, write_tiny_llama


def _use_native_decode(model, monkeypatch, on: bool) -> list[int]:
    """Switch the native step on or off; returns a list that counts the native steps taken."""
    monkeypatch.setenv("CPUSERVE_NATIVE_DECODE", "1" if on else "0")
    model.reset_native_decode_plan()
    assert (model.native_decode_plan() is not None) == on
    calls = [0]
    decode = native_decode.decode

    def counted(*args, **kwargs):
        calls[0] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(native_decode, "decode", counted)
    return calls


def _decode_logits(model, steps: int = 12) -> torch.Tensor:
    cache = model.new_cache(2, 64)
    logits = [model(torch.arange(100, 140).view(2, 20), cache)[:, -1]]
    for _ in range(steps):
        logits.append(model(logits[-1].argmax(-1, keepdim=True), cache)[:, -1])
    return torch.stack(logits)


@pytest.fixture(scope="module")
def checkpoints(smol_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("native-decode")
    return {
        "bf16": (smol_dir, "auto"),
        "w4a8-g64 fp32": (quantize_checkpoint(smol_dir, root / "w4a8", "w4a8", 64, progress=False), "float32"),
        "w8a8 bf16": (quantize_checkpoint(smol_dir, root / "w8a8", "w8a8", None, progress=False), "auto"),
        # the bundled Q4_1 GGUF from its file: offsets and activations per group
        "gguf q4_1 fp32": (resolve_model(None, str(root / "cache")), "float32"),
        # q F32, k F16, v Q8_0; gate Q4_1, up BF16: no fused qkv or gate_up
        "gguf mixed types": (_tiny_mixed_gguf(root), "auto"),
    }


def _tiny_mixed_gguf(root):
    assert len({LAYER_TYPES[f"attn_{x}.weight"] for x in "qkv"}) == 3
    assert LAYER_TYPES["ffn_gate.weight"] != LAYER_TYPES["ffn_up.weight"]
    write_tiny_llama(root / "mixed.gguf")
    return resolve_model(str(root / "mixed.gguf"), str(root / "cache"))


@pytest.mark.parametrize("name", ["bf16", "w4a8-g64 fp32", "w8a8 bf16", "gguf q4_1 fp32", "gguf mixed types"])
def test_native_decode_is_bit_identical_to_the_layer_loop(checkpoints, monkeypatch, name):
    path, dtype = checkpoints[name]
    model = load_model(path, dtype)
    layer = model.model.layers[0]
    unfused = layer.self_attn.qkv_proj is None and layer.mlp.gate_up_proj is None
    assert unfused == (name == "gguf mixed types")
    calls = _use_native_decode(model, monkeypatch, True)
    native = _decode_logits(model)
    assert calls[0] == 12  # every decode step, not the prompt
    calls = _use_native_decode(model, monkeypatch, False)
    python = _decode_logits(model)
    assert calls[0] == 0
    assert torch.equal(native, python)


# int8 and the 16-bit caches: written as the Python path writes them
@pytest.mark.parametrize("kv", ["auto", "int8", "bfloat16", "float16"])
def test_engine_steps_are_the_same_with_and_without_native_decode(smol_dir, monkeypatch, kv):
    model = load_model(smol_dir, "float32")
    tokenizer = Tokenizer(smol_dir)
    prompts = {f"r{i}": p for i, p in enumerate(["The capital of France is", "def add(a, b):", "1, 2, 3,"])}
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    outputs = {}
    for on in (True, False):
        calls = _use_native_decode(model, monkeypatch, on)
        # A small token budget staggers the prefills, so steps mix prefill chunks and decodes.
        config = EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8, kv_cache_dtype=kv)
        engine = LLMEngine(model, tokenizer, config, GenerationDefaults.load(smol_dir))
        done = run_to_completion(engine, prompts, params)
        outputs[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in done]
        assert (calls[0] > 5) == on  # all-decode steps went native (mixed steps did not)
    assert outputs[True] == outputs[False]
