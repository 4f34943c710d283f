"""POST /v1/responses: OpenAI's Responses API, run as a chat completion (chat.py's prepare_chat).

`instructions` become a system message first, input items chat messages (function_call items an
assistant's tool_calls, function_call_output items "tool" messages, `developer` is `system`), tools,
tool_choice and `text.format` their chat spellings. The message comes back as output items
(`reasoning` with a reasoning parser, `message` with `output_text`, `function_call`), streamed as the
numbered events `client.responses.stream()` consumes, each on an `event:` line.

Stateless: nothing is stored whatever `store` says (absent, false, true: all accepted, and every
response says `"store": false`), so `previous_response_id` and `conversation` are refused, as is any
field that would change the answer and is not honoured (reasoning effort, built-in tools, background).
`reasoning` items sent back as input are dropped, as chat templates drop them. The message as
blocks, and the run itself, are message_blocks.py's (shared with anthropic_messages.py).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from cpuserve.engine import InvalidRequest
from cpuserve.server.chat import ChatRun, chat_request, join_text, prepare_chat
from cpuserve.server.errors import ENGINE_ERRORS, APIError, api_error
from cpuserve.server.message_blocks import Block, Merged, Outcome, block_stream, refuse_unhonoured, serve_run
from cpuserve.server.protocol import ChatCompletionRequest, refuse_unrecognized
from cpuserve.server.state import Server

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
PART_KINDS = ("input_text", "output_text", "text")
STATELESS = "previous_response_id is not supported: this server keeps no state"
# Fields that would change the answer and are not honoured: a request that asks for any is refused.
NOT_HONOURED = (
    *("conversation", "background", "reasoning", "include", "prompt", "top_logprobs", "max_tool_calls"),
    *("truncation", "text.verbosity"),
)
# Undeclared names a request may carry: those above, and OpenAI's metadata that changes nothing in the
# answer. Any other is refused, as OpenAI refuses an unknown parameter.
KNOWN_EXTRAS = frozenset(
    {*NOT_HONOURED, "user", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"}
    | {"stream_options"}
)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so NOT_HONOURED can see what was sent

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None  # accepted whatever it says: nothing is ever stored
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request asks for (400 naming what cannot be mapped)."""
    if req.previous_response_id is not None:
        raise APIError(400, STATELESS, param="previous_response_id")
    text = req.text or {}
    verbosity = text.get("verbosity") if text.get("verbosity") != "medium" else None  # medium: the default
    refuse_unrecognized(req.model_extra, KNOWN_EXTRAS)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequest("max_output_tokens", f"must be at least 1, got {req.max_output_tokens}")
    given = {**(req.model_extra or {}), "reasoning": req.reasoning, "text.verbosity": verbosity}
    refuse_unhonoured(given, NOT_HONOURED)
    fmt = text.get("format")
    return chat_request(
        "input",
        **req.model_dump(include={"model", "temperature", "top_p", "parallel_tool_calls"}),
        messages=_messages(req),
        max_tokens=req.max_output_tokens,
        tools=[_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=_tool_choice(req.tool_choice),
        response_format=_response_format(fmt) if fmt is not None else None,
    )


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        kind, param = item.get("type", "message"), f"input[{i}]"
        field = lambda name, item=item, param=param: _string(item, name, param)  # noqa: E731
        if kind == "message":
            role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
            if role is None:
                raise InvalidRequest(param, f"role {item.get('role')!r} is not user, assistant, system or developer")
            out.append({"role": role, "content": join_text(item.get("content"), f"{param}.content", PART_KINDS)})
        elif kind == "function_call":
            call = {"id": field("call_id"), "type": "function", "function": {"name": field("name")}}
            call["function"]["arguments"] = field("arguments")
            if out and out[-1]["role"] == "assistant":  # calls after an assistant message are part of it
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = join_text(item.get("output"), f"{param}.output", PART_KINDS)
            out.append({"role": "tool", "tool_call_id": field("call_id"), "content": output})
        elif kind != "reasoning":
            raise InvalidRequest(param, f"input items of type {kind!r} are not supported (this server keeps no state)")
    if not out:
        raise InvalidRequest("input", "must hold at least one message")
    return out


def _string(item: dict[str, Any], name: str, param: str) -> str:
    if not isinstance(item.get(name), str):
        raise InvalidRequest(param, f"a {item.get('type')} item needs a string {name!r}")
    return item[name]


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest("tools", f"tool {i} is of type {tool.get('type')!r}: only function tools are supported")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "name"}')
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(fmt: Any) -> dict[str, Any] | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest("text.format", "must be of type text, json_object or json_schema")


