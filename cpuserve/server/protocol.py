"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated by pydantic."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from cpuserve.engine import InvalidRequest, SamplingParams, StructuredOutputs


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# Parameters OpenAI or vLLM define that this server does not honour: a request that gives one a
# value that would change the answer (or what comes back) is refused (400 naming it), never served
# as if it had not. (Output constraints are read by structured.py, tools by tool_calls.py.)
NOT_HONOURED = {
    "modalities": lambda v: v not in (None, ["text"]),
    "audio": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
    "verbosity": lambda v: v is not None,
    "store": lambda v: v is True,  # OpenAI keeps the completion for later listing; nothing is kept here
    "logits_processors": bool,
    "spaces_between_special_tokens": lambda v: v is False,
    "functions": bool,
    "function_call": lambda v: v not in (None, "none"),
    "use_beam_search": bool,
    "length_penalty": lambda v: v not in (None, 1, 1.0),
    "bad_words": bool,
    "logprob_token_ids": bool,
    "watermarking": bool,
    "repetition_detection": bool,
    "thinking_token_budget": lambda v: v is not None,
    "prompt_embeds": lambda v: v is not None,
    "priority": lambda v: v not in (None, 0),  # vLLM too refuses it without priority scheduling
    "cache_salt": lambda v: v is not None,
    "return_token_offsets": bool,
    "return_prompt_text": bool,
    "return_mm_kwargs": bool,
    "mm_processor_kwargs": bool,
    "media_io_kwargs": bool,
    "kv_transfer_params": bool,
    "ec_transfer_params": bool,
    "vllm_xargs": bool,
}


# Names a request may carry besides its declared fields: what NOT_HONOURED checks, the output
# constraints (structured.py reads them from the extras), a completion's tool fields (refused there
# unless empty), chat's best_of (checked below), and OpenAI's metadata, which changes nothing in the
# answer. Any other name is refused, as OpenAI's own server refuses it ("Unrecognized request
# argument supplied"): a parameter nothing reads is one the server cannot honour. (vLLM ignores
# them with a warning in its log; a client would not see it.)
KNOWN_EXTRAS = {
    *NOT_HONOURED,
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "best_of",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",  # OpenAI's prompt cache settings (the openai-agents SDK forwards them)
    "prompt_cache_options",
    "safety_identifier",
    "prediction",  # predicted output: a speed hint, the answer is the same without it
}


def refuse_unrecognized(extras: dict[str, Any] | None, known: set[str] | frozenset[str]) -> None:
    """400 naming the first undeclared field of a request that nothing reads (not in `known`)."""
    for name in extras or {}:
        if name not in known:
            raise InvalidRequest(name, "unrecognized request argument supplied; the request was not run")


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions, mapped onto SamplingParams."""

    model_config = ConfigDict(extra="allow")  # kept, so NOT_HONOURED can see what was sent

    def given(self) -> dict[str, Any]:
        """Every field by name, the unknown extras included."""
        return {**(self.model_extra or {}), **{k: getattr(self, k) for k in type(self).model_fields}}

    def refuse_unhonoured(self) -> None:
        given = self.given()
        refuse_unrecognized(self.model_extra, KNOWN_EXTRAS)
        for name, changes_the_answer in NOT_HONOURED.items():
            if changes_the_answer(given.get(name)):
                raise InvalidRequest(name, "is not supported by this server yet; the request was not run")
        best_of = given.get("best_of")
        if best_of is not None and best_of != getattr(self, "n", 1):
            raise InvalidRequest("best_of", "only best_of equal to n is supported")
        options = self.stream_options
        if options is not None and (options.include_usage or options.continuous_usage_stats) and not self.stream:
            raise InvalidRequest("stream_options", "can only be set when stream is true")
        if self.truncation_side not in (None, "left", "right"):
            raise InvalidRequest("truncation_side", "must be 'left' or 'right'")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise InvalidRequest("truncate_prompt_tokens", "must be -1 (the model's limit) or at least 0")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise InvalidRequest("seed", "must fit in a signed 64-bit integer, as vLLM takes it")

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt cut to truncate_prompt_tokens (-1: the model's limit less one token, to leave
        room to generate, as vLLM does), keeping its end unless truncation_side is "right"."""
        limit = self.truncate_prompt_tokens
        if limit is None:
            return ids
        if limit < -1:
            raise InvalidRequest("truncate_prompt_tokens", "must be -1 (the model's limit) or at least 0")
        limit = max_model_len - 1 if limit == -1 else limit
        if limit > max_model_len:
            raise InvalidRequest(
                "truncate_prompt_tokens", f"({limit}) cannot be greater than max_model_len ({max_model_len})"
            )
        if len(ids) <= limit:
            return ids
        return ids[:limit] if self.truncation_side == "right" else ids[len(ids) - limit :]

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # None: the served defaults' (--override-generation-config), else 0
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    return_token_ids: bool = False  # the prompt's and each choice's token ids in the reply (vLLM)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM)

    def sampling_params(
        self,
        logprobs: int | None,
        defaults: dict[str, Any],
        max_tokens: int,
        constraint: StructuredOutputs | None = None,
    ) -> SamplingParams:
        """The engine's parameters: request values, else `defaults` (the model's generation_config),
        else OpenAI's.
        `constraint`: the output constraint the caller worked out (request_constraint's, or a tool choice's)."""

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            if value is not None:
                return value
            return defaults.get(name) if defaults.get(name) is not None else fallback

        self.refuse_unhonoured()
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequest("stream_options", "continuous_usage_stats is not supported; include_usage is")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except ValueError:
                raise InvalidRequest("logit_bias", f"key {key!r} is not a token id") from None
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0) or 0,
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            logit_bias=bias,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=constraint,
        )


class CompletionRequest(SamplingFields):
    def refuse_unhonoured(self) -> None:
        super().refuse_unhonoured()
        given = self.given()
        for name in ("tools", "tool_choice"):  # chat's; a completion has no messages to call from
            if given.get(name) not in (None, [], "none"):
                raise InvalidRequest(name, "is a chat completions parameter; completions do not call tools")

    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # a text prompt's BOS (or whatever the tokenizer adds)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_special_tokens: bool = False  # on top of the template's own (vLLM's default: none)
    documents: list[dict[str, Any]] | None = None  # for templates that take retrieved documents
    reasoning_effort: str | None = None  # to the template (and enable_thinking, unless given), as vLLM
    include_reasoning: bool = True  # False: reasoning_content left out of the reply

    def refuse_unhonoured(self) -> None:
        super().refuse_unhonoured()
        for name in ("max_completion_tokens", "max_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequest(name, f"must be at least 1, got {getattr(self, name)}")


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None  # for the chat template, as vLLM's /tokenize takes them
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
