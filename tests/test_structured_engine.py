"""Structured outputs in the engine: constrained rows hold to their grammar on every sample, the
unconstrained rows of the same batch are untouched, and bad constraints are refused up front.
Outputs are checked by independent validators (jsonschema, re), never by the grammar engine."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from cpuserve.engine import InvalidRequest, SamplingParams, StructuredOutputs
from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
from cpuserve.engine.structured import unpack_bitmask
from cpuserve.tokenizer import GenerationDefaults, Tokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
            "author": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 12},
                    "last": {"type": "string", "maxLength": 12},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            },
        },
        "required": ["title", "tags", "author"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "number"},
            "level": {"enum": ["low", "mid", "high"]},
            "note": {"type": ["string", "null"], "maxLength": 16},
        },
        "required": ["ok", "score", "level"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    return Tokenizer(smol_dir)


@pytest.fixture(scope="module")
def engine(our_smol, tokenizer, smol_dir):
    return LLMEngine(
        our_smol, tokenizer, EngineConfig(num_kv_blocks=1024, max_num_seqs=16), GenerationDefaults.load(smol_dir)
    )


def run(engine: LLMEngine, jobs: dict[str, tuple[str, SamplingParams]]) -> dict:
    for rid, (prompt, params) in jobs.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def chat(tokenizer: Tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}])


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs("json", StructuredOutputs.canonical_json(schema))


def test_sampled_json_answers_all_validate(engine, tokenizer):
    jobs = {}
    for s, schema in enumerate(SCHEMAS):
        for k in range(7):
            params = SamplingParams(
                max_tokens=160, temperature=0.8, seed=100 * s + k, structured_outputs=json_spec(schema)
            )
            jobs[f"s{s}-{k}"] = (chat(tokenizer, "Write one example record as JSON."), params)
    done = run(engine, jobs)
    assert len(done) == 21
    for rid, out in done.items():
        o = out.outputs[0]
        assert o.finish_reason == "stop", (rid, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMAS[int(rid[1])])


def test_regex_choice_and_grammar_hold_on_every_sample(engine, tokenizer):
    regex = r"[0-9]{3}-[A-Z]{2}[a-z]*"
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "goodbye"\nname ::= [A-Z] [a-z]+'
    jobs = {}
    for k in range(5):
        common = dict(max_tokens=24, temperature=1.0, seed=k, n=2)
        jobs[f"re{k}"] = ("A code:", SamplingParams(**common, structured_outputs=StructuredOutputs("regex", regex)))
        jobs[f"ch{k}"] = (
            "Pick:",
            SamplingParams(
                **common, structured_outputs=StructuredOutputs("choice", ("red apple", "green", "blue sky"))
            ),
        )
        jobs[f"gr{k}"] = ("Say:", SamplingParams(**common, structured_outputs=StructuredOutputs("grammar", grammar)))
    done = run(engine, jobs)
    for rid, out in done.items():
        for o in out.outputs:
            if rid.startswith("re"):
                assert re.fullmatch(regex, o.text) or o.finish_reason == "length", o.text
            elif rid.startswith("ch"):
                assert o.text in ("red apple", "green", "blue sky") and o.finish_reason == "stop"
            else:
                assert re.fullmatch(r"(hello|goodbye) [A-Z][a-z]+", o.text) or o.finish_reason == "length", o.text


def test_unconstrained_rows_are_untouched_and_logprobs_are_the_models(engine, tokenizer, our_smol):
    free = SamplingParams(max_tokens=20, temperature=0.9, seed=7, logprobs=3)
    alone = run(engine, {"free": (chat(tokenizer, "Tell me a story."), free)})["free"].outputs[0]
    constrained = SamplingParams(
        max_tokens=40, temperature=0.9, seed=1, logprobs=3, structured_outputs=json_spec(SCHEMAS[0])
    )
    mixed = run(
        engine,
        {
            "free": (chat(tokenizer, "Tell me a story."), free),
            "json": (chat(tokenizer, "A person as JSON."), constrained),
        },
    )
    assert mixed["free"].outputs[0].token_ids == alone.token_ids
    got = [lp.logprob for lp in mixed["free"].outputs[0].logprobs]
    assert got == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-4)  # batch shape moves the last bits
    # A constrained row's logprobs are the model's own distribution (as vLLM reports them), not
    # the masked one: each drawn token's entry equals the reference forward pass's log_softmax.
    out = mixed["json"]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    ref = torch.log_softmax(our_smol(torch.tensor([ids]))[0], dim=-1)
    n = len(out.prompt_token_ids)
    for i, entry in enumerate(out.outputs[0].logprobs):
        assert abs(entry.logprob - float(ref[n - 1 + i, entry.token_id])) < 2e-3
        assert list(entry.top) == torch.topk(ref[n - 1 + i], 3).indices.tolist()


def test_constraint_starts_after_the_marker(engine, tokenizer):
    marker = tuple(tokenizer.encode(" Answer:", add_special_tokens=False))
    spec = StructuredOutputs("choice", ("yes", "no"), after_ids=marker)
    # allowed_token_ids force the free part to write the marker quickly: the marker's tokens plus the choices'.
    allowed = sorted(
        set(marker)
        | set(tokenizer.encode("yes", add_special_tokens=False))
        | set(tokenizer.encode("no", add_special_tokens=False))
    )
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, allowed_token_ids=allowed, structured_outputs=spec)
    o = run(engine, {"m": ("Question: is it?", params)})["m"].outputs[0]
    ids = o.token_ids
    ends = [i for i in range(len(marker), len(ids) + 1) if tuple(ids[i - len(marker) : i]) == marker]
    assert ends, o.text
    after = tokenizer.decode(ids[ends[0] :])
    assert after in ("yes", "no") and o.finish_reason == "stop", o.text


@pytest.mark.parametrize(
    "spec,words",
    [
        (StructuredOutputs("json", '{"type":"foo"}'), "Invalid type"),
        (StructuredOutputs("json", '{"$ref":"#/nope"}'), "nope"),
        (StructuredOutputs("regex", "(("), "regex"),
        (StructuredOutputs("grammar", 'root ::= "a" missing_rule'), "missing_rule"),
    ],
)
def test_bad_constraints_are_refused_and_nothing_is_queued(engine, spec, words):
    with pytest.raises(InvalidRequest, match=words):
        engine.add_request("bad", "Hi", SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished()


def test_compiled_grammars_are_cached(engine, tokenizer):
    spec = json_spec({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]})
    before = engine.grammars.compiled
    run(engine, {f"c{k}": ("Hi", SamplingParams(max_tokens=8, structured_outputs=spec)) for k in range(3)})
    assert engine.grammars.compiled == before + 1


def test_unpack_bitmask_reads_bits_in_token_order():
    bits = np.array([[0b1011, -1], [-(1 << 31), 0]], dtype=np.int32)  # bit 31: the sign bit
    mask = unpack_bitmask(bits, 40)
    assert mask.shape == (2, 40) and mask.dtype == bool
    assert mask[0, :4].tolist() == [True, True, False, True] and not mask[0, 4:32].any() and mask[0, 32:].all()
    assert np.flatnonzero(mask[1]).tolist() == [31]


def test_structural_tag_holds_each_tagged_segment_to_its_schema(engine, tokenizer):
    # Upper-case enum values: what the model copies from the prompt ("Paris") would not validate.
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["PARIS", "LYON"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}],
        "triggers": ["<function="],
    }
    spec = StructuredOutputs("structural_tag", StructuredOutputs.canonical_json(tag))
    prompt = (
        'Rome: <function=get_weather>{"city": "Rome"}</function>\n'
        'Oslo: <function=get_weather>{"city": "Oslo"}</function>\n'
        "Paris:"
    )
    jobs = {
        f"t{k}": (prompt, SamplingParams(max_tokens=60, temperature=0.9, seed=k, structured_outputs=spec))
        for k in range(6)
    }
    done = run(engine, jobs)
    segments = 0
    for out in done.values():
        text = out.outputs[0].text
        for body in re.findall(r"<function=get_weather>(.*?)</function>", text, flags=re.S):
            jsonschema.validate(json.loads(body), schema)
            segments += 1
        # A begun segment is always closed by the grammar, unless max_tokens cut it.
        opened = text.count("<function=get_weather>")
        assert opened == text.count("</function>") or out.outputs[0].finish_reason == "length", text
    assert segments > 0
