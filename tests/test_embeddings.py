"""Embeddings: the engine's pooled hidden states against transformers' hidden states pooled the same
way, through the engine (chunked, beside decoding) and through a server with the openai SDK."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest
import torch

from cpuserve.engine import SamplingParams
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.pooling import PoolingConfig
from cpuserve.tokenizer import GenerationDefaults, Tokenizer
from tests.smol_server import smol_server

openai = pytest.importorskip("openai")

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Bonjour", "Embeddings turn text into vectors " * 20]


def reference(hf_smol, ids: list[int], mode: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf_smol.model(torch.tensor([ids])).last_hidden_state[0]
    return {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[mode]


def cosine(a, b) -> float:  # type: ignore[no-untyped-def]
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), b, dim=0))


def test_pooled_hidden_states_equal_transformers_even_chunked_beside_a_decode(our_smol, hf_smol, smol_dir):
    tok = Tokenizer(smol_dir)
    # A 16-token budget: the long input is prefilled over many steps, each beside the decode.
    cfg = EngineConfig(num_kv_blocks=256, max_num_batched_tokens=16)
    engine = LLMEngine(our_smol, tok, cfg, GenerationDefaults.load(smol_dir))
    engine.add_request("gen", "Once upon a time", SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))
    engine.step()
    for i, text in enumerate(TEXTS):
        for mode in ("mean", "last", "cls"):
            engine.add_request(f"{i}-{mode}", text, SamplingParams(max_tokens=0, pooling=mode))
    done, gen_tokens, steps = {}, 0, 0
    while len(done) < 9:
        steps += 1
        for out in engine.step():
            if out.request_id == "gen":
                gen_tokens = len(out.outputs[0].token_ids)
            elif out.finished:
                done[out.request_id] = out
    assert gen_tokens == 1 + steps  # the decode drew a token in every step the embeddings took
    for i, text in enumerate(TEXTS):
        ids = tok.encode(text)
        for mode in ("mean", "last", "cls"):
            out = done[f"{i}-{mode}"]
            assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
            vec = torch.tensor(out.embedding)
            assert vec.shape == (576,) and abs(float(vec.norm()) - 1) < 1e-5
            assert cosine(vec, reference(hf_smol, ids, mode)) > 0.9999


def test_pooling_comes_from_the_sentence_transformers_config(tmp_path):
    assert PoolingConfig.load(tmp_path) == PoolingConfig()
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    (tmp_path / "config.json").write_text(json.dumps({"matryoshka_dimensions": [64, 128]}))
    got = PoolingConfig.load(tmp_path)
    assert (got.mode, got.normalize, got.dimensions, got.any_dimensions) == ("last", False, (64, 128), False)


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir, tmp_path_factory):
    with smol_server(smol_dir, cache_dir, tmp_path_factory.mktemp("server") / "server.log", max_num_seqs=16) as base:
        yield base


def test_openai_sdk_embeddings_equal_transformers_mean_pooling(server, hf_smol, smol_dir):
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    tok = Tokenizer(smol_dir)
    out = client.embeddings.create(model="smol", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(len(tok.encode(t)) for t in TEXTS)
    for d, text in zip(out.data, TEXTS, strict=True):
        assert len(d.embedding) == 576
        assert cosine(d.embedding, reference(hf_smol, tok.encode(text), "mean")) > 0.9999
    floats = client.embeddings.create(model="smol", input=TEXTS[0], encoding_format="float").data[0].embedding
    assert floats == pytest.approx(out.data[0].embedding, abs=1e-6)
    ids = tok.encode(TEXTS[1])
    by_ids = client.embeddings.create(model="smol", input=[ids, ids], encoding_format="float").data
    assert by_ids[0].embedding == pytest.approx(out.data[1].embedding, abs=1e-5)
    raw = httpx.post(f"{server}/v1/embeddings", json={"input": "Bonjour", "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(out.data[1].embedding, abs=1e-5)
    assert len(client.embeddings.create(model="smol", input="x", dimensions=576).data[0].embedding) == 576


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "dimensions": 100}, "dimensions"),
        ({"input": []}, "input"),
        ({"input": "word " * 3000}, "input"),
        ({"input": [10**8]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_embedding_requests_are_400s(server, body, param):
    r = httpx.post(f"{server}/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
