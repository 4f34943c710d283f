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
    # Bounded patterns: every sample ends inside max_tokens, so every one is checked whole.
    regex = r"[0-9]{3}-[A-Z]{2}[a-z]{0,6}"
    grammar = 'root ::= greeting " " name\ngreeting ::= "hello" | "goodbye"\nname ::= [A-Z] [a-z] [a-z]? [a-z]?'
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
    assert len(done) == 15
    for rid, out in done.items():
        for o in out.outputs:
            assert o.finish_reason == "stop", (rid, o.text)
            if rid.startswith("re"):
                assert re.fullmatch(regex, o.text), o.text
            elif rid.startswith("ch"):
                assert o.text in ("red apple", "green", "blue sky")
            else:
                assert re.fullmatch(r"(hello|goodbye) [A-Z][a-z]{1,3}", o.text), o.text


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


def test_the_marker_is_found_in_text_however_it_is_spelled_in_tokens(engine, tokenizer):
    spec = StructuredOutputs("choice", ("yes", "no"), after="</think>")
    grammar = engine.grammars.compile(spec)
    one, other = (tokenizer.encode(t, add_special_tokens=False) for t in ("hmm.</think>", "ok </think>"))
    marker = tokenizer.encode("</think>", add_special_tokens=False)
    assert any(ids[-len(marker) :] != marker for ids in (one, other))  # not the marker's own token ids
    for ids in (one, other):
        state = grammar.new_state()
        for j, token in enumerate(ids):
            assert not state.active, j
            state.observe(token)
        assert state.active and not state.terminated
        for token in tokenizer.encode("yes", add_special_tokens=False):
            state.observe(token)
        assert state.terminated


def test_a_constraint_after_reasoning_holds_the_answer_only(engine, tokenizer):
    prompt = (
        "Q: Is fire hot? Reasoning: fire burns.</think>yes\n"
        "Q: Is ice hot? Reasoning: ice is frozen.</think>no\n"
        "Q: Is the sun hot? Reasoning:"
    )
    spec = StructuredOutputs("choice", ("yes", "no"), after="</think>")
    o = run(engine, {"m": (prompt, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec))})["m"]
    text = o.outputs[0].text
    assert "</think>" in text and o.outputs[0].finish_reason == "stop", text
    assert text.split("</think>", 1)[1] in ("yes", "no"), text


@pytest.mark.parametrize("kwargs,param", [({"min_tokens": 3}, "min_tokens"), ({"ignore_eos": True}, "ignore_eos")])
def test_what_a_grammar_cannot_honour_is_refused(engine, kwargs, param):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("x", "Hi", SamplingParams(structured_outputs=StructuredOutputs("regex", "a+"), **kwargs))
    assert err.value.param == param and not engine.has_unfinished()


def test_aborting_a_constrained_request_frees_it_and_the_others_go_on(engine, tokenizer):
    spec = json_spec(SCHEMAS[0])
    engine.add_request(
        "a", chat(tokenizer, "A person as JSON."), SamplingParams(max_tokens=60, structured_outputs=spec)
    )
    engine.add_request(
        "b", chat(tokenizer, "A person as JSON."), SamplingParams(max_tokens=60, structured_outputs=spec)
    )
    for _ in range(3):
        engine.step()
    assert engine.abort("a")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert list(done) == ["b"]
    jsonschema.validate(json.loads(done["b"].outputs[0].text), SCHEMAS[0])
    assert engine.core.blocks.usage == 0


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


@pytest.mark.parametrize(
    "pattern,rewritten",
    [
        (r"\d{3}-\d{4}", "[0-9]{3}-[0-9]{4}"),
        (r"[\d-]+\w", r"[0-9-]+[0-9A-Za-z_]"),
        (r"[^\d\s]", r"[^0-9 \t\n\r\f\v]"),
        (r"\D\W\S", r"[^0-9][^0-9A-Za-z_][^ \t\n\r\f\v]"),
        (r"[]\d]x", "[]0-9]x"),  # a class's first ']' is a literal
        (r"[^]\d]", "[^]0-9]"),
        (r"\\d\.\p{L}[\Da]", r"\\d\.\p{L}[\Da]"),  # escapes kept; a negated shorthand inside a class left as is
        (r"[\w-.]+", r"[0-9A-Za-z_\-.]+"),  # the dash after it stays a literal, not a range from '_'
        (r"[\d-]", "[0-9-]"),
    ],
)
def test_regex_shorthand_classes_are_ascii(pattern, rewritten):
    from cpuserve.engine.structured.regex_classes import ascii_classes

    assert ascii_classes(pattern) == rewritten
    if "\\p" in pattern or pattern.startswith("[\\w-"):
        return  # Python's re has no \p{...}, and refuses a dash after a class shorthand
    probe = "0123456789 \t\nabcXYZ_-]\u0663\u00e9"  # Arabic-Indic three and é: outside every ASCII class
    for ch in probe:  # the same characters match as under Python's ASCII reading of the original
        assert bool(re.fullmatch(rewritten, ch * 8)) == bool(re.fullmatch(pattern, ch * 8, re.ASCII)), (pattern, ch)


def test_json_schema_patterns_are_read_as_ascii_too():
    from cpuserve.engine.structured.regex_classes import ascii_schema_patterns

    schema = {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"}, "n": {"enum": [r"\d"]}},
        "patternProperties": {r"^\w+$": {"type": "string", "pattern": r"\s"}},
        "items": [{"pattern": r"[\d]"}],
        # instances are values a document holds: an object value with a "pattern" key is kept as written
        "default": {"pattern": r"\d"},
        "examples": [{"pattern": r"\w"}],
    }
    assert ascii_schema_patterns(schema) == {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}, "n": {"enum": [r"\d"]}},
        "patternProperties": {"^[0-9A-Za-z_]+$": {"type": "string", "pattern": r"[ \t\n\r\f\v]"}},
        "items": [{"pattern": "[0-9]"}],
        "default": {"pattern": r"\d"},
        "examples": [{"pattern": r"\w"}],
    }
