"""POST /v1/chat/completions: messages through the chat template, n choices, JSON or SSE.

The template is rendered and its text encoded on a worker thread (TokenizerPool); the engine
gets token ids. A stream starts each choice with a role-only delta, as OpenAI's does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from cpuserve.engine import RequestOutput
from cpuserve.server import streaming
from cpuserve.server.errors import APIError
from cpuserve.server.logprobs import chat_logprobs, prompt_logprobs_json
from cpuserve.server.protocol import ChatCompletionRequest
from cpuserve.server.state import Server
from cpuserve.tokenizer import ChatTemplateError


async def chat_prompt(server: Server, req: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of a chat request (also what /tokenize answers for messages)."""
    messages = []
    for m in req.messages:
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            texts = [part.get("text", "") for part in m.content if part.get("type") == "text"]
            if len(texts) != len(m.content):
                raise APIError(400, "only text content parts are supported", param="messages")
            msg["content"] = "".join(texts)
        messages.append(msg)
    try:
        return await server.tokens.encode_chat(
            messages,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            template=req.chat_template or server.config.chat_template,
            template_kwargs=req.chat_template_kwargs or {},
        )
    except ChatTemplateError as exc:
        raise APIError(400, str(exc), param="messages") from None


async def create_chat_completion(server: Server, request: Request, req: ChatCompletionRequest) -> Response:
    server.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    server.check_capacity(1)
    ids = await chat_prompt(server, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(
        logprobs, server.config.sampling_defaults, server.max_tokens(requested, len(ids), None)
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    jobs: list[streaming.Job] = [(rid, ids, params)]
    if req.stream:
        merged = streaming.merge(server, await streaming.start(server, jobs))
        return streaming.sse(_events(server, rid, created, req, len(ids), merged))
    finals = await streaming.collect(server, request, jobs)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(_body(server, rid, created, req, len(ids), finals[0]))


def _body(
    server: Server, rid: str, created: int, req: ChatCompletionRequest, prompt_len: int, out: RequestOutput
) -> dict[str, Any]:
    choices = []
    for o in out.outputs:
        choice: dict[str, Any] = {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": chat_logprobs(server.tokenizer, o.logprobs or []) if req.logprobs else None,
            "finish_reason": o.finish_reason,
            "stop_reason": o.stop_reason,
        }
        choices.append(choice)
    completion = sum(len(o.token_ids) for o in out.outputs)
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": server.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_len,
            "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
        },
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(server.tokenizer, out.prompt_logprobs)
    return body


async def _events(
    server: Server,
    rid: str,
    created: int,
    req: ChatCompletionRequest,
    prompt_len: int,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[dict[str, Any]]:
    def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
        body = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": server.model_name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    sent: dict[int, tuple[int, int]] = {}  # choice index -> (chars sent, logprob entries sent)
    last: RequestOutput | None = None
    async for _, out in merged:
        last = out
        for o in out.outputs:
            if o.index not in sent:
                sent[o.index] = (0, 0)
                yield chunk(
                    [
                        {
                            "index": o.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            chars, nlp = sent[o.index]
            delta, new_lp = o.text[chars:], (o.logprobs or [])[nlp:]
            if not (delta or new_lp or o.finish_reason):
                continue
            sent[o.index] = (len(o.text), len(o.logprobs or []))
            yield chunk(
                [
                    {
                        "index": o.index,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": chat_logprobs(server.tokenizer, new_lp) if req.logprobs else None,
                        "finish_reason": o.finish_reason,
                        "stop_reason": o.stop_reason,
                    }
                ]
            )
    if req.stream_options and req.stream_options.include_usage and last is not None:
        completion = sum(len(o.token_ids) for o in last.outputs)
        yield chunk(
            [],
            {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion},
        )
