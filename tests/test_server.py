"""A real server process on 127.0.0.1, driven through the official `openai` client."""

from __future__ import annotations

import json
import time
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
    for path in ("/v1/models", "/metrics"):  # /metrics too (vLLM leaves it open; it shows the traffic)
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
    # an Anthropic client (anthropic-version sent) gets the 401 in Anthropic's shape
    req = urllib.request.Request(
        server + "/v1/messages", data=b"{}", headers={"x-api-key": "wrong", "anthropic-version": "2023-06-01"}
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401 and json.loads(e.value.read())["error"]["type"] == "authentication_error"


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
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "cpuserve:prefix_cache_hit_rate",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert name in text, name


def _metric_sums(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    req = urllib.request.Request(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if "le" not in s.labels}


def test_a_finished_request_is_counted_in_vllms_request_histograms(server):
    """vLLM's per-request series, from one request between two scrapes: one observation each, the
    lengths exactly the request's, and the phases (from the engine's times) against what is measured
    elsewhere: e2e within the client's own wait, arrival to first token (queue + prefill) against the
    server's TTFT (timed where the output reaches it), decode at most e2e."""
    before = _metric_sums(server)
    body = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    start = time.monotonic()
    status, out = _post(server, "/v1/completions", body)
    wall = time.monotonic() - start
    assert status == 200, out
    after = _metric_sums(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time"):
        assert delta[f"vllm:{name}_seconds_count"] == 1, name
    assert delta["vllm:request_prompt_tokens_sum"] == out["usage"]["prompt_tokens"]
    assert delta["vllm:request_generation_tokens_sum"] == 5 == out["usage"]["completion_tokens"]
    assert delta["vllm:request_params_n_sum"] == 1 and delta["vllm:request_params_max_tokens_sum"] == 5
    e2e, queue = delta["vllm:e2e_request_latency_seconds_sum"], delta["vllm:request_queue_time_seconds_sum"]
    inference = delta["vllm:request_inference_time_seconds_sum"]
    prefill, decode = delta["vllm:request_prefill_time_seconds_sum"], delta["vllm:request_decode_time_seconds_sum"]
    ttft = delta["vllm:time_to_first_token_seconds_sum"]
    assert 0 < e2e <= wall and 0 < decode < e2e and inference <= e2e
    assert prefill > 0 and queue >= 0 and 0 <= ttft - (queue + prefill) < 0.1, (ttft, queue, prefill)


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
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"store": True}, "store"),
        ({"best_of": 2}, "best_of"),
        ({"totally_unknown_param": 1}, "totally_unknown_param"),  # a name nothing reads: OpenAI refuses it too
        ({"typical_p": 0.9}, "typical_p"),
        ({"request_id": "mine-1"}, "request_id"),  # vLLM's names the response; not honoured here yet
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_parameters_not_honoured_yet_are_refused_not_ignored(server, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{server}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param not in ("typical_p", "totally_unknown_param", "request_id"):
        return
    assert r.json()["error"]["message"].startswith(f"{param}: unrecognized request argument supplied")
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}
    r = httpx.post(f"{server}/v1/completions", json=completion, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_those_parameters_are_served(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        # OpenAI's metadata and hints that change nothing in the answer, and neutral values
        metadata={"team": "a"},
        service_tier="auto",
        prediction={"type": "content", "content": "Hello"},
        modalities=["text"],
        store=False,
        extra_body={
            "tools": [],
            "tool_choice": "none",
            "prompt_cache_key": "k",
            "prompt_cache_retention": "24h",
            "safety_identifier": "u1",
        },
    )
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=1, extra_body={"best_of": 3})


# vLLM's behaviour where clients rely on it (an audit with real clients, session 32)


def test_max_tokens_is_cut_to_the_context_as_vllm_does(client, server, tokenizer):
    ids = tokenizer.encode("word " * 2100)[:2040]
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2048 - 2040
    status, err = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2049})
    assert status == 400 and err["error"]["param"] == "max_tokens"
    assert "cannot be greater than max_model_len=2048" in err["error"]["message"]
    status, err = _post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "prompt"
    assert "maximum context length is 2048 tokens" in err["error"]["message"]  # what LiteLLM & co. match
    # a wrong type names the field, not the member of its union pydantic tried ("stop.str")
    status, err = _post(server, "/v1/completions", {"model": MODEL, "prompt": "Hi", "stop": 5})
    assert status == 400 and err["error"]["param"] == "stop", err
    chat = {"model": MODEL, "messages": [{"role": "user", "content": 5}]}
    status, err = _post(server, "/v1/chat/completions", chat)
    assert status == 400 and err["error"]["param"] == "messages.0.content", err


def test_truncate_prompt_tokens_keeps_the_prompt_end(client, tokenizer):
    ids = tokenizer.encode("The history of the city " * 200)
    greedy = dict(model=MODEL, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 100}, **greedy)
    assert cut.usage.prompt_tokens == 100
    assert cut.choices[0].text == client.completions.create(prompt=ids[-100:], **greedy).choices[0].text
    right = client.completions.create(
        prompt=ids, extra_body={"truncate_prompt_tokens": 50, "truncation_side": "right"}, **greedy
    )
    assert right.choices[0].text == client.completions.create(prompt=ids[:50], **greedy).choices[0].text
    chat = client.chat.completions.create(messages=QUESTION, extra_body={"truncate_prompt_tokens": 5}, **greedy)
    assert chat.usage.prompt_tokens == 5


