"""Tool-call parsers: exact calls and content for each format, and streams that agree with parse() for any split."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator

import pytest

from cpuserve.server.tool_parsers import (
    PARSERS,
    ParsedOutput,
    Stripper,
    ToolCall,
    ToolParser,
    get_tool_parser,
    split_marker,
)


def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def hermes_block(obj: object) -> str:
    return f"<tool_call>\n{json.dumps(obj, ensure_ascii=False)}\n</tool_call>"


WEATHER = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
TIME = {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}

HERMES_CASES: list[tuple[str, ParsedOutput]] = [
    ("The answer is 4.", ParsedOutput("The answer is 4.", [])),
    ("  \n  ", ParsedOutput(None, [])),
    ("", ParsedOutput(None, [])),
    (hermes_block(WEATHER), ParsedOutput(None, [call("get_weather", city="Paris", unit="celsius")])),
    (
        "Let me check.\n" + hermes_block(WEATHER) + "\n" + hermes_block(TIME),
        ParsedOutput(
            "Let me check.", [call("get_weather", city="Paris", unit="celsius"), call("get_time", tz="Europe/Paris")]
        ),
    ),
    (
        "Before\n" + hermes_block(WEATHER) + "\nbetween\n" + hermes_block(TIME) + "\nafter ",
        ParsedOutput(
            "Before\n\nbetween\n\nafter",
            [call("get_weather", city="Paris", unit="celsius"), call("get_time", tz="Europe/Paris")],
        ),
    ),
    # Unicode arguments come out as characters, whether the model wrote them raw or escaped.
    (
        '<tool_call>{"name": "translate", "arguments": {"text": "東京 🙂", "to": "fr\\u00e9"}}</tool_call>',
        ParsedOutput(None, [ToolCall("translate", '{"text": "東京 🙂", "to": "fré"}')]),
    ),
    # Arguments as a JSON string holding an object, and as "parameters"; none at all is {}.
    (
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2], \\"b\\": null}"}</tool_call>',
        ParsedOutput(None, [ToolCall("f", '{"a": [1, 2], "b": null}')]),
    ),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', ParsedOutput(None, [call("f", x=1)])),
    ('<tool_call>{"name": "noargs"}</tool_call>', ParsedOutput(None, [ToolCall("noargs", "{}")])),
    # Malformed blocks stay verbatim in the content, valid ones around them are still calls.
    (
        'A <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> B ' + hermes_block(TIME),
        ParsedOutput(
            'A <tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> B', [call("get_time", tz="Europe/Paris")]
        ),
    ),
    (
        '<tool_call>{"arguments": {}}</tool_call>',
        ParsedOutput('<tool_call>{"arguments": {}}</tool_call>', []),
    ),
    ('<tool_call>{"name": 3}</tool_call>', ParsedOutput('<tool_call>{"name": 3}</tool_call>', [])),
    (
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        ParsedOutput('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', []),
    ),
    (
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        ParsedOutput('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    ),
    (
        '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
        ParsedOutput('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
    ),
    (
        '<tool_call>{"name": "f"} trailing</tool_call>',
        ParsedOutput('<tool_call>{"name": "f"} trailing</tool_call>', []),
    ),
    # An unterminated block at the end: a call when its JSON is complete, content otherwise.
    ('Ok.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', ParsedOutput("Ok.", [call("f", a=1)])),
    (
        'Ok.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}',
        ParsedOutput('Ok.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}', []),
    ),
    ("Ok <tool_call>", ParsedOutput("Ok <tool_call>", [])),
    # A block opened inside a block is part of its body; a stray close is text; a marker's prefix is text.
    (
        '<tool_call> <tool_call>{"name": "f"}</tool_call>',
        ParsedOutput('<tool_call> <tool_call>{"name": "f"}</tool_call>', []),
    ),
    ("</tool_call> x", ParsedOutput("</tool_call> x", [])),
    ("a <tool_ca", ParsedOutput("a <tool_ca", [])),
    ("x < y <tool y", ParsedOutput("x < y <tool y", [])),
]

LLAMA_CASES: list[tuple[str, ParsedOutput]] = [
    ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}', ParsedOutput(None, [call("f", x=1)])),
    ('{"name": "f", "parameters": {"x": 1}}', ParsedOutput(None, [call("f", x=1)])),
    ('\n {"name": "f", "arguments": {"x": "ü"}} \n', ParsedOutput(None, [call("f", x="ü")])),
    (
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        ParsedOutput(None, [call("f", x=1), ToolCall("g", "{}")]),
    ),
    (
        '{"name": "f", "parameters": {}};{"name": "g", "parameters": "{\\"y\\": 2}"};',
        ParsedOutput(None, [ToolCall("f", "{}"), call("g", y=2)]),
    ),
    (
        '{"name": "f", "parameters": {}}\n{"name": "g", "parameters": {}}',
        ParsedOutput(None, [ToolCall("f", "{}"), ToolCall("g", "{}")]),
    ),
    ("Paris is the capital.", ParsedOutput("Paris is the capital.", [])),
    ("", ParsedOutput(None, [])),
    # Anything that is not calls throughout makes it all content and no calls.
    (
        'Calling: {"name": "f", "parameters": {}}',
        ParsedOutput('Calling: {"name": "f", "parameters": {}}', []),
    ),
    (
        '{"name": "f", "parameters": {}} Done.',
        ParsedOutput('{"name": "f", "parameters": {}} Done.', []),
    ),
    ('{"answer": 42}', ParsedOutput('{"answer": 42}', [])),
    (
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {',
        ParsedOutput('{"name": "f", "parameters": {}}; {"name": "g", "parameters": {', []),
    ),
    (
        '{"name": "f", "parameters": {}};; {"name": "g", "parameters": {}}',
        ParsedOutput('{"name": "f", "parameters": {}};; {"name": "g", "parameters": {}}', []),
    ),
    ("<|python_tag|>print(1)", ParsedOutput("<|python_tag|>print(1)", [])),
    (" <|python_tag|> ", ParsedOutput("<|python_tag|>", [])),
    ("<|python", ParsedOutput("<|python", [])),
    ('{"name": "f", "parameters": 3}', ParsedOutput('{"name": "f", "parameters": 3}', [])),
]

MISTRAL_CASES: list[tuple[str, ParsedOutput]] = [
    (
        'Sure.[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "é"}}]',
        ParsedOutput("Sure.", [call("f", a=1), call("g", b="é")]),
    ),
    ('[TOOL_CALLS][{"name": "f", "arguments": "{\\"a\\": 1}"}]', ParsedOutput(None, [call("f", a=1)])),
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]get_time[ARGS]{}',
        ParsedOutput(None, [call("get_weather", city="Zürich"), ToolCall("get_time", "{}")]),
    ),
    ('Hi [TOOL_CALLS]f[ARGS]{"a": 1} g[ARGS]{"b": 2}', ParsedOutput("Hi", [call("f", a=1), call("g", b=2)])),
    ('[TOOL_CALLS]add{"a": 3.5, "b": 4}', ParsedOutput(None, [call("add", a=3.5, b=4)])),
    ('[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}', ParsedOutput(None, [call("f", a=1)])),
    ("No tools needed.", ParsedOutput("No tools needed.", [])),
    ("[TOOLS] is not the marker", ParsedOutput("[TOOLS] is not the marker", [])),
    # All of it from the marker on is calls, or the whole output is content verbatim.
    ('Hm [TOOL_CALLS]f[ARGS]{"a": 1', ParsedOutput('Hm [TOOL_CALLS]f[ARGS]{"a": 1', [])),
    ('[TOOL_CALLS]f[ARGS]{"a": 1} and more', ParsedOutput('[TOOL_CALLS]f[ARGS]{"a": 1} and more', [])),
    ('[TOOL_CALLS][{"arguments": {}}]', ParsedOutput('[TOOL_CALLS][{"arguments": {}}]', [])),
    ("[TOOL_CALLS]", ParsedOutput("[TOOL_CALLS]", [])),
    ("[TOOL_CALLS][]", ParsedOutput("[TOOL_CALLS][]", [])),
    ("x [TOOL_CALL", ParsedOutput("x [TOOL_CALL", [])),
]

CASES = {"hermes": HERMES_CASES, "llama3_json": LLAMA_CASES, "mistral": MISTRAL_CASES}
ALL_CASES = [(name, text, expected) for name, cases in CASES.items() for text, expected in cases]


def run_stream(parser: ToolParser, deltas: list[str]) -> tuple[str, list[ToolCall]]:
    """The concatenated content and the calls a stream sends for these deltas."""
    stream = parser.stream()
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in deltas:
        text, new = stream.feed(delta)
        content.append(text)
        calls += new
    text, new = stream.finish()
    return "".join(content) + text, calls + new


def splits(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Whole, at every point, every pair of points (short texts), one character at a time, and random cuts."""
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    if len(text) <= 60:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                yield [text[:i], text[i:j], text[j:]]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def assert_stream_agrees(parser: ToolParser, text: str) -> None:
    expected = parser.parse(text)
    for deltas in splits(text):
        assert "".join(deltas) == text
        assert run_stream(parser, deltas) == (expected.content or "", expected.tool_calls), deltas


