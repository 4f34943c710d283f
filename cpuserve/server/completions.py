"""POST /v1/completions: prompts in any of the API's four forms, n choices each, JSON or SSE.

Choice i * n + k is sequence k of prompt i. Prompt text is encoded off the event loop; the engine
gets token ids.
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
from cpuserve.server.logprobs import completion_logprobs, prompt_logprobs_json
from cpuserve.server.protocol import CompletionRequest
from cpuserve.server.state import Server
from cpuserve.server.structured import request_constraint

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
        return list(p)  # type: ignore[arg-type]
    raise APIError(400, "prompt must be a string, a list of strings, token ids or lists of token ids", param="prompt")


async def create_completion(server: Server, request: Request, req: CompletionRequest) -> Response:
    server.check_model(req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    prompts = _prompts(req)
    constraint = request_constraint(req.given())
    server.check_capacity(len(prompts))
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    jobs: list[streaming.Job] = []
    for i, prompt in enumerate(prompts):
        ids = await server.tokens.encode(prompt, req.add_special_tokens) if isinstance(prompt, str) else prompt
        ids = req.truncated(ids, server.engine.max_model_len)
        max_tokens = server.max_tokens(req.max_tokens, len(ids), DEFAULT_MAX_TOKENS)
        params = req.sampling_params(req.logprobs, server.config.sampling_defaults, max_tokens, constraint)
        if req.echo and req.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = req.logprobs
        jobs.append((f"{rid}-{i}", ids, params))
    if req.stream:
        merged = streaming.merge(server, await streaming.start(server, jobs, request))
        return streaming.sse(_events(server, rid, created, req, merged))
    finals = await streaming.collect(server, request, jobs)
    if finals is None:
        return Response(status_code=499)
    return JSONResponse(await _body(server, rid, created, req, finals))


def _prompt_part(req: CompletionRequest, out: RequestOutput, offset: int) -> list:  # type: ignore[type-arg]
    """The echoed prompt's logprob entries (the first token's is None), as completion_logprobs takes them."""
    if not req.echo:
        return []
    entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
    return [(list(out.prompt_token_ids), entries, offset)]


async def _body(
    server: Server, rid: str, created: int, req: CompletionRequest, finals: list[RequestOutput]
) -> dict[str, Any]:
    tokenizer = server.tokenizer
    choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
    for i, out in enumerate(finals):
        prompt_tokens += len(out.prompt_token_ids)
        cached_tokens += out.num_cached_tokens
        prompt_text = await server.tokens.decode(out.prompt_token_ids, skip_special_tokens=False) if req.echo else ""
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            logprobs = None
            if req.logprobs is not None:
                parts = [*_prompt_part(req, out, 0), (list(o.token_ids), list(o.logprobs or []), len(prompt_text))]
                logprobs = completion_logprobs(tokenizer, parts, req.return_tokens_as_token_ids)
            choice = {
                "index": i * req.n + o.index,
                "text": prompt_text + o.text,
                "logprobs": logprobs,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:
                choice.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(o.token_ids))
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(tokenizer, out.prompt_logprobs)
            choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": server.model_name,
        "choices": choices,
        "usage": server.usage(prompt_tokens, completion_tokens, cached_tokens),
    }


async def _events(
    server: Server,
    rid: str,
    created: int,
    req: CompletionRequest,
    merged: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[dict[str, Any]]:
    """One event per choice whose text, logprobs or finish changed; usage last if asked for."""
    sent: dict[int, tuple[int, int, int]] = {}  # choice index -> (chars, logprob entries, token ids) sent
    echoed: dict[int, int] = {}  # choice index -> characters of the echoed prompt its first chunk sent
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    async for i, out in merged:
        prompt_tokens[i] = len(out.prompt_token_ids)
        cached_tokens[i] = out.num_cached_tokens
        for o in out.outputs:
            idx = i * req.n + o.index
            chars, nlp, nids = sent.get(idx, (0, 0, 0))
            prefix = ""
            if req.echo and idx not in sent:
                prefix = await server.tokens.decode(out.prompt_token_ids, skip_special_tokens=False)
                echoed[idx] = len(prefix)
            delta = o.text[chars:]
            new_lp = (o.logprobs or [])[nlp:]
            completion_tokens[idx] = len(o.token_ids)
            if not (prefix or delta or o.finish_reason or new_lp):
                continue
            first = idx not in sent
            sent[idx] = (len(o.text), len(o.logprobs or []), len(o.token_ids))
            logprobs = None
            if req.logprobs is not None:
                prompt_part = _prompt_part(req, out, 0) if prefix else []
                new_ids = list(o.token_ids)[nlp : nlp + len(new_lp)]
                # offsets count from the start of the choice's text, the echoed prompt included
                parts = [*prompt_part, (new_ids, new_lp, echoed.get(idx, 0) + chars)]
                logprobs = completion_logprobs(server.tokenizer, parts, req.return_tokens_as_token_ids)
            choice = {
                "index": idx,
                "text": prefix + delta,
                "logprobs": logprobs,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
            }
            if req.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk, then the new ids
                choice["token_ids"] = list(o.token_ids[nids:])
                if first:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": server.model_name,
                "choices": [choice],
            }
    if req.stream_options and req.stream_options.include_usage:
        p, c = sum(prompt_tokens.values()), sum(completion_tokens.values())
        yield {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": server.model_name,
            "choices": [],
            "usage": server.usage(p, c, sum(cached_tokens.values())),
        }
