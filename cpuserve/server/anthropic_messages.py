"""POST /v1/messages: Anthropic's Messages API, run as a chat completion.

The request becomes a ChatCompletionRequest: `system` a system message first, text blocks joined,
`tool_use` blocks an assistant's tool_calls and `tool_result` blocks role "tool" messages, tools
and tool_choice their chat spellings (`any` is `required`), `stop_sequences` the stops and
`output_config.format` a json_schema response_format. The chat message comes back as content
blocks (`thinking` when the server runs a reasoning parser, `text`, `tool_use`), streamed as
Anthropic's events with `event:` lines. A field that would change the answer and is not honoured
(extended thinking, server tools, an effort, an assistant prefill) is a 400 naming it.

Errors: a client speaking Anthropic's protocol (it sends `anthropic-version`, as every Anthropic
SDK does) gets Anthropic's error body, `{"type": "error", "error": {"type", "message"}}`, from
every error this route raises (AnthropicErrors reshapes what the app's handlers answer); others
get the server's OpenAI-style body. A missing or wrong key is answered by the auth middleware
before any route runs, so that 401 (and a 413 for a body over the size limit) is OpenAI-style.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field

from cpuserve.engine import InvalidRequest
from cpuserve.server.chat import ChatRun, chat_prompt, chat_request, join_text, prepare_chat
from cpuserve.server.errors import ENGINE_ERRORS, APIError, api_error
from cpuserve.server.message_blocks import Block, Merged, Outcome, block_stream, refuse_unhonoured, serve_run
from cpuserve.server.protocol import ChatCompletionRequest, refuse_unrecognized
from cpuserve.server.state import Server

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicErrors(APIRoute):
    """A route whose errors reach an Anthropic client in Anthropic's shape: the app's own handler
    answers (status, message, headers such as Retry-After), and its body is rewrapped."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                if "anthropic-version" not in request.headers:
                    raise
                handlers = request.app.exception_handlers
                answer = next(handlers[c] for c in type(exc).__mro__ if c in handlers)
                response = await answer(request, exc)
                message = json.loads(response.body)["error"]["message"]
                body = {"type": "error", "error": {"type": error_type(response.status_code), "message": message}}
                shaped = JSONResponse(body, status_code=response.status_code)
                if "retry-after" in response.headers:
                    shaped.headers["Retry-After"] = response.headers["retry-after"]
                return shaped

        return route


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


