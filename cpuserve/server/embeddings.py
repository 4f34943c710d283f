"""POST /v1/embeddings: each input's pooled final hidden states, as OpenAI and vLLM return them.

Inputs in the API's four forms (a string, strings, token ids, lists of token ids) become one engine
request each (max_tokens 0, the model's pooling): they are prefilled in chunks beside everyone
else's decoding and their KV blocks are freed when they end. `encoding_format` "base64" is the
little-endian float32 bytes the openai SDK asks for by default; `dimensions` is honoured only for a
Matryoshka model (cut, then normalized again), or when it is the model's own width.
"""

from __future__ import annotations

import base64
import math
import struct
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from cpuserve.engine import InvalidRequest, SamplingParams
from cpuserve.server import streaming
from cpuserve.server.errors import APIError
from cpuserve.server.state import Server


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the last N tokens of each input (-1: max_model_len)


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    x = req.input
    if isinstance(x, str):
        return [x]
    if not x:
        raise APIError(400, "input must not be empty", param="input")
    if all(isinstance(t, int) for t in x):
        return [list(x)]  # type: ignore[arg-type]
    return list(x)  # type: ignore[arg-type]


def _dimensions(server: Server, req: EmbeddingRequest, width: int) -> int | None:
    """How many dimensions to keep (None: all); 400 when the model cannot give that many."""
    d = req.dimensions
    if d is None or d == width:
        return None
    pooling = server.engine.pooling
    if d < 1 or d > width:
        raise APIError(400, f"dimensions must be between 1 and {width}", param="dimensions")
    if not (pooling.any_dimensions or d in pooling.dimensions):
        allowed = f"one of {list(pooling.dimensions)}" if pooling.dimensions else f"{width} (not a Matryoshka model)"
        message = f"this model's embeddings have {width} dimensions; dimensions must be {allowed}"
        raise APIError(400, message, param="dimensions")
    return d


def _encode(vec: list[float], fmt: str) -> list[float] | str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode() if fmt == "base64" else vec


async def create_embedding(server: Server, request: Request, req: EmbeddingRequest) -> Response:
    server.check_model(req.model)
    inputs = _inputs(req)
    keep = _dimensions(server, req, server.engine.hidden_size)
    server.check_capacity(len(inputs))
    pooling = server.engine.pooling
    rid = f"embd-{uuid.uuid4().hex}"
    jobs: list[streaming.Job] = []
    keep_tokens = req.truncate_prompt_tokens
    if keep_tokens is not None and (keep_tokens == 0 or keep_tokens < -1):
        raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    if keep_tokens == -1:
        keep_tokens = server.engine.max_model_len
    for i, text in enumerate(inputs):
        ids = await server.tokens.encode(text) if isinstance(text, str) else text
        if keep_tokens is not None:
            ids = ids[-keep_tokens:]
        params = SamplingParams(max_tokens=0, pooling=pooling.mode, normalize=pooling.normalize)
        jobs.append((f"{rid}-{i}", ids, params))
    try:
        finals = await streaming.collect(server, request, jobs)
    except InvalidRequest as exc:  # the engine says "prompt"; this API calls it "input"
        if exc.param != "prompt":
            raise
        raise APIError(400, "input" + str(exc)[len("prompt") :], param="input") from None
    if finals is None:
        return Response(status_code=499)
    data: list[dict[str, Any]] = []
    tokens = 0
    for i, out in enumerate(finals):
        vec = out.embedding or []
        if keep is not None:
            vec = vec[:keep]
            if pooling.normalize:
                norm = math.sqrt(sum(v * v for v in vec)) or 1.0
                vec = [v / norm for v in vec]
        data.append({"object": "embedding", "index": i, "embedding": _encode(vec, req.encoding_format)})
        tokens += len(out.prompt_token_ids)
    body = {
        "object": "list",
        "data": data,
        "model": server.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return JSONResponse(body)
