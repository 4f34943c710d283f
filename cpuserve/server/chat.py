"""POST /v1/chat/completions: messages through the chat template, n choices, JSON or SSE.

The template is rendered and its text encoded on a worker thread (TokenizerPool); the engine
gets token ids. A stream starts each choice with a role-only delta, as OpenAI's does. Tools
(tool_calls.py), output constraints (structured.py) and reasoning (reasoning.py) shape what is
asked of the engine and how its text becomes the message.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cpuserve.engine import InvalidRequest, RequestOutput, SamplingParams, StructuredOutputs
from cpuserve.server import streaming
from cpuserve.server.errors import APIError
from cpuserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from cpuserve.server.protocol import ChatCompletionRequest
from cpuserve.server.reasoning import ReasoningParser, ReasoningStream
from cpuserve.server.state import Server
from cpuserve.server.structured import request_constraint
from cpuserve.server.tool_calls import ToolDeltaStream, ToolPlan, call_id, call_json, plan_tools, read_calls
from cpuserve.tokenizer import ChatTemplateError


async def chat_prompt(server: Server, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of a chat request (also what /tokenize answers for messages). The
    template gets each message as the client sent it (a `null` or absent content stays so, as
    transformers passes it), content parts as sent to a template that loops over them and joined
    into one string for one that prints the content, and the request's tools. A tool call's
    `arguments`, JSON text in the OpenAI API, reach the template as the object they encode (as vLLM
    passes them, and as transformers' templates expect: `arguments | tojson`)."""
    template = req.chat_template or server.config.chat_template
    messages = []
    for m in req.messages:
        msg = m.model_dump(exclude_unset=True)
        if isinstance(m.content, list):  # every part text; each as a text part (the tokenizer joins them if need be)
            msg["content"] = [{"type": "text", "text": t} for t in text_parts(m.content, "messages")]
        if isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_decoded_arguments(call) for call in msg["tool_calls"]]
        messages.append(msg)
    kwargs = dict(req.chat_template_kwargs or {})
    flags = {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message}
    for name in flags:  # also taken from chat_template_kwargs, as vLLM merges them, unless given as fields
        if name in kwargs:
            value = kwargs.pop(name)
            if name not in req.model_fields_set:
                flags[name] = bool(value)
    taken = sorted(set(kwargs) & {"messages", "bos_token", "eos_token", "template"})
    if taken:
        raise InvalidRequest("chat_template_kwargs", f"{taken[0]!r} is the server's to give the template")
    if req.tools:
        kwargs.setdefault("tools", req.tools)
    if req.documents is not None:  # for templates that take retrieved documents, as vLLM passes them
        kwargs.setdefault("documents", req.documents)
    if req.reasoning_effort is not None:  # as vLLM gives it to the template, thinking on unless "none"
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    generation, continuing = flags["add_generation_prompt"], flags["continue_final_message"]
    if continuing and generation and "add_generation_prompt" in req.model_fields_set:
        raise InvalidRequest("continue_final_message", "cannot be combined with add_generation_prompt true")
    try:
        return await server.tokens.encode_chat(
            messages,
            add_generation_prompt=generation and not continuing,
            template=template,
            template_kwargs=kwargs,
            continue_final_message=continuing,
            add_special_tokens=req.add_special_tokens,
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


def _decoded_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except json.JSONDecodeError:
        return call  # not JSON: the template gets the text as sent
    return {**call, "function": {**fn, "arguments": arguments}}


# The content parts that carry text, and the field each keeps it in: OpenAI's text and an assistant's
# refusal, the Responses API's input and output text (vLLM reads the same four as text).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def text_parts(content: Any, param: str, kinds: tuple[str, ...] = tuple(TEXT_PARTS)) -> list[str]:
    """The text of each content part (of these types); 400 for any other part."""
    parts = content if isinstance(content, list) else [content]
    texts = [p.get(TEXT_PARTS[p["type"]], "") for p in parts if isinstance(p, dict) and p.get("type") in kinds]
    if len(texts) != len(parts) or not all(isinstance(t, str) for t in texts):
        raise APIError(400, "only text content parts are supported", param=param)
    return texts


def join_text(content: Any, param: str, kinds: tuple[str, ...] = tuple(TEXT_PARTS)) -> str:
    """A message's text: the string, or its text parts (of these types) joined by newlines, as vLLM
    joins them; 400 for any other part."""
    if isinstance(content, str):
        return content
    return "\n".join(text_parts(content, param, kinds))


def chat_request(param: str, **fields: Any) -> ChatCompletionRequest:
    """The chat request another API's request maps to; a value chat does not take is a 400 naming `param`."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise InvalidRequest(param, exc.errors()[0]["msg"]) from None


def _constraint(req: ChatCompletionRequest, plan: ToolPlan) -> StructuredOutputs | None:
    """The output constraint: the request's own, or its tool choice's (never both)."""
    constraint = request_constraint(req.given())
    if constraint is not None and (plan.constraint is not None or plan.mode == "auto"):
        raise InvalidRequest(constraint.param, f'cannot be combined with tool_choice "{plan.mode}"')
    return constraint or plan.constraint


def _reasoning(server: Server, ids: list[int], continuing: bool = False) -> tuple[ReasoningParser | None, bool]:
    """This request's reasoning parser and whether its output begins inside the reasoning, from
    where the rendered prompt leaves it (as vLLM decides): a prompt that already closed the
    reasoning (a template with thinking off writes `<think></think>`) has none to read; one that
    leaves a `<think>` open starts inside it; one with neither starts inside it only for a parser
    whose models always think (deepseek_r1), and not when it continues a final message (which the
    model was writing as its answer)."""
    r = server.reasoning
    if r is None:
        return None, False
    tail = server.tokenizer.decode(ids[-64:], skip_special_tokens=False)
    opened, closed = tail.rfind(r.start), tail.rfind(r.end)
    if closed > opened:
        return None, False
    return r, opened > closed or (r.implicit_start and not continuing)


@dataclasses.dataclass
class ChatRun:
    """A chat request made ready for the engine: its prompt ids, parameters, tool plan, and whether
    the output starts inside the reasoning. The Responses and Messages routes run theirs this way too."""

    rid: str
    created: int
    ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    in_reasoning: bool
    reasoning: ReasoningParser | None = None  # None: the server reads no reasoning, or the prompt closed it
    show_reasoning: bool = True  # include_reasoning: False reads the reasoning out and drops it
    echo: str = ""  # echo: the final assistant message's text, which the reply's content starts with

    @property
    def jobs(self) -> list[streaming.Job]:
        return [(self.rid, self.ids, self.params)]


async def prepare_chat(server: Server, req: ChatCompletionRequest, rid: str | None = None) -> ChatRun:
    """Check a chat request (400/404/503 naming the problem) and work out what to ask of the engine."""
    server.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    limit = server.engine.max_logprobs
    if req.top_logprobs == -1:  # vLLM's: the whole vocabulary (allowed when --max-logprobs allows it)
        req.top_logprobs = server.engine.vocab_size
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= limit:  # chat's name for it
        raise APIError(
            400, f"top_logprobs: must be between 0 and {limit}, got {req.top_logprobs}", param="top_logprobs"
        )
    plan = plan_tools(
        req.tools, req.tool_choice, req.parallel_tool_calls, server.tool_parser, server.config.enable_auto_tool_choice
    )
    constraint = _constraint(req, plan)
    server.check_capacity(1)
    ids = req.truncated(await chat_prompt(server, req), server.engine.max_model_len)
    reasoning, in_reasoning = _reasoning(server, ids, req.continue_final_message)
    if constraint is not None and reasoning is not None and in_reasoning:  # the answer, after the thinking
        constraint = dataclasses.replace(constraint, after=reasoning.end)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(
        logprobs, server.config.sampling_defaults, server.max_tokens(requested, len(ids), None), constraint
    )
    if plan.parser is not None and plan.parser.needs_special_tokens:
        params.skip_special_tokens = False  # its markers are special tokens
    rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
    final = req.messages[-1]
    echo = join_text(final.content, "messages") if req.echo and final.role == "assistant" and final.content else ""
    return ChatRun(rid, int(time.time()), ids, params, plan, in_reasoning, reasoning, req.include_reasoning, echo)


async def create_chat_completion(server: Server, request: Request, req: ChatCompletionRequest) -> Response:
    run = await prepare_chat(server, req)
    if req.stream:
        merged = streaming.merge(server, await streaming.start(server, run.jobs, request))
        return streaming.sse(_events(server, run, req, merged))
    finals = await streaming.collect(server, request, run.jobs)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(_body(server, run, req, finals[0]))


def chat_message(run: ChatRun, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message (content, tool_calls, reasoning_content) and its finish reason."""
    plan = run.plan
    reasoning, content = run.reasoning.split(text, in_reasoning=run.in_reasoning) if run.reasoning else (None, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None and run.show_reasoning:
        message["reasoning_content"] = reasoning
    if plan.reads_calls:
        parsed = read_calls(plan, content or "")
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call_json(c, i, call_id()) for i, c in enumerate(parsed.tool_calls)]
            for c in message["tool_calls"]:
                del c["index"]
            if finish_reason == "stop" and plan.mode != "named":  # a forced function: "stop", as OpenAI says
                finish_reason = "tool_calls"
    if run.echo:  # as vLLM echoes: the final message's text, then the reply's
        message["content"] = run.echo + (message["content"] or "")
    return message, finish_reason


def _body(server: Server, run: ChatRun, req: ChatCompletionRequest, out: RequestOutput) -> dict[str, Any]:
    choices = []
    for o in out.outputs:
        message, finish_reason = chat_message(run, o.text, o.finish_reason)
        choice: dict[str, Any] = {
            "index": o.index,
            "message": message,
            "logprobs": chat_logprobs(server.tokenizer, o.logprobs or [], req.return_tokens_as_token_ids)
            if req.logprobs
            else None,
            "finish_reason": finish_reason,
            "stop_reason": o.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = list(o.token_ids)
        choices.append(choice)
    prompt_len, completion = len(run.ids), sum(len(o.token_ids) for o in out.outputs)
    body = {
        "id": run.rid,
        "object": "chat.completion",
        "created": run.created,
        "model": server.model_name,
        "choices": choices,
        "usage": server.usage(prompt_len, completion, out.num_cached_tokens),
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(server.tokenizer, out.prompt_logprobs)
    if req.return_token_ids:
        body["prompt_token_ids"] = list(run.ids)
    return body


@dataclasses.dataclass
class _ChoiceStream:
    """One streamed choice: text and logprobs sent so far, and its reasoning and tool readers."""

    tools: ToolDeltaStream
    reasoning: ReasoningStream | None
    show_reasoning: bool = True  # include_reasoning
    chars: int = 0
    logprobs: int = 0
    tokens: int = 0  # token ids sent (return_token_ids): those of text held back go with the next delta

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """Message fragments for `text` (this much more output), flushed at the end if `final`."""
        out: list[dict[str, Any]] = []
        for piece, ended in ((text, False), ("", True)) if final else ((text, False),):
            if self.reasoning is not None:
                thought, content = self.reasoning.finish() if ended else self.reasoning.feed(piece)
                if thought and self.show_reasoning:
                    out.append({"reasoning_content": thought})
            else:
                content = piece
            out.extend(self.tools.feed(content))
            if ended:
                out.extend(self.tools.finish())
        return out


@dataclasses.dataclass
class ChoiceDelta:
    """What one engine output adds to one streamed choice: its opening (`opening`, nothing else yet),
    or message fragments (`deltas`: content, reasoning_content or tool_calls, as the chat stream
    sends them; [{}] when only logprobs or the finish are new) with the new logprob entries."""

    out: RequestOutput
    index: int
    opening: bool
    deltas: list[dict[str, Any]]
    logprobs: list[Any]
    token_ids: list[int] = dataclasses.field(default_factory=list)  # new since the last delta sent
    finish_reason: str | None = None  # "tool_calls" once a call was sent and the model stopped
    stop_reason: int | str | None = None


async def choice_deltas(
    server: Server, run: ChatRun, merged: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[ChoiceDelta]:
    """The stream of a chat run's choices, read through their reasoning and tool readers."""
    streams: dict[int, _ChoiceStream] = {}
    async for _, out in merged:
        for o in out.outputs:
            state = streams.get(o.index)
            if state is None:
                reasoning = run.reasoning.stream(in_reasoning=run.in_reasoning) if run.reasoning else None
                state = streams[o.index] = _ChoiceStream(ToolDeltaStream(run.plan), reasoning, run.show_reasoning)
                yield ChoiceDelta(out, o.index, True, [], [])
            text, new_lp = o.text[state.chars :], (o.logprobs or [])[state.logprobs :]
            if not (text or new_lp or o.finish_reason):
                continue
            state.chars, state.logprobs = len(o.text), len(o.logprobs or [])
            deltas = state.deltas(text, o.finish_reason is not None)
            if not deltas:
                if not (new_lp or o.finish_reason):
                    continue  # text held back (a tool call or a marker being read): nothing to send yet
                deltas = [{}]
            finish_reason = o.finish_reason
            if finish_reason == "stop" and state.tools.calls and run.plan.mode != "named":
                finish_reason = "tool_calls"
            new_ids, state.tokens = list(o.token_ids[state.tokens :]), len(o.token_ids)
            yield ChoiceDelta(out, o.index, False, deltas, new_lp, new_ids, finish_reason, o.stop_reason)


async def _events(
    server: Server,
    run: ChatRun,
    req: ChatCompletionRequest,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[dict[str, Any]]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "id": run.rid,
            "object": "chat.completion.chunk",
            "created": run.created,
            "model": server.model_name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    last: RequestOutput | None = None
    async for d in choice_deltas(server, run, merged):
        if d.opening:
            first = {"index": d.index, "delta": {"role": "assistant", "content": run.echo}, "logprobs": None}
            opening = chunk([{**first, "finish_reason": None}])
            if req.return_token_ids and last is None:  # the prompt's ids in the first chunk, as vLLM sends them
                opening["prompt_token_ids"] = list(run.ids)
            last = d.out
            yield opening
            continue
        last = d.out
        for j, delta in enumerate(d.deltas):
            last_one = j == len(d.deltas) - 1
            lps = None
            if req.logprobs and j == 0:
                lps = chat_logprobs(server.tokenizer, d.logprobs, req.return_tokens_as_token_ids)
            choice = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": None}
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids if j == 0 else []
            if last_one:
                choice.update(finish_reason=d.finish_reason, stop_reason=d.stop_reason)
            yield chunk([choice])
    if req.stream_options and req.stream_options.include_usage and last is not None:
        prompt_len, completion = len(run.ids), sum(len(o.token_ids) for o in last.outputs)
        yield chunk([], server.usage(prompt_len, completion, last.num_cached_tokens))