async def create_response(server: Server, request: Request, req: ResponsesRequest) -> Response:
    run = await prepare_chat(server, to_chat(req), f"resp_{uuid.uuid4().hex}")
    return await serve_run(
        server, request, run, req.stream, partial(_events, server, run, req), partial(_response, server, run, req)
    )


def _item(block: Block, done: bool = True) -> dict[str, Any]:
    """The output item of a block (as it starts if not `done`)."""
    status = ("completed" if block.complete else "incomplete") if done else "in_progress"
    if block.kind == "call":
        item = {"id": f"fc_{block.key}", "type": "function_call", "status": status, "call_id": block.call_id}
        return {**item, "name": block.name, "arguments": block.text if done else ""}
    content = [_part(block)] if done else []
    if block.kind == "reasoning":
        return {"id": f"rs_{block.key}", "type": "reasoning", "status": status, "summary": [], "content": content}
    return {"id": f"msg_{block.key}", "type": "message", "status": status, "role": "assistant", "content": content}


def _part(block: Block, text: str | None = None) -> dict[str, Any]:
    text = block.text if text is None else text
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(server: Server, run: ChatRun, req: ResponsesRequest, outcome: Outcome | None) -> dict[str, Any]:
    """The response object: in progress (no outcome yet), completed, or incomplete (cut by max tokens)."""
    fmt = (req.text or {}).get("format") or {"type": "text"}
    body: dict[str, Any] = {
        "id": run.rid,
        "object": "response",
        "created_at": run.created,
        "status": "in_progress",
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "model": server.model_name,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "store": False,
        "temperature": run.params.temperature,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice or "auto",  # OpenAI's default, tools or not
        "tools": req.tools or [],
        "top_p": run.params.top_p,
        "usage": None,
    }
    if outcome is not None:
        cut = outcome.finish_reason == "length"
        body["status"] = "incomplete" if cut else "completed"
        body["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
        body["output"] = [_item(b) for b in outcome.parts]
        n_in, n_out = len(run.ids), outcome.output_tokens
        body["usage"] = {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
            "output_tokens": n_out,
            "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
            "total_tokens": n_in + n_out,
        }
    return body


async def _events(server: Server, run: ChatRun, req: ResponsesRequest, merged: Merged) -> AsyncIterator[dict[str, Any]]:
    numbers = itertools.count()

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(numbers), **fields}

    start = _response(server, run, req, None)
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    try:
        async for step in block_stream(server, run, merged):
            if isinstance(step, Outcome):
                final = _response(server, run, req, step)
                yield event(f"response.{final['status']}", response=final)  # completed or incomplete
            else:
                for kind, fields in _block_events(*step):
                    yield event(kind, output_index=step[1].index, **fields)
    except (*ENGINE_ERRORS, APIError) as exc:
        err = api_error(exc)
        yield event("error", code=str(err.code or err.status), message=err.message, param=err.param)


def _block_events(action: str, block: Block, piece: str) -> list[tuple[str, dict[str, Any]]]:
    """The Responses events (name, fields but the output index) of one step of a block."""
    item_id = _item(block, done=False)["id"]
    if block.kind == "call":
        if action == "open":
            return [("response.output_item.added", {"item": _item(block, done=False)})]
        if action == "delta":
            return [("response.function_call_arguments.delta", {"item_id": item_id, "delta": piece})]
        done = {"item_id": item_id, "arguments": block.text, "name": block.name}
        return [("response.function_call_arguments.done", done), ("response.output_item.done", {"item": _item(block)})]
    where = {"item_id": item_id, "content_index": 0}
    text_event = "response.output_text" if block.kind == "text" else "response.reasoning_text"
    if action == "open":
        added = ("response.content_part.added", {**where, "part": _part(block, "")})
        return [("response.output_item.added", {"item": _item(block, done=False)}), added]
    logprobs = {"logprobs": []} if block.kind == "text" else {}
    if action == "delta":
        return [(f"{text_event}.delta", {**where, "delta": piece, **logprobs})]
    return [
        (f"{text_event}.done", {**where, "text": block.text, **logprobs}),
        ("response.content_part.done", {**where, "part": _part(block)}),
        ("response.output_item.done", {"item": _item(block)}),
    ]