@pytest.mark.parametrize(("name", "text", "expected"), ALL_CASES)
def test_parse_gives_the_exact_content_and_calls(name: str, text: str, expected: ParsedOutput) -> None:
    assert get_tool_parser(name).parse(text) == expected


@pytest.mark.parametrize(("name", "text", "expected"), ALL_CASES)
def test_a_stream_sends_what_parse_returns_for_any_split(name: str, text: str, expected: ParsedOutput) -> None:
    assert_stream_agrees(get_tool_parser(name), text)


CALLISH = {  # pieces of each format, whole and broken
    "hermes": [hermes_block(WEATHER), '<tool_call>{"name": "f"}', "<tool_call>", "</tool_call>", "<tool_"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}}', '{"name": "g"}', "<|python_tag|>", ";", '{"name"', "<|py"],
    "mistral": ['[TOOL_CALLS]f[ARGS]{"a": 1}', "[TOOL_CALLS]", 'g{"b": []}', '[{"name": "h"}]', "[ARGS]", "[TOOL"],
}
NOISE = ["Hello", "é🙂", "{", "}", '"', ";", "[", "<", "x"]


def well_formed(rng: random.Random, name: str) -> str:
    """Text, then calls in the format, as a model writes them."""
    objs = [
        {"name": rng.choice(["f", "g_2"]), "arguments": {"a": rng.choice([1, "é", [], {"b": None}])}}
        for _ in range(rng.randint(1, 3))
    ]

    def ws() -> str:
        return rng.choice(["", " ", "\n"])

    if name == "hermes":
        return rng.choice(["", "Sure."]) + "".join(ws() + hermes_block(o) + ws() for o in objs)
    if name == "llama3_json":
        calls = [json.dumps({"name": o["name"], "parameters": o["arguments"]}) for o in objs]
        return rng.choice(["", "<|python_tag|>"]) + ws() + (ws() + rng.choice([";", ""]) + ws()).join(calls)
    if rng.random() < 0.5:
        return rng.choice(["", "Ok "]) + "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)
    return "".join(f"[TOOL_CALLS]{o['name']}[ARGS]{json.dumps(o['arguments'])}" for o in objs)


