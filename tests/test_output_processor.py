"""The output processor on its own, fed made-up engine-core outputs: what a client sees when the
engine thread runs ahead of the event loop (tokens drawn after a stop string), n > 1 with mixed
finishes, min_tokens holding stop strings back, and prompt logprobs written by position."""

from __future__ import annotations

import pytest

from cpuserve.engine.output_processor import RequestState
from cpuserve.engine.requests import EngineCoreOutput, EngineCoreRequest, SequenceDelta
from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.sequence import TokenLogprobs
from cpuserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smol_dir):
    return Tokenizer(smol_dir)


def delta(index: int, ids: list[int], finish: str | None = None, stop=None) -> SequenceDelta:  # type: ignore[no-untyped-def]
    return SequenceDelta(index, ids, [None] * len(ids), finish, stop, 0)


def test_tokens_drawn_after_a_stop_string_never_reach_the_client(tok):
    words = tok.encode(" one two three four five six", add_special_tokens=False)
    other = tok.encode(" red green blue cyan pink gold", add_special_tokens=False)
    assert len(words) == len(other)
    params = SamplingParams(n=2, max_tokens=len(words), stop=[" three"])
    state = RequestState(tok, EngineCoreRequest("r", tok.encode("Count:"), params))
    stops_seen, outs = [], []
    for i, (a, b) in enumerate(zip(words, other, strict=True)):
        last = i == len(words) - 1
        core = EngineCoreOutput("r", [delta(0, [a]), delta(1, [b], "length" if last else None)])
        out, stops = state.process(core)
        stops_seen += stops
        outs.append(out)
    first, second = outs[-1].outputs
    assert stops_seen == [(0, " three")]  # reported once, when found
    assert first.text == " one two" and (first.finish_reason, first.stop_reason) == ("stop", " three")
    assert first.token_ids == words[:3]  # the tokens the engine drew for it later are dropped
    assert outs[2].finished is False and outs[2].outputs[0].finish_reason == "stop"
    assert second.text == " red green blue cyan pink gold" and second.finish_reason == "length"
    assert outs[-1].finished


def test_min_tokens_holds_stop_strings_back_without_cutting_the_text(tok):
    words = tok.encode(" a\nb\nc", add_special_tokens=False)
    params = SamplingParams(max_tokens=10, stop=["\n"], min_tokens=len(words) - 1)
    state = RequestState(tok, EngineCoreRequest("r", [1], params))
    for t in words:
        out, _ = state.process(EngineCoreOutput("r", [delta(0, [t])]))
    text = out.outputs[0]
    assert text.finish_reason == "stop" and text.text == " a\nb"  # the first newline stayed in the text


def test_prompt_logprobs_land_at_their_positions_whatever_the_chunking(tok):
    prompt = tok.encode("The capital of France is Paris.")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    state = RequestState(tok, EngineCoreRequest("r", prompt, params))
    entry = [TokenLogprobs(t, -1.0, 1, {}) for t in prompt]
    # Two chunks, then the second recomputed after a preemption: the same positions again.
    for start, end in ((1, 4), (4, len(prompt)), (1, 4)):
        state.process(EngineCoreOutput("r", [], (start, entry[start:end])))
    out, _ = state.process(EngineCoreOutput("r", [delta(0, [5], "length")]))
    assert out.prompt_logprobs[0] is None and [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]