# Fields that would change the answer and are not honoured: a request that asks for any is refused.
NOT_HONOURED = ("thinking", "mcp_servers", "container", "context_management.tool_uses", "output_config.effort")
# Undeclared names a request may carry: those above, output_config and context_management (read
# below), and what changes nothing in the answer (service_tier, inference_geo, a top-level
# cache_control: the prefix cache reuses every prompt's blocks anyway). Any other is refused, as
# Anthropic refuses an extra input.
KNOWN_EXTRAS = frozenset(
    {*NOT_HONOURED, "output_config", "context_management", "service_tier", "inference_geo", "cache_control"}
)


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, so NOT_HONOURED can see what was sent

    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens (Claude Code asks it
    before sending a long conversation)."""

    max_tokens: int = 1


async def count_tokens(server: Server, req: CountTokensRequest) -> dict[str, int]:
    """The prompt tokens the request would be served with: its chat prompt, tools included."""
    chat = to_chat(req)
    server.check_model(chat.model)
    return {"input_tokens": len(await chat_prompt(server, chat))}


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request a Messages request asks for (400 naming what cannot be mapped)."""
    extras = req.model_extra or {}
    refuse_unrecognized(extras, KNOWN_EXTRAS)
    if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
        raise InvalidRequest("temperature", f"must be between 0 and 1 (Anthropic's range), got {req.temperature}")
    config = extras.get("output_config") or {}
    if not isinstance(config, dict):
        raise InvalidRequest("output_config", "must be an object")
    given = {
        **extras,
        "output_config.effort": config.get("effort"),
        "context_management.tool_uses": _prompt_edits(extras.get("context_management")),
    }
    refuse_unhonoured(given, NOT_HONOURED)
    fmt = config.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "json_schema"):
        raise InvalidRequest("output_config.format", "must be of type json_schema")
    choice, parallel = _tool_choice(req.tool_choice)
    prefill = req.messages[-1].role == "assistant"  # the reply continues it (Anthropic's prefill)
    return chat_request(
        "messages",
        **req.model_dump(include={"model", "max_tokens", "temperature", "top_p", "top_k"}),
        messages=_messages(req),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        stop=req.stop_sequences,
        tools=[_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format={"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}} if fmt else None,
    )


def _prompt_edits(management: Any) -> list[Any]:
    """The context-management edits that would change the prompt. Claude Code sends clear_thinking
    edits, which change nothing here (past thinking is dropped from the prompt anyway); a
    clear_tool_uses edit would."""
    edits = management.get("edits") if isinstance(management, dict) else None
    return [e for e in edits or [] if not (isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking"))]


def _messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": join_text(req.system, "system", ("text",))})
    for i, m in enumerate(req.messages):
        param = f"messages[{i}].content"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
        texts, calls = [], []
        for block in blocks:
            kind = block.get("type")
            if kind == "tool_result" and m.role == "user":
                content = join_text(block.get("content", ""), param, ("text",))
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
            elif kind == "tool_use" and m.role == "assistant":
                arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
                calls.append({"id": block.get("id"), "type": "function", "function": {"name": block.get("name")}})
                calls[-1]["function"]["arguments"] = arguments
            elif kind not in ("thinking", "redacted_thinking") or m.role != "assistant":  # past thinking: dropped
                texts.append(join_text([block], param, ("text",)))
        message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts) if texts or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if texts or calls or not any(b.get("type") == "tool_result" for b in blocks):
            out.append(message)
    return out


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise InvalidRequest("tools", f"tool {i} is of type {tool['type']!r}: only custom tools are supported")
    fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequest("tool_choice", 'must be of type "auto", "any", "none" or "tool" (with a name)')


async def create_message(server: Server, request: Request, req: MessagesRequest) -> Response:
    run = await prepare_chat(server, to_chat(req), f"msg_{uuid.uuid4().hex}")
    return await serve_run(
        server, request, run, req.stream, partial(_events, server, run), partial(_message, server, run)
    )


def _stop(outcome: Outcome) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice."""
    called = any(b.kind == "call" for b in outcome.parts)  # a forced tool's finish is "stop" in chat
    if outcome.finish_reason == "tool_calls" or (called and outcome.finish_reason == "stop"):
        return "tool_use", None
    if outcome.finish_reason == "length":
        return "max_tokens", None
    if isinstance(outcome.stop_reason, str):
        return "stop_sequence", outcome.stop_reason
    return "end_turn", None


def _block(block: Block, done: bool = True) -> dict[str, Any]:
    """The content block of a block (as it starts if not `done`)."""
    if block.kind == "call":
        try:
            arguments = json.loads(block.text) if done else {}
        except json.JSONDecodeError:  # cut by max_tokens
            arguments = {}
        tool_id = "toolu_" + (block.call_id or "").removeprefix("call_")  # Anthropic's id prefix
        return {"type": "tool_use", "id": tool_id, "name": block.name, "input": arguments}
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text if done else "", "signature": ""}
    return {"type": "text", "text": block.text if done else ""}


def _message(server: Server, run: ChatRun, outcome: Outcome | None) -> dict[str, Any]:
    """The message object: as it starts (no outcome yet, no content) or whole."""
    stop_reason, stop_sequence = _stop(outcome) if outcome is not None else (None, None)
    return {
        "id": run.rid,
        "type": "message",
        "role": "assistant",
        "model": server.model_name,
        "content": [_block(b) for b in outcome.parts] if outcome is not None else [],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(run, outcome),
    }


def _usage(run: ChatRun, outcome: Outcome | None) -> dict[str, int]:
    """Anthropic's usage: the prompt tokens the prefix cache served are its cache reads, the rest its
    input tokens (nothing is written to a cache on request here)."""
    cached = outcome.cached_tokens if outcome else 0
    return {  # Anthropic's three input counts do not overlap: clients add them up for the prompt's size
        "input_tokens": len(run.ids) - cached,
        "output_tokens": outcome.output_tokens if outcome else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


DELTAS = {
    "text": ("text_delta", "text"),
    "reasoning": ("thinking_delta", "thinking"),
    "call": ("input_json_delta", "partial_json"),
}


async def _events(server: Server, run: ChatRun, merged: Merged) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "message_start", "message": _message(server, run, None)}
    yield {"type": "ping"}
    try:
        async for step in block_stream(server, run, merged):
            if isinstance(step, Outcome):
                stop_reason, stop_sequence = _stop(step)
                usage = _usage(run, step)
                yield {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage,
                }
                yield {"type": "message_stop"}
                continue
            action, block, piece = step
            if action == "open":
                yield {"type": "content_block_start", "index": block.index, "content_block": _block(block, done=False)}
            elif action == "delta":
                kind, name = DELTAS[block.kind]
                yield {"type": "content_block_delta", "index": block.index, "delta": {"type": kind, name: piece}}
            else:
                if block.kind == "reasoning":  # no signature: a thinking block of this server's own
                    delta = {"type": "signature_delta", "signature": ""}
                    yield {"type": "content_block_delta", "index": block.index, "delta": delta}
                yield {"type": "content_block_stop", "index": block.index}
    except (*ENGINE_ERRORS, APIError) as exc:
        err = api_error(exc)
        yield {"type": "error", "error": {"type": error_type(err.status), "message": err.message}}
