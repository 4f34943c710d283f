"""What every handler shares: the engine, the configuration, metrics, the tokenizer pool, the drain flag.

The server knows the engine only through AsyncEngine's public surface (generate, abort, tokenizer,
max_model_len, max_logprobs, vocab_size, stats); it never reaches inside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cpuserve.engine import AsyncEngine, InvalidRequest
from cpuserve.server.errors import APIError
from cpuserve.server.metrics import Metrics
from cpuserve.server.reasoning import get_reasoning_parser
from cpuserve.server.tokenizing import TokenizerPool
from cpuserve.server.tool_parsers import get_tool_parser


@dataclass(frozen=True)
class CorsPolicy:
    """vLLM's CORS flags (--allowed-origins/-methods/-headers, --allow-credentials), vLLM's defaults:
    no other origin may call the API from a browser until --allowed-origins names it."""

    origins: list[str] = field(default_factory=list)
    methods: list[str] = field(default_factory=lambda: ["*"])
    headers: list[str] = field(default_factory=lambda: ["*"])
    credentials: bool = False


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json
    max_waiting_requests: int = 256
    max_request_bytes: int = 16 * 1024 * 1024
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser name
    reasoning_parser: str | None = None  # vLLM's --reasoning-parser name
    log_requests: bool = True  # an access line per API request (off: --disable-log-requests)
    log_prompts: bool = False  # --log-prompts: access lines carry the prompt's first 200 characters
    log_stats: bool = True  # engine stats lines every 10 s while busy (off: --disable-log-stats)
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage says how much was cached
    api_docs: bool = True  # /docs, /redoc, /openapi.json (off: --disable-fastapi-docs)
    # --root-path: the prefix a proxy adds (FastAPI's root_path, as vLLM sets it): routes answer with
    # and without it, and the API's description names it
    root_path: str = ""
    default_max_tokens: int | None = None  # --override-generation-config's max_new_tokens
    cors: CorsPolicy = field(default_factory=CorsPolicy)


class Server:
    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer  # for shaping outputs (token bytes, short decodes)
        self.tokens = TokenizerPool(self.tokenizer)  # for prompts: off the event loop
        self.config = config
        self.model_name = config.served_model_names[0]
        self.metrics = Metrics(self.model_name)
        self.created = int(time.time())
        self.draining = False  # set on SIGTERM/SIGINT: running requests finish, new ones get 503
        self.tool_parser = get_tool_parser(config.tool_call_parser) if config.tool_call_parser else None
        self.reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.config.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    def check_capacity(self, extra: int) -> None:
        if self.draining:
            raise APIError(503, "The server is shutting down.", "ServiceUnavailableError", code="shutting_down")
        if self.engine.stats().num_waiting + extra > self.config.max_waiting_requests:
            raise APIError(
                503, "The server is at capacity; retry shortly.", "ServiceUnavailableError", code="server_overloaded"
            )

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        """OpenAI's usage object; with --enable-prompt-tokens-details, the prompt's tokens found in
        the prefix cache too (vLLM's prompt_tokens_details)."""
        body: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.config.prompt_tokens_details:
            body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return body

    def max_tokens(self, requested: int | None, prompt_len: int, default: int | None) -> int:
        """The request's max_tokens cut to what fits in the context after the prompt, as vLLM does
        (more than the whole context is a 400); none given: what fits, capped at `default` if given
        (--override-generation-config's max_new_tokens when the server has one).
        An over-long prompt is the input processor's to refuse."""
        limit = self.engine.max_model_len
        room = max(1, limit - prompt_len)
        if self.config.default_max_tokens is not None:
            default = self.config.default_max_tokens
        if requested is not None:
            if requested > limit:
                raise InvalidRequest(
                    "max_tokens",
                    f"max_tokens={requested} cannot be greater than max_model_len={limit}. "
                    "Please request fewer output tokens.",
                )
            return min(requested, room) if requested > 0 else requested
        return min(default, room) if default is not None else room
