"""POST /v1/messages (Anthropic's Messages API) on a real server of the bundled model, driven through
the official `anthropic` client: greedy answers equal the chat completion of the same request, the
stream's final message equals the non-streamed one, a forced tool's input validates, the key is
taken from `x-api-key`, and errors come in Anthropic's shape to Anthropic clients."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_responses_api import MODEL, bundled_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEY = "test-key-messages"
SYSTEM = "Answer in one short sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # this SDK version has no temperature argument; the API takes it
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    }
]
ARGS, RESULT = {"city": "Paris", "unit": "celsius"}, "Sunny, 21 degrees"
ANTHROPIC_HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server(smol_dir, cache_dir, tmp_path_factory):
    with bundled_server(smol_dir, cache_dir, tmp_path_factory.mktemp("messages") / "server.log", KEY) as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat_answer(chat, messages, max_tokens, **extra):
    r = chat.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, **extra)
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def assert_well_formed(m):
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0


def test_create_with_a_system_prompt_answers_what_chat_answers(client, chat):
    m = client.messages.create(model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, **GREEDY)
    text, finish, usage = chat_answer(chat, [{"role": "system", "content": SYSTEM}, *QUESTION], 40)
    assert_well_formed(m)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text and "Paris" in text
    assert finish == "stop" and m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = m.usage.input_tokens + m.usage.cache_read_input_tokens  # uncached + cached: the whole prompt
    assert (prompt, m.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    blocks = client.messages.create(
        model=MODEL, max_tokens=40, system=[{"type": "text", "text": SYSTEM}], messages=QUESTION, **GREEDY
    )
    assert blocks.content[0].text == text  # system as text blocks: the same prompt


def test_stop_sequences_stop_the_answer_and_are_named(client, chat):
    m = client.messages.create(
        model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, stop_sequences=["Paris"], **GREEDY
    )
    text, _, _ = chat_answer(chat, [{"role": "system", "content": SYSTEM}, *QUESTION], 40, stop=["Paris"])
    assert m.content[0].text == text and "Paris" not in text
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"


def test_max_tokens_cuts_the_answer(client):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, **GREEDY)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_the_stream_ends_with_the_non_streamed_message(client):
    kwargs = dict(model=MODEL, max_tokens=40, system=SYSTEM, messages=QUESTION, **GREEDY)
    full = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [e.type for e in events if e.type not in ("text", "input_json")]  # the SDK's own derived events left out
    deltas = raw.count("content_block_delta")
    assert deltas > 1
    assert raw == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].text == full.content[0].text == "".join(e.text for e in events if e.type == "text")
    assert (final.stop_reason, final.stop_sequence) == (full.stop_reason, full.stop_sequence)
    assert (final.usage.input_tokens, final.usage.output_tokens) == (full.usage.input_tokens, full.usage.output_tokens)
    assert final.id == events[0].message.id and events[0].message.content == []


def test_the_stream_is_sse_with_event_lines_and_a_ping(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "stream": True}
    r = httpx.post(server + "/v1/messages", json=body, headers=ANTHROPIC_HEADERS, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = []
    for block in (b for b in r.text.split("\n\n") if b.strip()):
        event_line, data_line = block.split("\n")
        names.append(event_line.removeprefix("event: "))
        assert names[-1] == json.loads(data_line.removeprefix("data: "))["type"]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop" and "[DONE]" not in r.text


def test_a_forced_tool_gives_a_tool_use_block_whose_input_validates(client):
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        **GREEDY,
    )
    m = client.messages.create(**kwargs)
    assert_well_formed(m)
    [block] = m.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    # the prompt tokens the prefix cache served, as Anthropic's cache reads (the same prompt again: all
    # its whole blocks)
    again = client.messages.create(**kwargs)
    assert again.usage.cache_creation_input_tokens == 0 and again.usage.cache_read_input_tokens > 0
    # the counts do not overlap: uncached input + cache reads = the whole prompt
    prompt = client.messages.count_tokens(**{k: v for k, v in kwargs.items() if k not in ("max_tokens", "extra_body")})
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == prompt.input_tokens
    jsonschema.validate(block.input, WEATHER)
    assert m.stop_reason == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        raw = [e.type for e in stream if e.type != "input_json"]
        final = stream.get_final_message()
    assert raw[1] == "content_block_start" and "content_block_delta" in raw
    assert final.content[0].type == "tool_use" and final.content[0].input == block.input
    assert final.stop_reason == "tool_use"


def test_a_tool_history_is_the_chat_tool_history(client, chat):
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    m = client.messages.create(
        model=MODEL, max_tokens=30, messages=messages, tools=TOOLS, tool_choice={"type": "none"}, **GREEDY
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}
    chat_messages = [
        messages[0],
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": RESULT},
    ]
    text, _, usage = chat_answer(chat, chat_messages, 30, tools=CHAT_TOOLS, tool_choice="none")
    assert m.content[0].text == text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens


def test_the_key_is_taken_from_x_api_key_and_a_wrong_one_is_a_401(server, client):
    ok = httpx.post(
        server + "/v1/messages", json={"max_tokens": 2, "messages": QUESTION}, headers=ANTHROPIC_HEADERS, timeout=120
    )
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
    assert err.value.status_code == 401  # answered by the auth middleware, before any route: OpenAI-style body


def test_a_missing_max_tokens_is_a_400_in_anthropic_shape(server):
    body = {"model": MODEL, "messages": QUESTION}
    r = httpx.post(server + "/v1/messages", json=body, headers=ANTHROPIC_HEADERS, timeout=60)
    assert r.status_code == 400
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]
    plain = httpx.post(server + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"  # not an Anthropic client


@pytest.mark.parametrize(
    ("fields", "status", "kind"),
    [
        ({"model": "claude-nonexistent"}, 404, "not_found_error"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error"),
        ({"extra_body": {"frobnicate": 1}}, 400, "invalid_request_error"),  # "Extra inputs are not permitted"
        ({"extra_body": {"temperature": 1.5}}, 400, "invalid_request_error"),  # Anthropic range: 0 to 1
        (
            {"extra_body": {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}},
            400,
            "invalid_request_error",
        ),
    ],
)
def test_what_cannot_be_served_is_an_anthropic_error(client, fields, status, kind):
    kwargs = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, **fields}
    with pytest.raises(anthropic.APIStatusError) as err:
        client.messages.create(**kwargs)
    assert err.value.status_code == status
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == kind


def test_a_final_assistant_message_is_continued(client, chat):
    """Anthropic's prefill: the reply goes on from the final assistant message's text, the same
    tokens as the chat completion told to continue it (continue_final_message)."""
    messages = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    m = client.messages.create(model=MODEL, max_tokens=8, messages=messages, **GREEDY)
    text, _, usage = chat_answer(chat, messages, 8, extra_body={"continue_final_message": True})
    assert m.content[0].text == text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage.prompt_tokens
    assert "Paris" in text


def test_count_tokens_is_the_prompt_the_message_is_served_with(client, server):
    """Anthropic's /v1/messages/count_tokens: the same prompt as the message's usage counts (its
    uncached input tokens plus its cache reads)."""
    kwargs = {"model": MODEL, "system": SYSTEM, "messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "any"}}
    counted = client.messages.count_tokens(**kwargs)
    served = client.messages.create(max_tokens=2, **kwargs, **GREEDY)
    assert counted.input_tokens == served.usage.input_tokens + served.usage.cache_read_input_tokens > 0
    r = httpx.post(f"{server}/v1/messages/count_tokens", json={"messages": []}, headers=ANTHROPIC_HEADERS, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_only_context_edits_that_change_the_prompt_are_refused():
    """Claude Code's clear_thinking edits change nothing here (past thinking is dropped anyway)."""
    from cpuserve.server.anthropic_messages import _prompt_edits

    tools = {"type": "clear_tool_uses_20250919"}
    assert _prompt_edits({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}) == []
    assert _prompt_edits({"edits": [{"type": "clear_thinking_20251015"}, tools]}) == [tools]
    assert _prompt_edits(None) == [] and _prompt_edits("x") == []
