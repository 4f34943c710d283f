"""A chat run's assistant message as blocks (text, reasoning, each tool call), opened, grown and
closed as the choice streams, and a one-choice run served streamed or whole: what the Responses
API (responses.py) and Anthropic's Messages API (anthropic_messages.py) share, each shaping the
blocks into its own items and events. Also their check of fields they do not honour."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from cpuserve.engine import InvalidRequest, RequestOutput
from cpuserve.server import streaming
from cpuserve.server.chat import ChatRun, chat_message, choice_deltas
from cpuserve.server.state import Server

Merged = AsyncIterator[tuple[int, RequestOutput]]
Events = Callable[[Merged], AsyncIterator[dict[str, Any]]]  # the API's events of a streamed run


@dataclasses.dataclass
class Block:
    """One part of an assistant message: its text, its reasoning, or one tool call (`text`: the arguments)."""

    kind: str  # "text" | "reasoning" | "call"
    index: int
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    complete: bool = True  # False: generation was cut (max tokens) inside this block
    key: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


Step = tuple[str, Block, str]  # ("open" | "delta" | "close", the block, the new text)


class Blocks:
    """A choice's message fragments (chat.py's stream deltas) as blocks, opened, grown and closed in order."""

    def __init__(self) -> None:
        self.parts: list[Block] = []
        self.open: Block | None = None

    def feed(self, fragment: dict[str, Any]) -> list[Step]:
        steps: list[Step] = []
        if fragment.get("reasoning_content"):
            steps += self._add("reasoning", fragment["reasoning_content"])
        if fragment.get("content"):
            steps += self._add("text", fragment["content"])
        for call in fragment.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a call's head: its own block
                steps += self._open("call", call_id=call["id"], name=fn.get("name"))
            if fn.get("arguments"):
                steps += self._add("call", fn["arguments"])
        return steps

    def finish(self, cut: bool) -> list[Step]:
        """Close the last block (an empty text block if there was none), marked incomplete if `cut`."""
        steps = [] if self.parts else self._open("text")
        if self.open is not None:
            self.open.complete = not cut
        return steps + self._close()

    def _add(self, kind: str, piece: str) -> list[Step]:
        steps = [] if self.open is not None and self.open.kind == kind else self._open(kind)
        assert self.open is not None
        self.open.text += piece
        return [*steps, ("delta", self.open, piece)]

    def _open(self, kind: str, **fields: Any) -> list[Step]:
        steps = self._close()
        self.open = Block(kind, len(self.parts), **fields)
        self.parts.append(self.open)
        return [*steps, ("open", self.open, "")]

    def _close(self) -> list[Step]:
        block, self.open = self.open, None
        return [] if block is None else [("close", block, "")]


@dataclasses.dataclass
class Outcome:
    """A finished choice: its blocks, why it ended (chat's finish reason, "tool_calls" included) and its length."""

    parts: list[Block]
    finish_reason: str | None
    stop_reason: int | str | None
    output_tokens: int
    cached_tokens: int = 0  # of the prompt, found in the prefix cache
    reasoning_tokens: int = 0  # its reasoning text's tokens (re-encoded: a reasoning parser splits text)


async def _reasoning_tokens(server: Server, parts: list[Block]) -> int:
    """The tokens of the blocks' reasoning text, encoded on the tokenizer pool (not the event loop)."""
    thought = "".join(b.text for b in parts if b.kind == "reasoning")
    return len(await server.tokens.encode(thought, add_special_tokens=False)) if thought else 0


Body = Callable[[Outcome], dict[str, Any]]  # the API's answer to a run done


def message_blocks(message: dict[str, Any], cut: bool) -> list[Block]:
    """A whole chat message (chat_message's) as blocks: reasoning, text, then each tool call."""
    blocks = Blocks()
    blocks.feed(message)
    blocks.finish(cut)
    return blocks.parts


async def block_stream(server: Server, run: ChatRun, merged: Merged) -> AsyncIterator[Step | Outcome]:
    """A streamed run's blocks as they open, grow and close; its Outcome last."""
    blocks, last = Blocks(), None
    async for d in choice_deltas(server, run, merged):
        last = d
        for fragment in d.deltas:
            for step in blocks.feed(fragment):
                yield step
    finish = last.finish_reason if last else None
    for step in blocks.finish(cut=finish == "length"):
        yield step
    tokens = len(last.out.outputs[0].token_ids) if last else 0
    cached = last.out.num_cached_tokens if last else 0
    thought = await _reasoning_tokens(server, blocks.parts)
    yield Outcome(blocks.parts, finish, last.stop_reason if last else None, tokens, cached, thought)


def event_stream(events: AsyncIterator[dict[str, Any]]) -> Response:
    """Server-sent events, each named by its `type` (an `event:` line) and with no `[DONE]` after the last."""

    async def body() -> AsyncIterator[bytes]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def serve_run(
    server: Server, request: Request, run: ChatRun, stream: bool, events: Events, body: Body
) -> Response:
    """Run a one-choice chat: its `events` streamed, or its `body` once it is done (499: the client left)."""
    if stream:
        return event_stream(events(streaming.merge(server, await streaming.start(server, run.jobs, request))))
    finals = await streaming.collect(server, request, run.jobs)
    if finals is None:
        return Response(status_code=499)
    o = finals[0].outputs[0]
    message, finish = chat_message(run, o.text, o.finish_reason)
    blocks = message_blocks(message, finish == "length")
    thought = await _reasoning_tokens(server, blocks)
    outcome = Outcome(blocks, finish, o.stop_reason, len(o.token_ids), finals[0].num_cached_tokens, thought)
    return JSONResponse(body(outcome))


def refuse_unhonoured(fields: dict[str, Any], names: tuple[str, ...]) -> None:
    """400 naming the first of these fields that asks for something (they are not honoured): a field
    that is absent, off, empty, "disabled"/"none", or an object or list of such, asks for nothing."""

    def asks_nothing(value: Any) -> bool:
        if isinstance(value, dict | list):
            return all(asks_nothing(v) for v in (value.values() if isinstance(value, dict) else value))
        return value in (None, False, 0, "", "disabled", "none")

    for name in names:
        if not asks_nothing(fields.get(name)):
            raise InvalidRequest(name, "is not supported by this server; the request was not run")
