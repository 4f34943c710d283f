"""The server's structure: it uses the engine through the facade only, it never tokenizes on the
event loop, and the GIL-releasing encode it relies on returns exactly what encode does."""

from __future__ import annotations

import ast
import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

import cpuserve
from cpuserve.engine import CompletionOutput, EngineStats, RequestOutput
from cpuserve.tokenizer import Tokenizer

PACKAGE = Path(cpuserve.__file__).parent
SERVER = sorted((PACKAGE / "server").glob("*.py"))
ENGINE_SUBMODULES = {p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__"}


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in a file, nested ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def test_the_server_imports_the_engine_through_its_facade_only():
    assert SERVER and ENGINE_SUBMODULES
    bad = []
    for path in SERVER:
        for module, names in _imports(path):
            if module.startswith("cpuserve.engine."):
                bad.append(f"{path.name}: {module}")
            if module == "cpuserve.engine":
                bad += [f"{path.name}: cpuserve.engine.{n}" for n in names if n in ENGINE_SUBMODULES]
    assert not bad


def test_the_server_does_not_reach_into_the_engine():
    inside = {"llm", "blocks", "scheduler", "model_runner", "stats_snapshot"}
    bad = []
    for path in SERVER:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            if node.attr in inside:
                bad.append(f"{path.name}:{node.lineno} .{node.attr}")
            if node.attr == "engine" and isinstance(node.value, ast.Attribute) and node.value.attr == "engine":
                bad.append(f"{path.name}:{node.lineno} .engine.engine")
    assert not bad


def test_modules_stay_small():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in SERVER}
    sizes.update({str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in (PACKAGE / "cli").glob("*.py")})
    assert sizes and not {name: n for name, n in sizes.items() if n > 400}


@pytest.fixture(scope="module")
def tokenizer(smol_dir) -> Tokenizer:
    return Tokenizer(smol_dir)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Hello world",
        "  leading and trailing  ",
        "<|im_start|>user\nHi<|im_end|>\n",
        "naïve café 東京 🙂",
        "x" * 5000,
    ],
)
@pytest.mark.parametrize("special", [True, False])
def test_encode_off_gil_returns_what_encode_returns(tokenizer, text, special):
    assert tokenizer.encode_off_gil(text, add_special_tokens=special) == tokenizer.encode(text, special)


def _spins_during(encode, text: str, repeats: int = 5) -> int:
    """Iterations a Python loop on this thread makes while another thread is inside `encode`."""
    inside = threading.Event()
    done = threading.Event()

    def work() -> None:
        for _ in range(repeats):
            inside.set()
            encode(text)
            inside.clear()
            time.sleep(0.01)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    spins = 0
    while not done.is_set():
        if inside.is_set():
            spins += 1
    worker.join()
    return spins


def test_encode_off_gil_lets_other_threads_run(tokenizer):
    """The reason for encode_off_gil: `tokenizers` keeps the GIL in encode, releases it in
    encode_batch. A loop on another thread (the event loop, the engine) runs during the latter."""
    text = " ".join(f"word{i % 997} of the {i}" for i in range(4000))  # ~40k tokens, ~60 ms
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # a thread holding the GIL between C calls hands it over at once
    try:
        held = _spins_during(tokenizer.encode, text)
        released = _spins_during(tokenizer.encode_off_gil, text)
    finally:
        sys.setswitchinterval(interval)
    assert released > 5 * max(held, 100), (held, released)  # seen: 13-16x


class _RecordingTokenizer:
    """The real tokenizer, noting the thread of every prompt-side call."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def _note(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))

    def encode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._note("encode")
        return self.inner.encode(*args, **kwargs)

    def encode_off_gil(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._note("encode_off_gil")
        return self.inner.encode_off_gil(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._note("apply_chat_template")
        return self.inner.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._note("decode")
        return self.inner.decode(*args, **kwargs)

    def token_bytes(self, token_id: int) -> bytes:
        return self.inner.token_bytes(token_id)


class _EchoEngine:
    """AsyncEngine's public surface, answering every request with one token at once."""

    max_model_len = 2048
    max_logprobs = 20
    alive = True

    def __init__(self, tokenizer: _RecordingTokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.inner.vocab_size
        self.prompts: list[object] = []

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    def abort(self, request_id: str) -> None:
        pass

    async def generate(self, request_id, prompt, params):  # type: ignore[no-untyped-def]
        self.prompts.append(prompt)
        out = CompletionOutput(0, "!", [0], None, None, finish_reason="length")
        yield RequestOutput(request_id, None, list(prompt), None, [out], finished=True)


def test_prompts_are_tokenized_off_the_event_loop_and_the_engine_gets_ids(tokenizer):
    import httpx

    from cpuserve.server.app import ServerConfig, create_app

    recording = _RecordingTokenizer(tokenizer)
    engine = _EchoEngine(recording)
    app = create_app(engine, ServerConfig(served_model_names=["m"], chat_template=None))  # type: ignore[arg-type]
    messages = [{"role": "user", "content": "Hi"}]

    async def main() -> tuple[str, list[int]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            statuses = [
                (await client.post("/v1/completions", json={"prompt": ["Hello", "there"], "echo": True})).status_code,
                (await client.post("/v1/completions", json={"prompt": "Hi", "stream": True})).status_code,
                (await client.post("/v1/chat/completions", json={"messages": messages})).status_code,
                (await client.post("/tokenize", json={"prompt": "Hello"})).status_code,
                (await client.post("/tokenize", json={"messages": messages})).status_code,
                (await client.post("/detokenize", json={"tokens": [1, 2]})).status_code,
            ]
        return threading.current_thread().name, statuses

    loop_thread, statuses = asyncio.run(main())
    assert statuses == [200] * 6
    names = {name for name, _ in recording.calls}
    assert {"encode_off_gil", "apply_chat_template", "decode"} <= names and "encode" not in names
    assert all(thread != loop_thread and thread.startswith("cpuserve-tokenize") for _, thread in recording.calls)
    assert engine.prompts and all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in engine.prompts)
