"""The threaded async wrapper: concurrency, cancellation and rejection."""

from __future__ import annotations

import asyncio

import pytest

from cpuserve.engine.async_engine import AsyncEngine
from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import InvalidRequest, SamplingParams
from cpuserve.tokenizer import GenerationDefaults, Tokenizer


@pytest.fixture
def engine(our_smol, smol_dir):
    cfg = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=256)
    return LLMEngine(our_smol, Tokenizer(smol_dir), cfg, GenerationDefaults.load(smol_dir))


def test_concurrent_requests_match_the_synchronous_engine(engine):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The sky is", "Python is a", "My name is"]
    expected = [o.outputs[0].token_ids for o in run_to_completion(engine, dict(enumerate(prompts)), params)]
    async_engine = AsyncEngine(engine)

    async def one(i, prompt):
        last = None
        async for out in async_engine.generate(f"q{i}", prompt, params):
            last = out
        return last.outputs[0].token_ids

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        assert asyncio.run(main()) == expected
    finally:
        async_engine.shutdown()


def test_cancelled_consumer_aborts_and_frees_blocks(engine):
    async_engine = AsyncEngine(engine)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = async_engine.generate("long", "Count to a thousand:", params)
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 3:
                break
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not engine.has_unfinished():
                break
        return seen

    try:
        assert asyncio.run(main()) == 3
        assert not engine.has_unfinished()
        assert engine.blocks.num_free == engine.blocks.num_blocks
    finally:
        async_engine.shutdown()


def test_invalid_request_raises_before_any_output(engine):
    async_engine = AsyncEngine(engine)

    async def main():
        async for _ in async_engine.generate("bad", "hi", SamplingParams(top_p=2.0)):
            pass

    try:
        with pytest.raises(InvalidRequest, match=r"^top_p"):
            asyncio.run(main())
        assert async_engine.alive and not engine.has_unfinished()
    finally:
        async_engine.shutdown()


def test_fatal_error_fails_every_stream_turns_health_503_and_calls_on_fatal(engine, monkeypatch):
    import httpx

    from cpuserve.engine.async_engine import EngineDeadError
    from cpuserve.server.app import ServerConfig, create_app
    from tests import faults

    faults.install(monkeypatch.setattr)
    fatal: list[BaseException] = []
    async_engine = AsyncEngine(engine, on_fatal=fatal.append)
    app = create_app(async_engine, ServerConfig(served_model_names=["m"]))
    normal = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    poison = SamplingParams(temperature=0.5, seed=faults.SEED_FATAL, max_tokens=5)

    async def consume(request_id, params):
        async for _ in async_engine.generate(request_id, "The sky is", params):
            pass

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            running = asyncio.ensure_future(consume("a", normal))
            await asyncio.sleep(0.3)
            results = await asyncio.gather(running, consume("b", poison), return_exceptions=True)
            health = (await client.get("/health")).status_code
            after = (await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})).status_code
        return results, health, after

    try:
        results, health, after = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert all(isinstance(r, EngineDeadError) for r in results)
    assert health == 503 and after == 503
    assert len(fatal) == 1 and "injected fatal" in str(fatal[0])


def test_load_builds_the_engine_on_its_thread_and_leaves_the_caller_single_threaded(engine):
    """AsyncEngine.load: the factory runs on the engine thread (the one thread that computes in
    parallel), its error is raised to the caller, and the caller's torch runs one thread after."""
    import threading

    import torch

    before = torch.get_num_threads()
    seen: list[tuple[str, int]] = []

    def factory() -> LLMEngine:
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return engine

    try:
        with pytest.raises(RuntimeError, match="no such checkpoint"):
            AsyncEngine.load(lambda: (_ for _ in ()).throw(RuntimeError("no such checkpoint")))
        async_engine = AsyncEngine.load(factory)
        assert seen == [("cpuserve-engine", before)]
        assert async_engine.engine is engine and torch.get_num_threads() == 1
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        expected = run_to_completion(engine, {0: "The sky is"}, params)[0].outputs[0].token_ids

        async def one():
            last = None
            async for out in async_engine.generate("q", "The sky is", params):
                last = out
            return last.outputs[0].token_ids

        assert asyncio.run(one()) == expected
        async_engine.shutdown()
    finally:
        torch.set_num_threads(before)
