"""vLLM's serve flags beyond the reference's command line: each honoured with its vLLM meaning, or
refused with one line naming it. The fast part checks parsing, refusals and the app's middleware
with a stub engine; the server part starts the bundled model with the flags and asks it over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from cpuserve.engine import EngineStats, SamplingParams
from cpuserve.engine.sampling_params import InvalidRequest
from cpuserve.errors import CpuserveError
from cpuserve.model.gguf_source import POINTER_FILE
from cpuserve.server.app import ServerConfig, create_app
from cpuserve.server.serve import uvicorn_config
from cpuserve.server.serve_flags import (
    NO_EFFECT,
    add_serve_args,
    check_model_flags,
    check_serve_args,
    checked_generation_overrides,
    generation_overrides,
    local_tokenizer,
)
from cpuserve.server.state import CorsPolicy


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def _refused(*argv: str) -> str:
    with pytest.raises(CpuserveError) as info:
        check_serve_args(_parse(*argv))
    return str(info.value)


def test_vllm_flags_parse_with_vllm_meanings():
    args = _parse(
        "--enable-chunked-prefill",
        "-q",
        "gguf",
        "--load-format",
        "gguf",
        "--max-logprobs",
        "5",
        "--allowed-origins",
        '["https://a.example", "https://b.example"]',
        "--allow-credentials",
        "--root-path",
        "/api",
        "--disable-fastapi-docs",
        "--override-generation-config",
        '{"temperature": 0.5, "top_k": 3}',
    )
    check_serve_args(args)
    assert args.quantization == "gguf" and args.load_format == "gguf" and args.max_logprobs == 5
    assert args.allowed_origins == ["https://a.example", "https://b.example"] and args.allow_credentials
    assert (args.allowed_methods, args.allowed_headers) == (["*"], ["*"])  # vLLM's defaults
    assert _parse().allowed_origins == []  # vLLM's: no cross-origin browser access unless named
    assert args.root_path == "/api" and args.disable_fastapi_docs
    assert generation_overrides(args.override_generation_config) == {"temperature": 0.5, "top_k": 3}


def test_no_effect_flags_are_logged_once_each(caplog):
    args = _parse("--enable-chunked-prefill", "--max-seq-len-to-capture", "8192", "--disable-custom-all-reduce")
    with caplog.at_level("INFO", logger="cpuserve"):
        check_serve_args(args)
    lines = [r.getMessage() for r in caplog.records]
    for flag in ("enable-chunked-prefill", "max-seq-len-to-capture", "disable-custom-all-reduce"):
        assert sum(line.startswith(f"--{flag} accepted; no effect: ") for line in lines) == 1, lines
    assert set(NO_EFFECT) >= {"enable_chunked_prefill", "revision", "download_dir"}


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill cannot be honoured"),
        (["--load-format", "pt"], "--load-format pt: pickled weights are never loaded"),
        (["--load-format", "dummy"], "--load-format dummy: not supported"),
        (["-dp", "2"], "--data-parallel-size must be 1"),
        (["--max-logprobs", "-2"], "--max-logprobs must be -1"),
        (["--ssl-keyfile", "/etc/hostname"], "--ssl-keyfile needs --ssl-certfile"),
        (
            ["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/etc/hostname"],
            "--ssl-keyfile /nonexistent.key: no such file",
        ),
        (["--ssl-keyfile", "/etc/hostname", "--ssl-certfile", "/etc/hostname"], "--ssl-certfile /etc/hostname"),
        (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
        (["--ssl-ca-certs", "/etc/hostname"], "--ssl-ca-certs and --ssl-cert-reqs need"),
        (["--root-path", "api"], "--root-path api: a path prefix"),
        (["--root-path", "/api/"], "--root-path /api/: a path prefix"),
        (["--override-generation-config", "{temperature"], "--override-generation-config: not JSON"),
        (["--override-generation-config", "[1]"], "expected a JSON object"),
        (["--override-generation-config", '{"seed": 5}'], "seed cannot be honoured"),
        (["--override-generation-config", '{"max_new_tokens": 0}'], "max_new_tokens must be >= 1, got 0"),
        (["--override-generation-config", '{"temperature": "hot"}'], "temperature must be a number"),
        (["--override-generation-config", '{"top_k": 2.5}'], "top_k must be an integer, got 2.5"),
    ],
)
def test_values_that_cannot_be_honoured_are_refused(argv, says):
    assert says in _refused(*argv)


def test_cors_lists_must_be_json_lists(capsys):
    with pytest.raises(SystemExit):
        _parse("--allowed-origins", "https://a.example")
    assert "expected a JSON list of strings" in capsys.readouterr().err


def _gguf_dir(tmp_path: Path) -> Path:
    d = tmp_path / "gguf"
    d.mkdir()
    (d / POINTER_FILE).write_text("/models/m.gguf")
    return d


def _hf_dir(tmp_path: Path, method: str | None) -> Path:
    d = tmp_path / f"hf-{method}"
    d.mkdir()
    config = {"architectures": ["LlamaForCausalLM"]}
    if method:
        config["quantization_config"] = {"quant_method": method}
    (d / "config.json").write_text(json.dumps(config))
    return d


def _model_refusal(model_dir: Path, *argv: str) -> str | None:
    try:
        check_model_flags(_parse(*argv), model_dir)
    except CpuserveError as exc:
        return str(exc)
    return None


def test_quantization_and_load_format_are_checked_against_the_checkpoint(tmp_path):
    gguf, ct, plain = _gguf_dir(tmp_path), _hf_dir(tmp_path, "compressed-tensors"), _hf_dir(tmp_path, None)
    assert _model_refusal(gguf, "-q", "gguf", "--load-format", "gguf") is None
    assert _model_refusal(ct, "--quantization", "compressed-tensors", "--load-format", "safetensors") is None
    assert _model_refusal(plain, "--load-format", "auto") is None
    assert _model_refusal(ct, "-q", "awq") == f"--quantization awq: {ct} is quantized with compressed-tensors"
    assert _model_refusal(plain, "-q", "fp8") == (
        f"--quantization fp8: {plain} is not quantized (cpuserve quantizes offline: `cpuserve quantize`)"
    )
    assert _model_refusal(gguf, "--load-format", "safetensors") == "--load-format safetensors: the model is a GGUF file"
    assert _model_refusal(ct, "--load-format", "gguf") == "--load-format gguf: the model is a safetensors directory"


def test_tokenizer_must_be_a_local_directory(tmp_path):
    assert local_tokenizer(None) is None
    with pytest.raises(CpuserveError, match="--tokenizer HuggingFaceTB/SmolLM2-135M-Instruct: not a local directory"):
        local_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert local_tokenizer(str(tmp_path)) == tmp_path


def test_override_values_are_held_to_a_requests_bounds():
    assert checked_generation_overrides('{"top_k": 5.0, "temperature": 0.5}') == {"top_k": 5, "temperature": 0.5}
    for text, says in [
        ('{"temperature": -1}', "temperature: must be >= 0"),
        ('{"top_p": 0}', "top_p: must be in (0, 1]"),
    ]:
        with pytest.raises(CpuserveError, match=re.escape(f"--override-generation-config: {says}")):
            checked_generation_overrides(text)


SUBJECT = ("-subj", "/CN=localhost", "-days", "1")


def _self_signed(tmp_path: Path, name: str) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, *SUBJECT],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_tls_files_are_checked_before_loading_and_reach_uvicorn(tmp_path):
    key, cert = _self_signed(tmp_path, "a")
    other_key, _ = _self_signed(tmp_path, "b")
    args = _parse("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--port", "9")
    check_serve_args(args)
    config = uvicorn_config(args, app=None)
    assert (config.ssl_keyfile, config.ssl_certfile, config.port) == (str(key), str(cert), 9)
    mismatched = f"--ssl-certfile {cert} / --ssl-keyfile {other_key}"
    assert _refused("--ssl-keyfile", str(other_key), "--ssl-certfile", str(cert)).startswith(mismatched)
    assert "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs" in _refused(
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"
    )
    check_serve_args(_parse("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(cert)))
    both = tmp_path / "both.pem"  # one PEM holding the key and the certificate: --ssl-certfile alone
    both.write_text(key.read_text() + cert.read_text())
    check_serve_args(_parse("--ssl-certfile", str(both)))
    assert "--ssl-certfile" in _refused("--ssl-certfile", str(cert))  # no key anywhere


def test_max_logprobs_bounds_logprobs_and_prompt_logprobs():
    SamplingParams(logprobs=3, prompt_logprobs=3).validate(100, max_logprobs=3)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidRequest, match="must be between 0 and 3, got 4") as info:
            SamplingParams(**{name: 4}).validate(100, max_logprobs=3)
        assert info.value.param == name
    SamplingParams(logprobs=20).validate(100)  # vLLM's default limit


class _StubEngine:
    max_model_len, max_logprobs, vocab_size, alive, tokenizer = 2048, 20, 100, True, None

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)


def _send(app, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, headers=headers)

    return asyncio.run(main())


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_no_cross_origin_access_by_default():
    app = create_app(_StubEngine(), ServerConfig(served_model_names=["m"]))  # type: ignore[arg-type]
    pre = _send(app, "OPTIONS", "/v1/chat/completions", {"Origin": "https://x.example", **PREFLIGHT})
    assert pre.status_code == 400 and "access-control-allow-origin" not in pre.headers
    plain = _send(app, "GET", "/v1/models", {"Origin": "https://x.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_cors_answers_preflights_before_the_key_check_and_marks_401s():
    config = ServerConfig(served_model_names=["m"], api_key="k", cors=CorsPolicy(["*"]))
    app = create_app(_StubEngine(), config)  # type: ignore[arg-type]
    pre = _send(app, "OPTIONS", "/v1/chat/completions", {"Origin": "https://x.example", **PREFLIGHT})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    denied = _send(app, "GET", "/v1/models", {"Origin": "https://x.example"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "*"
    assert denied.json()["error"]["code"] == "invalid_api_key"
    allowed = _send(app, "GET", "/v1/models", {"Origin": "https://x.example", "Authorization": "Bearer k"})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "*"


def test_cors_origins_restricted_and_credentials():
    cors = CorsPolicy(["https://a.example"], ["GET", "POST"], ["authorization", "content-type"], True)
    app = create_app(_StubEngine(), ServerConfig(served_model_names=["m"], cors=cors))  # type: ignore[arg-type]
    ok = _send(app, "OPTIONS", "/v1/chat/completions", {"Origin": "https://a.example", **PREFLIGHT})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://a.example"
    assert ok.headers["access-control-allow-credentials"] == "true"
    other = _send(app, "OPTIONS", "/v1/chat/completions", {"Origin": "https://b.example", **PREFLIGHT})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    plain = _send(app, "GET", "/v1/models", {"Origin": "https://b.example"})
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_fastapi_docs_can_be_turned_off():
    on = create_app(_StubEngine(), ServerConfig(served_model_names=["m"]))  # type: ignore[arg-type]
    off = create_app(_StubEngine(), ServerConfig(served_model_names=["m"], api_docs=False))  # type: ignore[arg-type]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert _send(on, "GET", path, {}).status_code == 200
        assert _send(off, "GET", path, {}).status_code == 404
    assert _send(off, "GET", "/v1/models", {}).status_code == 200


def test_cluster_refuses_flags_of_an_http_server_it_does_not_run():
    from cpuserve.cluster.app import replica_argv

    for argv in (["--root-path", "/api"], ["--allowed-origins", '["https://a.example"]'], ["--disable-fastapi-docs"]):
        with pytest.raises(CpuserveError, match="replicas run no HTTP server of their own"):
            replica_argv(_parse(*argv))


# ---- the server, started with the flags ------------------------------------------------------------------

MARKER = "<<tokenizer from --tokenizer>>"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def flagged(smol_dir, cache_dir, tmp_path_factory):
    from tests.smol_server import smol_server

    work = tmp_path_factory.mktemp("flags")
    tok = work / "tokenizer"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, tok / name)
    (tok / "chat_template.jinja").write_text(
        MARKER + "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    flags = ["--tokenizer", str(tok), "--load-format", "safetensors", "--enable-chunked-prefill"]
    flags += ["--max-logprobs", "3", "--enable-prompt-tokens-details", "--root-path", "/api"]
    flags += [
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--override-generation-config",
        '{"top_k": 1, "max_new_tokens": 5}',
    ]
    with smol_server(smol_dir, cache_dir, work / "server.log", *flags) as base:
        yield base, tok


def test_server_uses_the_tokenizer_directory_given(flagged):
    from cpuserve.tokenizer import Tokenizer

    base, tok = flagged
    messages = [{"role": "user", "content": "Hi there"}]
    got = httpx.post(f"{base}/tokenize", json={"model": "smol", "messages": messages}, timeout=60).json()
    expected = Tokenizer(tok)
    assert got["tokens"] == expected.encode(expected.apply_chat_template(messages, True), add_special_tokens=False)
    assert expected.decode(got["tokens"]).startswith(MARKER)


def test_server_caps_logprobs_at_max_logprobs(flagged):
    base, _ = flagged
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True}
    r = httpx.post(f"{base}/v1/chat/completions", json={**chat, "top_logprobs": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert "must be between 0 and 3, got 4" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", json={"model": "smol", "prompt": "Hi", "logprobs": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    # vLLM's -1, the whole vocabulary: more than this server allows
    r = httpx.post(f"{base}/v1/completions", json={"model": "smol", "prompt": "Hi", "logprobs": -1}, timeout=60)
    assert r.status_code == 400 and "must be between 0 and 3, got 49152" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/chat/completions", json={**chat, "top_logprobs": -1}, timeout=60)
    assert r.status_code == 400 and "top_logprobs: must be between 0 and 3, got 49152" in r.json()["error"]["message"]
    ok = httpx.post(f"{base}/v1/chat/completions", json={**chat, "top_logprobs": 3}, timeout=60).json()
    assert [len(t["top_logprobs"]) for t in ok["choices"][0]["logprobs"]["content"]] == [3, 3]


def test_server_reports_cached_prompt_tokens(flagged):
    base, _ = flagged
    body = {"model": "smol", "prompt": "The quick brown fox jumps over the lazy dog. " * 6, "max_tokens": 1}
    first = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["usage"]
    second = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # whole 16-token blocks of the same prompt, short of the last token (recomputed for its logits)
    assert second["prompt_tokens_details"]["cached_tokens"] == (second["prompt_tokens"] - 1) // 16 * 16 > 0
    chat = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    chat["stream_options"] = {"include_usage": True}
    lines = httpx.post(f"{base}/v1/chat/completions", json=chat, timeout=60).text.splitlines()
    usage = json.loads([x for x in lines if x.startswith("data: {")][-1][6:])["usage"]
    assert set(usage["prompt_tokens_details"]) == {"cached_tokens"}


def test_server_sampling_defaults_from_override_generation_config(flagged):
    base, _ = flagged
    for route, body in [("completions", {"prompt": "Once upon a time"}), ("chat/completions", {"messages": QUESTION})]:
        out = httpx.post(f"{base}/v1/{route}", json={"model": "smol", "ignore_eos": True, **body}, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 5  # max_new_tokens from the override
        assert out["choices"][0]["finish_reason"] == "length"
    body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 12}
    greedy = httpx.post(f"{base}/v1/completions", json={**body, "temperature": 0}, timeout=60).json()
    hot = [
        httpx.post(f"{base}/v1/completions", json={**body, "temperature": 1.5, "seed": s}, timeout=60).json()
        for s in (1, 2, 3)
    ]
    # top_k 1 from the override: any temperature draws the greedy token
    assert {h["choices"][0]["text"] for h in hot} == {greedy["choices"][0]["text"]}
    free = [
        httpx.post(f"{base}/v1/completions", json={**body, "temperature": 1.5, "seed": s, "top_k": -1}, timeout=60)
        for s in (1, 2, 3)
    ]
    assert len({f.json()["choices"][0]["text"] for f in free}) > 1  # the request's own top_k wins


def test_server_cors_and_root_path(flagged):
    base, _ = flagged
    pre = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT}, timeout=60)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{base}/v1/chat/completions", headers={"Origin": "https://b.example", **PREFLIGHT})
    assert other.status_code == 400
    assert httpx.get(f"{base}/openapi.json", timeout=60).json()["servers"] == [{"url": "/api"}]
    # behind a proxy that strips the prefix, and one that does not (vLLM's FastAPI root_path)
    for path in ("/v1/models", "/api/v1/models"):
        assert httpx.get(f"{base}{path}", timeout=60).json()["data"][0]["id"] == "smol"


def test_served_penalty_defaults_apply_unless_the_request_sets_them():
    from cpuserve.server.protocol import CompletionRequest

    defaults = generation_overrides('{"presence_penalty": 1.5, "frequency_penalty": -0.5}')
    unset = CompletionRequest(prompt="x").sampling_params(None, defaults, 4, None)
    assert (unset.presence_penalty, unset.frequency_penalty) == (1.5, -0.5)
    own = CompletionRequest(prompt="x", presence_penalty=0, frequency_penalty=0.25).sampling_params(
        None, defaults, 4, None
    )
    assert (own.presence_penalty, own.frequency_penalty) == (0, 0.25)
    plain = CompletionRequest(prompt="x").sampling_params(None, {}, 4, None)
    assert (plain.presence_penalty, plain.frequency_penalty) == (0.0, 0.0)
