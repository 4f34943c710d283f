"""Requests become engine-core requests before they reach the engine thread: prompts tokenized,
sampling parameters and lengths validated, constraints compiled. Runs on the caller's thread (AsyncEngine runs a text
prompt's on a worker thread; the server tokenizes on its own pool and sends ids), and encodes
with the GIL released, so a long prompt's tokenization never delays anybody's decode step."""

from __future__ import annotations

from cpuserve.engine.requests import EngineCoreRequest
from cpuserve.engine.sampling_params import MAX_LOGPROBS, InvalidRequest, SamplingParams
from cpuserve.engine.structured import GrammarCompiler
from cpuserve.tokenizer import Tokenizer


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        grammars: GrammarCompiler | None = None,
        max_logprobs: int = MAX_LOGPROBS,
    ) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.grammars = grammars
        self.max_logprobs = max_logprobs

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> EngineCoreRequest:
        """Tokenize and validate; an impossible request raises InvalidRequest naming the parameter."""
        for name in ("logprobs", "prompt_logprobs"):  # vLLM's -1: the whole vocabulary
            if getattr(params, name) == -1:
                setattr(params, name, self.vocab_size)
        params.validate(self.vocab_size, self.max_logprobs)
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode_off_gil(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest("prompt", f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not ids:
            raise InvalidRequest("prompt", "is empty")
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and params.max_tokens != 0):
            # vLLM's and OpenAI's wording, which clients match to trim their context and retry
            room = "leaves no room for any output token" if len(ids) == self.max_model_len else "exceeds this limit"
            raise InvalidRequest(
                "prompt",
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {len(ids)} input tokens, which {room}. Please reduce the length of the input "
                "prompt.",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                "max_tokens",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                f"output). Please reduce the length of the prompt or of max_tokens (at most "
                f"{self.max_model_len - len(ids)}).",
            )
        grammar = None
        if params.structured_outputs is not None:
            if self.grammars is None:
                raise InvalidRequest(params.structured_outputs.param, "this engine has no grammar compiler")
            grammar = self.grammars.compile(params.structured_outputs)
        return EngineCoreRequest(request_id, ids, params, text, grammar=grammar)