def random_text(rng: random.Random, name: str) -> str:
    """Well-formed calls, perhaps with a character changed; or format pieces, perhaps mixed with text."""
    if rng.random() < 0.5:
        text = well_formed(rng, name)
        if text and rng.random() < 0.4:
            i = rng.randrange(len(text))
            text = text[:i] + rng.choice(["", "x", "}", " ", "["]) + text[i + 1 :]
        return text
    pool = CALLISH[name] + [" ", "\n"] + (NOISE if rng.random() < 0.5 else [])
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 8)))


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_random_texts_stream_as_they_parse(name: str) -> None:
    rng = random.Random(name)
    parser = get_tool_parser(name)
    for _ in range(500):
        text = random_text(rng, name)
        expected = (parser.parse(text).content or "", parser.parse(text).tool_calls)
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run_stream(parser, deltas) == expected, deltas
        assert run_stream(parser, list(text)) == expected, text


def test_hermes_stream_holds_back_only_what_may_be_a_marker() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Hello <tool_ca") == ("Hello", [])  # the space may be trailing, the tail may be a marker
    assert stream.feed('ll>{"name": "f", "arguments": {"a": 1}}') == ("", [])
    assert stream.feed("</tool_call> and") == ("  and", [call("f", a=1)])  # a call as soon as its block closes
    assert stream.feed(" then <b>") == (" then <b>", [])
    assert stream.finish() == ("", [])


def test_hermes_stream_returns_a_malformed_block_as_content_once_it_closes() -> None:
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("<tool_call>{oops}") == ("", [])
    assert stream.feed("</tool_call>!") == ("<tool_call>{oops}</tool_call>!", [])


def test_llama_stream_sends_plain_text_at_once_and_gives_up_on_json_early() -> None:
    parser = get_tool_parser("llama3_json")
    stream = parser.stream()
    assert stream.feed("<|py") == ("", [])
    assert stream.feed("thon_tag|> The") == ("<|python_tag|> The", [])
    stream = parser.stream()
    assert stream.feed('{"answer": 4') == ("", [])
    assert stream.feed("2}") == ('{"answer": 42}', [])  # an object that is not a call
    stream = parser.stream()
    assert stream.feed('{"name": "f", "parameters": {}}') == ("", [])  # calls wait for the end
    assert stream.feed(" O") == ('{"name": "f", "parameters": {}} O', [])  # text after a call
    stream = parser.stream()
    assert stream.feed('{"name": "f", "parameters": {}};') == ("", [])
    assert stream.finish() == ("", [ToolCall("f", "{}")])


