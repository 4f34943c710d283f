"""POST /v1/responses on a real server of the bundled model, driven through the official `openai`
client (`client.responses.create` / `client.responses.stream`): greedy answers equal the chat
completion of the same request, the stream's events come in the documented order, structured and
tool outputs validate, and what the server cannot honour (state, built-in tools, ...) is a 400."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.smol_server import smol_server

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-responses"
MODEL = "smol"
QUESTION = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@contextlib.contextmanager
def bundled_server(smol_dir: Path, cache_dir: Path, log: Path, key: str) -> Iterator[str]:
    """smol_server under `key`; its log must hold no traceback afterwards (the Messages API tests use it too)."""
    with smol_server(smol_dir, cache_dir, log, key=key) as base:
        yield base
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir, tmp_path_factory):
    with bundled_server(smol_dir, cache_dir, tmp_path_factory.mktemp("responses") / "server.log", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_answer(client, messages, max_tokens, **extra):
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **extra)
    return r.choices[0].message.content, r.usage


def streamed(client, **kwargs):
    """The events of `client.responses.stream(...)` and its final response."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_response()


def assert_well_formed(r, status="completed"):
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == status and r.store is False  # nothing is stored, whatever was asked
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the details OpenAI always sends: no reasoning from this model; cached: what the prefix cache held
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert 0 <= r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    for item in r.output:
        assert item.type in ("message", "function_call") and item.status == status
    assert r.output[0].id.startswith("msg_" if r.output[0].type == "message" else "fc_")


def test_a_string_input_answers_what_chat_answers(client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=40)
    text, usage = chat_answer(client, [{"role": "user", "content": QUESTION}], 40)
    assert_well_formed(r)
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    assert [part.type for part in r.output[0].content] == ["output_text"]
    assert r.output_text == text and "Paris" in text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.incomplete_details is None and r.temperature == 0 and r.max_output_tokens == 40


def test_items_and_instructions_answer_what_chat_answers(client):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi! How can I help?"}]},
        {"role": "user", "content": QUESTION},
    ]
    r = client.responses.create(
        model=MODEL, input=items, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=30
    )
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": QUESTION},
    ]
    text, usage = chat_answer(client, messages, 30)
    assert_well_formed(r)
    assert r.output_text == text and r.instructions == INSTRUCTIONS
    assert r.usage.input_tokens == usage.prompt_tokens
    # `developer` is OpenAI's newer name for `system`
    dev = client.responses.create(
        model=MODEL,
        input=[{"role": "developer", "content": INSTRUCTIONS}, *items],
        temperature=0,
        max_output_tokens=30,
    )
    assert dev.output_text == text


def test_function_call_items_are_the_chat_tool_history(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather"}
    call["arguments"] = json.dumps({"city": "Paris", "unit": "celsius"})
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 degrees"},
    ]
    r = client.responses.create(
        model=MODEL, input=items, tools=TOOLS, tool_choice="none", temperature=0, max_output_tokens=30
    )
    tool_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": call["arguments"]},
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
    ]
    text, usage = chat_answer(client, messages, 30, tools=CHAT_TOOLS, tool_choice="none")
    assert_well_formed(r)
    assert r.output_text == text and r.usage.input_tokens == usage.prompt_tokens
    assert [t.name for t in r.tools] == ["get_weather"] and r.tool_choice == "none"


def test_the_stream_sends_the_documented_events_and_ends_with_the_non_streamed_response(client):
    kwargs = dict(model=MODEL, input=QUESTION, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=40)
    full = client.responses.create(**kwargs)
    events, final = streamed(client, **kwargs)
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(deltas) == full.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")} | {events[2].item.id}
    assert item_ids == {final.output[0].id}
    assert final.output_text == full.output_text and final.status == "completed"
    assert final.id == events[0].response.id and final.usage.output_tokens == full.usage.output_tokens


def test_the_stream_is_sse_with_event_lines_and_no_done_marker(server):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/responses", json=body, headers=headers, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]
    assert "[DONE]" not in r.text


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = client.responses.create(model=MODEL, input="Count from 1 to 100.", temperature=0, max_output_tokens=3)
    assert_well_formed(r, "incomplete")
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 3
    stream = client.responses.create(
        model=MODEL, input="Count from 1 to 100.", temperature=0, max_output_tokens=3, stream=True
    )
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    assert events[-1].response.output_text == r.output_text


def test_a_json_schema_text_format_gives_valid_json(client):
    schema = {
        "type": "object",
        # Bounded, so any sample (temperature 1 included, on whichever host's numerics) ends well within the
        # token budget: the test is about validity, not about how long a name the model invents.
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    for temperature in (0, 1):
        r = client.responses.create(
            model=MODEL, input="Make up a person.", text={"format": fmt}, temperature=temperature, max_output_tokens=80
        )
        assert_well_formed(r)
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text.format.type == "json_schema"
    r = client.responses.create(
        model=MODEL,
        input="Give me a JSON object with a name and an age.",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=100,
    )
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


def test_a_named_function_tool_choice_gives_a_valid_function_call(client):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    r = client.responses.create(**kwargs)
    assert_well_formed(r)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    events, final = streamed(client, **kwargs)
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == final.output[0].arguments == call.arguments  # greedy: the same call
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"


def test_previous_response_id_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123", max_output_tokens=4)
    assert err.value.status_code == 400
    assert err.value.body["message"] == "previous_response_id is not supported: this server keeps no state"
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"extra_body": {"background": True}}, "background"),
        ({"extra_body": {"truncation": "auto"}}, "truncation"),
        ({"extra_body": {"conversation": "conv_1"}}, "conversation"),
        ({"extra_body": {"include": ["message.output_text.logprobs"]}}, "include"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"extra_body": {"seed": 7}}, "seed"),  # a name nothing here reads (OpenAI: "Unknown parameter")
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_would_change_the_answer_and_is_not_honoured_is_a_400_naming_it(client, fields, param):
    kwargs = {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "user": "u1", **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kwargs)
    assert err.value.body["param"] == param


def test_store_is_accepted_but_never_claimed(client):
    for store in (True, False, None):
        extra = {} if store is None else {"store": store}
        harmless = {"reasoning": {"effort": None}, "truncation": "disabled", "include": [], "background": False}
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, extra_body=harmless, **extra)
        assert r.store is False and r.previous_response_id is None
