"""The engine on the real SmolLM2 (fp32) against the reference decoder and against itself."""

from __future__ import annotations

import pytest
import torch

from cpuserve.engine.llm import run_to_completion
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.sampling_params import InvalidRequest, SamplingParams
from cpuserve.generate import SimpleSampling, generate_ids
from cpuserve.tokenizer import GenerationDefaults, Tokenizer
from tests import faults

LOGPROB_BUDGET = 2e-3  # fp32; paged/batched attention vs the contiguous reference

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 1, 2, 3, 5, 8,",
    "The best way to learn a new language is",
    "SELECT name, age FROM users WHERE",
    "Water boils at",
    "In 1492, Christopher Columbus",
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return Tokenizer(smol_dir)


def make_engine(our_smol, tokenizer, smol_dir, **config) -> LLMEngine:
    cfg = EngineConfig(**{"num_kv_blocks": 256, "max_num_seqs": 16, "max_num_batched_tokens": 512, **config})
    return LLMEngine(our_smol, tokenizer, cfg, GenerationDefaults.load(smol_dir))


@pytest.fixture
def engine(our_smol, tokenizer, smol_dir):
    return make_engine(our_smol, tokenizer, smol_dir)


def run(engine, prompts, params):
    return run_to_completion(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_batched_greedy_equals_alone_and_the_reference(engine, our_smol, tokenizer):
    together = [o.outputs[0].token_ids for o in run(engine, PROMPTS, GREEDY)]
    alone = [run(engine, [p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    for prompt, tokens in zip(PROMPTS, together, strict=True):
        ref = list(generate_ids(our_smol, tokenizer.encode(prompt), SimpleSampling(max_tokens=24)))
        assert tokens == ref, prompt
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_seeded_sample_is_the_same_alone_and_in_a_busy_batch(engine):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = run(engine, ["Tell me about the ocean."], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    outs = run(engine, [*PROMPTS[:3], "Tell me about the ocean."], [*others, seeded])
    assert outs[3].outputs[0].token_ids == alone
    different_seed = SamplingParams(**{**seeded.__dict__, "seed": 99})
    assert run(engine, ["Tell me about the ocean."], different_seed)[0].outputs[0].token_ids != alone


def test_logprobs_and_prompt_logprobs_equal_the_reference(engine, our_smol, tokenizer):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    prompt = "The quick brown fox jumps over the lazy"
    out = run(engine, [prompt, PROMPTS[1]], params)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    ref = torch.log_softmax(our_smol(torch.tensor([ids]))[0], dim=-1)
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for j in range(1, n):
        entry = out.prompt_logprobs[j]
        assert entry.token_id == ids[j]
        assert abs(entry.logprob - float(ref[j - 1, ids[j]])) < LOGPROB_BUDGET
        assert list(entry.top) == torch.topk(ref[j - 1], 3).indices.tolist()
    for i, entry in enumerate(out.outputs[0].logprobs):
        row = ref[n - 1 + i]
        assert entry.token_id == ids[n + i] and entry.rank == 1  # greedy picks the most likely token
        assert abs(entry.logprob - float(row[entry.token_id])) < LOGPROB_BUDGET
        top = torch.topk(row, 5)
        assert list(entry.top) == top.indices.tolist()
        assert (
            max(abs(entry.top[t] - float(v)) for t, v in zip(top.indices.tolist(), top.values, strict=False))
            < LOGPROB_BUDGET
        )
    assert out.outputs[0].cumulative_logprob == pytest.approx(sum(e.logprob for e in out.outputs[0].logprobs))


def test_prefix_cache_hit_gives_the_same_output(our_smol, tokenizer, smol_dir):
    prefix = "You are a careful assistant. Answer in one sentence, using simple words. " * 3
    cached = make_engine(our_smol, tokenizer, smol_dir)
    uncached = make_engine(our_smol, tokenizer, smol_dir, enable_prefix_caching=False)
    run(cached, [prefix + "What is rain?"], GREEDY)
    hit = run(cached, [prefix + "What is snow?"], GREEDY)[0]
    miss = run(uncached, [prefix + "What is snow?"], GREEDY)[0]
    assert hit.num_cached_tokens >= 32 and miss.num_cached_tokens == 0
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids


def test_preemption_and_chunked_prefill_do_not_change_outputs(engine, our_smol, tokenizer, smol_dir):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in run(engine, PROMPTS[:4], params)]
    tight = make_engine(our_smol, tokenizer, smol_dir, num_kv_blocks=10, max_num_batched_tokens=7)
    got = [o.outputs[0].token_ids for o in run(tight, PROMPTS[:4], params)]
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.blocks.num_free == tight.blocks.num_blocks


def test_n_sequences_and_seeds(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = run(engine, ["My favourite colour is"], params)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    single = run(engine, ["My favourite colour is"], SamplingParams(**{**params.__dict__, "n": 1}))[0]
    assert single.outputs[0].token_ids == out.outputs[0].token_ids


def test_stop_strings_tokens_and_lengths(engine, tokenizer):
    full = run(engine, ["The capital of France is"], GREEDY)[0].outputs[0]
    stop = full.text[10:14]
    assert stop and stop in full.text
    cut = run(engine, ["The capital of France is"], SamplingParams(**{**GREEDY.__dict__, "stop": [stop]}))[0]
    assert cut.outputs[0].text == full.text[: full.text.index(stop)]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = SamplingParams(**{**GREEDY.__dict__, "stop": [stop], "include_stop_str_in_output": True})
    assert run(engine, ["The capital of France is"], kept)[0].outputs[0].text.endswith(stop)
    stop_token = full.token_ids[5]
    by_token = run(
        engine, ["The capital of France is"], SamplingParams(**{**GREEDY.__dict__, "stop_token_ids": [stop_token]})
    )[0]
    first = full.token_ids.index(stop_token)
    assert by_token.outputs[0].token_ids == full.token_ids[: first + 1]
    assert by_token.outputs[0].stop_reason == stop_token
    short = run(engine, ["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(short.token_ids) == 3 and short.finish_reason == "length"


def test_eos_min_tokens_and_logit_bias(engine, tokenizer):
    chat = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    plain = run(engine, [chat], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.token_ids[-1] == 2  # <|im_end|>
    longer = run(engine, [chat], SamplingParams(temperature=0, max_tokens=64, min_tokens=len(plain.token_ids) + 5))
    assert len(longer[0].outputs[0].token_ids) >= len(plain.token_ids) + 5
    forced = run(engine, ["Hello"], SamplingParams(temperature=0.8, max_tokens=5, logit_bias={1000: 100.0}))
    assert forced[0].outputs[0].token_ids == [1000] * 5


def test_streaming_holds_back_stop_strings(engine):
    full = run(engine, ["Once upon a time"], GREEDY)[0].outputs[0].text
    stop = full[20:26]
    engine.add_request("s", "Once upon a time", SamplingParams(**{**GREEDY.__dict__, "stop": [stop]}))
    seen = []
    while engine.has_unfinished():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    final = seen[-1]
    assert final == full[: full.index(stop)]
    for text in seen:
        assert stop not in text and final.startswith(text)


def test_abort_frees_blocks(engine):
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_free < engine.blocks.num_blocks
    assert engine.abort("a") and engine.abort("b") and not engine.abort("a")
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 100}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logit_bias": {10**7: 1.0}}, "logit_bias"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ],
)
def test_impossible_requests_are_rejected_and_nothing_is_queued(engine, kwargs, param):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", "Hello", SamplingParams(**kwargs))
    assert err.value.param == param and str(err.value).startswith(f"{param}: ")
    assert not engine.has_unfinished() and not engine.scheduler.waiting


def test_prompt_longer_than_max_model_len_is_rejected(our_smol, tokenizer, smol_dir):
    small = make_engine(our_smol, tokenizer, smol_dir, max_model_len=64)
    with pytest.raises(
        InvalidRequest,
        match=r"^prompt: This model's maximum context length is 64 tokens\. However, your prompt contains 1.. input",
    ):
        small.add_request("long", "word " * 100, SamplingParams())
    with pytest.raises(InvalidRequest, match=r"^prompt: token id 99999 is outside the vocabulary"):
        small.add_request("ids", [1, 2, 99999], SamplingParams())
    assert not small.scheduler.waiting


@pytest.mark.parametrize("seed", [faults.SEED_DETOKENIZE_FAULT, faults.SEED_SAMPLE_FAULT])
def test_a_request_that_faults_fails_alone(engine, monkeypatch, seed):
    """Sampling or detokenizing one request raises: that request ends with an error and its blocks
    are freed; the others in the same batches produce exactly their tokens from running alone."""
    faults.install(monkeypatch.setattr)
    params = [SamplingParams(temperature=0.8, seed=7 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
    alone = [run(engine, [p], q)[0].outputs[0].token_ids for p, q in zip(PROMPTS[:3], params, strict=True)]
    bad = SamplingParams(temperature=0.8, seed=seed, max_tokens=16, ignore_eos=True)
    outs = run(engine, [*PROMPTS[:3], PROMPTS[3]], [*params, bad])
    assert [o.outputs[0].token_ids for o in outs[:3]] == alone
    assert all(o.error is None for o in outs[:3])
    assert outs[3].finished and outs[3].error is not None and "injected" in outs[3].error
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.has_unfinished()
    # The engine goes on serving afterwards.
    assert run(engine, [PROMPTS[0]], params[0])[0].outputs[0].token_ids == alone[0]


def test_engine_seed_makes_a_run_reproducible_and_unseeded_requests_still_differ(our_smol, tokenizer, smol_dir):
    def texts(seed: int) -> list[str]:
        engine = make_engine(our_smol, tokenizer, smol_dir, seed=seed)
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
        outs = run(engine, [PROMPTS[0], PROMPTS[0], PROMPTS[1]], params)
        own = run(engine, [PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5))
        return [o.outputs[0].text for o in outs + own]

    first, again, other = texts(7), texts(7), texts(8)
    assert first == again  # the same requests in the same order: the same outputs
    assert first[0] != first[1]  # two unseeded requests do not share a seed
    assert first[:3] != other[:3] and first[3] == other[3]  # a request's own seed is its own
