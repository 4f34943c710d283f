"""The engine's per-token logprobs in the three shapes the API uses.

Completions (legacy): parallel lists of token texts, logprobs, top-k dicts and text offsets.
Chat: one entry per token with its exact bytes (a token may be part of a UTF-8 character).
Prompt logprobs (vLLM's extra): per prompt position, token id -> logprob, rank and decoded text.
"""

from __future__ import annotations

from typing import Any

from cpuserve.engine import TokenLogprobs
from cpuserve.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int, as_ids: bool = False) -> str:
    """A token as logprobs name it: its text, or (vLLM's return_tokens_as_token_ids) "token_id:N",
    which names a token whose bytes are not a whole character without ambiguity."""
    if as_ids:
        return f"token_id:{token_id}"
    return tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")


def completion_logprobs(
    tokenizer: Tokenizer, parts: list[tuple[list[int], list[TokenLogprobs | None], int]], as_ids: bool = False
) -> dict[str, Any]:
    """The legacy shape over consecutive parts of a choice's text (the echoed prompt, then the
    generated tokens): each part is (token ids, their entries, characters of the text before it).
    An entry of None is a token the model has no logprob for (the first prompt token): it is listed
    with `null` logprob and top logprobs, as OpenAI and vLLM list it."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for ids, entries, offset in parts:
        pos = offset
        for token, e in zip(ids, entries, strict=True):
            tokens.append(_text(tokenizer, token, as_ids))
            token_lps.append(e.logprob if e is not None else None)
            tops.append(_completion_top(tokenizer, token, e, as_ids))
            text = _text(tokenizer, token)  # the offsets are into the text, whatever names the tokens
            offsets.append(pos)
            pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _completion_top(tokenizer: Tokenizer, token: int, e: TokenLogprobs | None, as_ids: bool) -> dict[str, float] | None:
    """A token's top alternatives, text -> logprob, with the token itself among them (OpenAI: "up to
    logprobs + 1 elements"; vLLM the same) even when it was not among the top `logprobs`."""
    if e is None:
        return None
    top = {_text(tokenizer, t, as_ids): lp for t, lp in e.top.items()}
    top.setdefault(_text(tokenizer, token, as_ids), e.logprob)
    return top


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": _text(tokenizer, token_id, as_ids), "logprob": logprob, "bytes": list(raw)}


def chat_logprobs(tokenizer: Tokenizer, entries: list[TokenLogprobs], as_ids: bool = False) -> dict[str, Any]:
    content = []
    for e in entries:
        item = _chat_entry(tokenizer, e.token_id, e.logprob, as_ids)
        item["top_logprobs"] = [_chat_entry(tokenizer, t, lp, as_ids) for t, lp in e.top.items()]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(tokenizer: Tokenizer, entries: list[TokenLogprobs | None] | None) -> list[Any] | None:
    if entries is None:
        return None
    result: list[Any] = []
    for e in entries:
        if e is None:
            result.append(None)
            continue
        item = {
            str(t): {"logprob": lp, "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
            for t, lp in e.top.items()
        }
        item[str(e.token_id)] = {
            "logprob": e.logprob,
            "rank": e.rank,
            "decoded_token": tokenizer.decode([e.token_id], skip_special_tokens=False),
        }
        result.append(item)
    return result