def test_mistral_stream_sends_content_before_the_marker_and_calls_at_the_end() -> None:
    stream = get_tool_parser("mistral").stream()
    assert stream.feed("Sure [TOOL") == ("Sure", [])
    assert stream.feed('_CALLS]f[ARGS]{"a": 1}') == ("", [])
    assert stream.finish() == ("", [call("f", a=1)])


def test_only_mistral_needs_special_tokens() -> None:
    assert {name: cls.needs_special_tokens for name, cls in PARSERS.items()} == {
        "hermes": False,
        "llama3_json": False,
        "mistral": True,
    }


def test_parsers_are_registered_by_name_and_unknown_names_are_refused() -> None:
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]
    for name, cls in PARSERS.items():
        assert isinstance(get_tool_parser(name), cls) and cls.name == name
    with pytest.raises(ValueError, match=r"'pythonic'.*hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


def test_results_are_immutable_values() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        call("f").name = "g"  # type: ignore[misc]
    assert ParsedOutput("a", [call("f")]) == ParsedOutput("a", [call("f")])


def test_each_stream_is_independent() -> None:
    parser = get_tool_parser("hermes")
    first, second = parser.stream(), parser.stream()
    assert first.feed("<tool_call>") == ("", [])
    assert second.feed("plain") == ("plain", [])


@pytest.mark.parametrize(
    ("buf", "marker", "expected"),
    [
        ("ab<x>cd", "<x>", ("ab", "cd", True)),
        ("ab<x", "<x>", ("ab", "<x", False)),
        ("ab<", "<x>", ("ab", "<", False)),
        ("ab", "<x>", ("ab", "", False)),
        ("<<x", "<x>", ("<", "<x", False)),
    ],
)
def test_split_marker(buf: str, marker: str, expected: tuple[str, str, bool]) -> None:
    assert split_marker(buf, marker) == expected


def test_stripper_sends_text_stripped_as_a_whole() -> None:
    stripper = Stripper()
    pushed = ["  ", "\n a", " ", "", "b \n", " c", "  "]
    assert "".join(stripper.push(p) for p in pushed) == "".join(pushed).strip()


def test_forced_calls_hold_arguments_to_the_declared_parameters_only():
    """tool_choice "required" or a named function: the constraint closes every object schema that
    says nothing of other properties (as vLLM's default backend reads schemas), keeps one that
    does, and leaves the request's tools (which the chat template prints) as they were sent."""
    from cpuserve.server.tool_calls import plan_tools

    weather = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        },
    }
    extra = {"type": "object", "properties": {"q": {"type": "string"}}, "additionalProperties": True}
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": weather}},
        {"type": "function", "function": {"name": "search", "parameters": extra}},
    ]
    sent = json.dumps(tools, sort_keys=True)
    named = plan_tools(tools, {"type": "function", "function": {"name": "get_weather"}}, None, None, False)
    schema = json.loads(named.constraint.value)
    assert schema["additionalProperties"] is False and schema["properties"]["where"]["additionalProperties"] is False
    required = json.loads(plan_tools(tools, "required", None, None, False).constraint.value)
    params = {
        item["properties"]["name"]["const"]: item["properties"]["parameters"] for item in required["items"]["anyOf"]
    }
    assert params["get_weather"] == schema and params["search"]["additionalProperties"] is True
    assert json.dumps(tools, sort_keys=True) == sent


def test_closing_objects_leaves_the_members_of_an_all_of_open():
    """An intersection (allOf) of two object schemas: each member closed alone would forbid the
    other's property, so only objects outside an allOf are closed."""
    from cpuserve.server.structured import close_objects

    a = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}
    nested = {"type": "object", "properties": {"x": {"allOf": [a, b]}, "y": dict(a)}}
    closed = close_objects(nested)
    assert closed["additionalProperties"] is False and closed["properties"]["y"]["additionalProperties"] is False
    assert all("additionalProperties" not in m for m in closed["properties"]["x"]["allOf"])
    assert "additionalProperties" not in a and "additionalProperties" not in b  # the caller's schema untouched
    ruled = close_objects({"type": "object", "properties": {"q": {}}, "unevaluatedProperties": False})
    assert "additionalProperties" not in ruled