def test_continue_final_message_and_developer_role(server, client, tokenizer, smol_dir):
    transformers = pytest.importorskip("transformers")
    from cpuserve.model.resolve import bundled_gguf

    gguf = bundled_gguf()
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    messages = [
        {"role": "user", "content": "Write a haiku about rain."},
        {"role": "assistant", "content": "Soft rain on the"},
    ]
    body = {"model": MODEL, "messages": messages, "continue_final_message": True}
    status, tok = _post(server, "/tokenize", {**body, "add_generation_prompt": False})
    want = hf.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert status == 200 and want.endswith("Soft rain on the")
    assert tok["tokens"] == hf.encode(want, add_special_tokens=False)
    assert _post(server, "/tokenize", body)[1]["tokens"] == tok["tokens"]  # add_generation_prompt not given
    status, err = _post(server, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert status == 400 and err["error"]["param"] == "continue_final_message"
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, extra_body={"continue_final_message": True}
    )
    assert out.usage.prompt_tokens == len(tok["tokens"])
    plain = [messages[0]]
    developer = _post(
        server, "/tokenize", {"model": MODEL, "messages": [{"role": "developer", "content": "Be brief."}, *plain]}
    )
    system = _post(
        server, "/tokenize", {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, *plain]}
    )
    assert developer[1]["tokens"] == system[1]["tokens"]
    both = [{"role": "system", "content": "A."}, {"role": "developer", "content": "B."}, *plain]
    merged = [{"role": "system", "content": "A.\n\nB."}, *plain]
    assert _post(server, "/tokenize", {"model": MODEL, "messages": both})[1]["tokens"] == tokenizer.encode_chat(merged)


def test_template_gets_reasoning_effort_and_documents(client, tokenizer):
    template = "{{ reasoning_effort }}{% if enable_thinking %} thinking{% endif %} {{ documents | length }}"
    for effort, rendered in (("high", "high thinking 3"), ("none", "none 3")):
        out = client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=1,
            extra_body={"chat_template": template, "reasoning_effort": effort, "documents": [{"text": "a"}] * 3},
        )
        assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False)), effort


def test_completion_logprobs_list_the_sampled_token(client):
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=1.0, seed=3, logprobs=0
    )
    lp = r.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top == {token: value}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"bad_words": ["Paris"]}, "bad_words"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"priority": 1}, "priority"),
        ({"cache_salt": "tenant-a"}, "cache_salt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 2**63}, "seed"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_vllm_parameters_not_honoured_are_refused(server, body, param):
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{server}/v1/chat/completions", json=request, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_ping_model_retrieve_and_malformed_json(server, client):
    with urllib.request.urlopen(server + "/ping", timeout=10) as r:
        assert r.status == 200
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = httpx.post(
        f"{server}/v1/chat/completions",
        content=b'{"model": "smol", "messages": [',
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "not valid JSON" in r.json()["error"]["message"]


def test_chat_echo_starts_the_reply_with_the_final_assistant_message(client):
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    common = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**common, extra_body={"continue_final_message": True})
    echoed = client.chat.completions.create(**common, extra_body={"continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == "The capital of France is" + plain.choices[0].message.content
    stream = client.chat.completions.create(
        **common, stream=True, extra_body={"continue_final_message": True, "echo": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == echoed.choices[0].message.content
    no_echo = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, temperature=0, extra_body={"echo": True}
    )
    assert (
        no_echo.choices[0].message.content
        == client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0)
        .choices[0]
        .message.content
    )  # the final message is the user's: nothing to echo


def test_return_token_ids_and_tokens_named_by_id(client, tokenizer):
    """vLLM's return_token_ids (the prompt's ids and each choice's, streamed as they come) and
    return_tokens_as_token_ids (logprobs name tokens "token_id:N")."""
    common = dict(model=MODEL, max_tokens=5, temperature=0)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = client.chat.completions.create(messages=QUESTION, logprobs=True, extra_body=extra, **common)
    choice = chat.choices[0]
    assert chat.model_extra["prompt_token_ids"] == tokenizer.encode_chat(QUESTION)
    ids = choice.model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens and tokenizer.decode(ids) == choice.message.content
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in ids]
    chunks = list(client.chat.completions.create(messages=QUESTION, stream=True, extra_body=extra, **common))
    assert chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids") or []] == ids
    prompt = "Once upon a time"
    comp = client.completions.create(prompt=prompt, logprobs=1, extra_body=extra, **common).choices[0]
    assert comp.model_extra["prompt_token_ids"] == tokenizer.encode(prompt)
    assert comp.logprobs.tokens == [f"token_id:{t}" for t in comp.model_extra["token_ids"]]
    assert tokenizer.decode(comp.model_extra["token_ids"]) == comp.text
    streamed = [
        c.choices[0].model_extra
        for c in client.completions.create(prompt=prompt, stream=True, extra_body=extra, **common)
    ]
    assert streamed[0]["prompt_token_ids"] == tokenizer.encode(prompt)
    assert [t for e in streamed for t in e["token_ids"]] == comp.model_extra["token_ids"]


def test_neutral_vllm_values_and_flags_given_as_template_kwargs(server, tokenizer):
    ok = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
    for extra in ({"stream_options": {}}, {"watermarking": False, "priority": 0, "bad_words": []}):
        status, body = _post(server, "/v1/chat/completions", {**ok, **extra})
        assert status == 200, (extra, body)
    # the template's flags given in chat_template_kwargs, as vLLM merges them (a 500 before)
    kwargs = {"add_generation_prompt": False}
    status, tok = _post(server, "/tokenize", {"model": MODEL, "messages": QUESTION, "chat_template_kwargs": kwargs})
    assert status == 200 and tok["tokens"] == tokenizer.encode_chat(QUESTION, add_generation_prompt=False)
