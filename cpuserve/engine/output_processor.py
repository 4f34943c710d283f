"""Engine-core outputs (token ids) become request outputs (text, logprobs, finish reasons), outside
the engine core: detokenization and stop strings run on the caller's side (the server's event
loop, or the synchronous engine after its step), never inside a forward-pass step.

A stop string ends its sequence here; the caller tells the core (`finish_by_stop_string`), and
tokens the core drew for that sequence before it heard are dropped, so the text and token ids a
client sees end exactly where the synchronous engine would have ended them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuserve.engine.outputs import CompletionOutput, RequestOutput
from cpuserve.engine.requests import EngineCoreOutput, EngineCoreRequest
from cpuserve.engine.sequence import TokenLogprobs
from cpuserve.engine.text import SequenceText
from cpuserve.tokenizer import Tokenizer


@dataclass
class _SequenceState:
    text: SequenceText
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestState:
    """One request's outputs as they grow; `process` takes each EngineCoreOutput of it in order."""

    def __init__(self, tokenizer: Tokenizer, request: EngineCoreRequest) -> None:
        self.request = request
        self.seqs = [
            _SequenceState(SequenceText(tokenizer, request.prompt_ids, request.params)) for _ in range(request.params.n)
        ]
        self.prompt_logprobs: list[TokenLogprobs | None] = [None] * len(request.prompt_ids)
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.first_scheduled: float | None = None
        self.embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def process(self, out: EngineCoreOutput) -> tuple[RequestOutput | None, list[tuple[int, str]]]:
        """This step's RequestOutput (None when nothing visible changed) and the sequences a stop
        string ended now, as (index, stop string). Raises if detokenizing fails (the caller fails
        the request alone)."""
        p = self.request.params
        if out.prompt_logprobs is not None:
            start, entries = out.prompt_logprobs
            self.prompt_logprobs[start : start + len(entries)] = entries
        stops = []
        if out.embedding is not None:
            self.embedding = out.embedding
        for delta in out.deltas:
            seq = self.seqs[delta.index]
            if delta.index == 0:  # as vLLM reports it: the first sequence's prefix-cache hit
                self.num_cached_tokens = delta.num_cached_tokens
            if self.first_scheduled is None:
                self.first_scheduled = delta.first_scheduled
            if seq.finish_reason is not None:
                continue  # ended here by a stop string: later tokens never existed
            if not delta.new_token_ids and delta.finish_reason is not None:  # ended without a token (max_tokens 0)
                seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            for j, (token, info) in enumerate(zip(delta.new_token_ids, delta.new_logprobs, strict=True)):
                seq.token_ids.append(token)
                if info is not None:
                    seq.logprobs.append(info)
                    seq.cumulative_logprob += info.logprob
                last = j == len(delta.new_token_ids) - 1
                core_stop = last and delta.ended_by_token  # EOS or a stop token id: no text
                found = None if core_stop else seq.text.add(token, len(seq.token_ids) >= p.min_tokens)
                if found is not None:
                    seq.finish_reason, seq.stop_reason = "stop", found
                    stops.append((delta.index, found))
                    break
                if last and delta.finish_reason is not None:
                    seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
            self.first_token_time = self.first_token_time or out.time
        if not out.deltas:
            return None, stops
        return self.output(), stops

    def output(self) -> RequestOutput:
        req, p = self.request, self.request.params
        outs = [
            CompletionOutput(
                index=i,
                text=s.text.visible(s.finish_reason is not None),
                token_ids=list(s.token_ids),
                cumulative_logprob=s.cumulative_logprob if p.logprobs is not None else None,
                logprobs=list(s.logprobs) if p.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(self.seqs)
        ]
        metrics = {"arrival": req.arrival}
        if self.first_scheduled is not None:
            metrics["first_scheduled"] = self.first_scheduled
        if self.first_token_time is not None:
            metrics["first_token"] = self.first_token_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_ids,
            prompt_logprobs=list(self.prompt_logprobs) if p.prompt_logprobs is not None else None,
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=metrics,
            embedding=self.embedding,
        )

    def failed(self, error: str) -> RequestOutput:
        req = self.request
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_ids,
            prompt_logprobs=None,
            outputs=[],
            finished=True,
            error=error,
        )
