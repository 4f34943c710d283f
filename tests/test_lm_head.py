"""The opt-in quantized output head (--quantize-lm-head): what it changes, bounded against the
unquantized head on real SmolLM2 weights and real text (measured: int8 (absmax scales) KL 0.007, top-1 94%, NLL
-0.1%; int4 KL 0.17, top-1 75%, NLL +4.2%)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cpuserve.errors import ConfigError
from cpuserve.model.loader import load_model
from cpuserve.quant.linear import Linear
from cpuserve.tokenizer import Tokenizer

TEXT = Path("/usr/share/common-licenses/GPL-3")
# kind -> (mean KL budget, least top-1 agreement, largest relative NLL change)
BUDGETS = {"int8": (0.02, 0.92, 0.01), "int4": (0.3, 0.68, 0.08)}


@pytest.fixture(scope="module")
def reference(smol_dir):
    ids = torch.tensor([Tokenizer(smol_dir).encode(TEXT.read_text()[:6000])[:400]])
    return ids, load_model(smol_dir, "float32")(ids)[0].log_softmax(-1)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_head_stays_close_to_the_float_head(smol_dir, reference, kind):
    ids, ref = reference
    model = load_model(smol_dir, "float32", quantize_lm_head=kind)
    assert isinstance(model.lm_head, Linear) and model.lm_head.quant.bits == (8 if kind == "int8" else 4)
    assert model.lm_head.kernel is not None  # on the native kernels, like the body
    got = model(ids)[0].log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    target = ids[0, 1:, None]
    nll_ref, nll = -ref[:-1].gather(1, target).mean().item(), -got[:-1].gather(1, target).mean().item()
    kl_budget, least_agree, nll_budget = BUDGETS[kind]
    assert kl <= kl_budget and agree >= least_agree and abs(nll / nll_ref - 1) <= nll_budget, (kl, agree, nll)


def test_an_unknown_head_kind_is_refused(smol_dir):
    with pytest.raises(ConfigError, match="expected one of int8, int4"):
        load_model(smol_dir, "float32", quantize_lm_head="int3")


def test_an_untied_head_is_quantized_from_its_own_float_weight(tmp_path):
    """An untied float head is packed to float panels like any float linear, except when it is to be
    quantized (the default on the kernels): then it is quantized from the checkpoint's weight (the
    MiniCPM5-2B shape failed to load with the int8 head default before)."""
    from cpuserve.quant.methods import select_kernel
    from tests.test_architectures import TINY, _make

    if select_kernel() is None:
        pytest.skip("the bug needs the native kernels (float panels)")
    _make("llama-untied", tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(3))
    ref = load_model(tmp_path, "float32")(ids)[0]
    model = load_model(tmp_path, "float32", quantize_lm_head="int8")
    assert model.lm_head.quant.bits == 8
    assert model.lm_head.kernel is not None
    got = model(ids)[0]
    # int8 per output channel, int8 activations per token: about 1% of the logits' scale
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_the_minicpm5_layout_is_served_with_its_head_quantized_on_the_kernels(tmp_path, smol_dir):
    """The reference's checkpoints have an untied float head (MiniCPM5-2B's layout, here at test size,
    W4A8-G128 as the benchmark serves it). `cpuserve serve` starts it with the int8 head on the
    kernels, and its greedy completion is the offline engine's on the same checkpoint; the head's
    first-token distribution stays close to the float head's."""
    import httpx

    from cpuserve.bench.make_model import make_model
    from cpuserve.bench.server_process import running_server
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams
    from cpuserve.offline.quantize import quantize_checkpoint
    from cpuserve.quant.methods import select_kernel

    if select_kernel() is None:
        pytest.skip("the int8 head is the default only on the native kernels")
    bf16 = make_model("minicpm5-tiny", tmp_path / "bf16", smol_dir, seed=5)
    ckpt = tmp_path / "w4a8"
    quantize_checkpoint(bf16, ckpt, "w4a8", 128, False)
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    offline = LLM(str(ckpt), dtype="float32", max_model_len=512).generate(prompt, params)[0].outputs[0]
    args = [str(ckpt), "--dtype", "float32", "--max-model-len", "512", "--served-model-name", "tiny"]
    log = tmp_path / "server.log"
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(tmp_path / "cache")}, log) as base:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 1}, timeout=120).json()
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        chat_status = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=120).status_code
    choice = reply["choices"][0]
    assert choice["text"] == offline.text, (choice["text"], offline.text)
    assert reply["usage"]["completion_tokens"] == 12 and chat_status == 200
    text = log.read_text()
    assert "lm_head quantized to W8A8" in text, text[-2000:]  # the untied float head, quantized at load
    assert re.search(r"quantized linears: native \w+ \((\d+)/\1 layers", text), text[-2000:]  # all on kernels
    # The int8 head's first token against the float head's distribution (same int4 body, float32).
    float_head = LLM(str(ckpt), dtype="float32", max_model_len=512, quantize_lm_head="none")
    ref = float_head.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    chosen, top = offline.token_ids[0], ref.logprobs[0].top
    assert chosen in top, "the int8 head's greedy token is not among the float head's top 5"
    assert abs(offline.logprobs[0].logprob - top[chosen]) < 0.1
