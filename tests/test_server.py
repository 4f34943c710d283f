"""A real server process on 127.0.0.1, driven through the official `openai` client."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import httpx
import pytest
import torch

from cpuserve.bench.server_process import running_server
from cpuserve.generate import SimpleSampling, generate_ids
from cpuserve.tokenizer import Tokenizer

openai = pytest.importorskip("openai")

KEY = "test-key-123"
MODEL = "smol"
LOGPROB_BUDGET = 2e-3
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [
        str(smol_dir),
        "--dtype",
        "float32",
        "--api-key",
        KEY,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        "--quantize-lm-head",
        "none",  # greedy answers compared with transformers' float head
    ]
    with running_server(args, {"CPUSERVE_CACHE_DIR": str(cache_dir), "VLLM_CPU_KVCACHE_SPACE": "1"}, log) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return Tokenizer(smol_dir)


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids]))[0], dim=-1)


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_greedy_answer_and_exact_usage(client, tokenizer, our_smol):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40)
    prompt = tokenizer.encode_chat(QUESTION)
    ref = list(generate_ids(our_smol, prompt, SimpleSampling(max_tokens=40, stop_token_ids=(2,))))
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.content == tokenizer.decode(ref)
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref)
    assert r.usage.total_tokens == len(prompt) + len(ref)


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completion_logprobs_match_the_reference(client, tokenizer, our_smol):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    prompt_ids = tokenizer.encode(prompt)
    out_ids = tokenizer.encode(prompt + r.choices[0].text)[len(prompt_ids) :]
    ref = ref_logprobs(our_smol, prompt_ids + out_ids)
    for i, value in enumerate(lp.token_logprobs):
        assert abs(value - float(ref[len(prompt_ids) - 1 + i].max())) < LOGPROB_BUDGET
        assert len(lp.top_logprobs[i]) == 3


def test_chat_logprobs_match_the_reference(client, tokenizer, our_smol):
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    prompt = tokenizer.encode_chat(QUESTION)
    ids = list(generate_ids(our_smol, prompt, SimpleSampling(max_tokens=5)))
    ref = ref_logprobs(our_smol, prompt + ids)
    assert len(content) == 5
    for i, entry in enumerate(content):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry.logprob - float(row[ids[i]])) < LOGPROB_BUDGET
        assert bytes(entry.bytes) == tokenizer.token_bytes(ids[i])
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(torch.topk(row, 2).values.tolist(), abs=2e-3)


def test_completions_n_seed_and_prompt_forms(client, tokenizer):
    kw = dict(model=MODEL, max_tokens=8, temperature=0.9, seed=11, n=2)
    a = client.completions.create(prompt=["Once upon a time", "The weather today"], **kw)
    b = client.completions.create(prompt=["Once upon a time", "The weather today"], **kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    ids = tokenizer.encode("Once upon a time")
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    by_text = client.completions.create(prompt="Once upon a time", **greedy).choices[0].text
    assert client.completions.create(prompt=ids, **greedy).choices[0].text == by_text
    assert [c.text for c in client.completions.create(prompt=[ids, ids], **greedy).choices] == [by_text, by_text]


def test_stop_echo_and_usage(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    stop = full.choices[0].text[8:12]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == full.choices[0].text[: full.choices[0].text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    echo = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Once upon a time")
    assert full.usage.prompt_tokens == 4 and full.usage.completion_tokens == 24


def _post(server, path, body, key=KEY):
    req = urllib.request.Request(
        server + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "body,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 4000}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": "word " * 3000}, "prompt"),
        ({"prompt": 12}, "prompt"),
    ],
)
def test_bad_requests_are_400_with_the_parameter(server, body, param):
    status, err = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", **body})
    assert status == 400, err
    assert err["error"]["param"] == param or err["error"]["param"].startswith(param)
    assert err["error"]["type"] == "BadRequestError" and err["error"]["message"]


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, top_logprobs=30, logprobs=True)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_keys(server):
    for path in ("/v1/models", "/metrics"):
        for key in (None, "wrong"):
            req = urllib.request.Request(server + path, headers={"Authorization": f"Bearer {key}"} if key else {})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            assert json.loads(e.value.read())["error"]["code"] == "invalid_api_key"
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        status, body = _post(server, path, {"model": MODEL, "prompt": "x", "messages": QUESTION}, key="wrong")
        assert status == 401 and body["error"]["type"] == "AuthenticationError", path
    with urllib.request.urlopen(server + "/health", timeout=10) as r:
        assert r.status == 200


def test_tokenize_detokenize_version_metrics(server, tokenizer):
    status, tok = _post(server, "/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and tok["tokens"] == tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    status, detok = _post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert detok["prompt"] == "Hello world"
    status, chat_tok = _post(server, "/tokenize", {"model": MODEL, "messages": QUESTION})
    assert chat_tok["tokens"] == tokenizer.encode_chat(QUESTION)
    with urllib.request.urlopen(server + "/version", timeout=10) as r:
        assert "version" in json.loads(r.read())
    req = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    for name in (
        "cpuserve:num_requests_running",
        "cpuserve:num_requests_waiting",
        "cpuserve:kv_cache_usage_perc",
        "cpuserve:prefix_cache_hit_rate",
        "cpuserve:time_to_first_token_seconds_bucket",
        "cpuserve:inter_token_latency_seconds_bucket",
        "cpuserve:prompt_tokens_total",
        "cpuserve:generation_tokens_total",
    ):
        assert name in text, name


def test_reference_launch_command_with_cpuserve(smol_dir, cache_dir, tmp_path):
    """The reference image's command line and environment, `vllm` replaced by `cpuserve`. Thread
    binding variables are left out: they name the CIX board's cores, not this machine's."""
    env = {
        "FLAGGEMS_VENDOR": "arm",
        "TRITON_CPU_BACKEND": "1",
        "VLLM_PLUGINS": "fl",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TRITON_CACHE_DIR": "/root/arm64-vllm024-test/.cache/triton-2c35990",
        "MKL_NUM_THREADS": "2",
        "CPUSERVE_CACHE_DIR": str(cache_dir),
    }
    args = [
        str(smol_dir),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        "1024",
        "--max-num-seqs",
        "1",
        "--generation-config",
        "vllm",
        "--distributed-executor-backend",
        "uni",
        "--disable-log-stats",
        "--language-model-only",
    ]
    log = tmp_path / "server.log"
    with running_server(args, env, log) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=str(smol_dir), messages=QUESTION, temperature=0, max_tokens=30)
        assert "Paris" in r.choices[0].message.content
    text = log.read_text()
    assert "--enforce-eager accepted; no effect" in text
    assert "FLAGGEMS_VENDOR=arm is not needed by cpuserve" in text
    assert "listening on http://127.0.0.1:" in text


def test_allowed_token_ids_limit_every_draw_and_bad_ones_are_refused(client, tokenizer):
    """vLLM's allowed_token_ids: a per-row logits mask; sampled at temperature 1, only those come out."""
    allowed = tokenizer.encode(" red green blue", add_special_tokens=False)
    out = client.completions.create(
        model=MODEL,
        prompt="My favourite colour is",
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
        logprobs=0,
    )
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 8 and set(tokens) <= {tokenizer.decode([t]) for t in allowed}
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"allowed_token_ids": [10**7]})


@pytest.mark.parametrize(
    "body,param",
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"echo": True}, "echo"),
    ],
)
def test_parameters_not_honoured_yet_are_refused_not_ignored(server, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{server}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_those_parameters_are_served(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        extra_body={"tools": [], "tool_choice": "none"},
    )
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=1, extra_body={"best_of": 3})
