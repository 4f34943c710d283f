"""Next-token choice per sequence: penalties, bias, temperature, top-k/p, min-p, seeded draws,
and logprobs.

A row may carry masks of the tokens it may draw (`Sequence.allowed` from allowed_token_ids, and
this step's grammar mask of a structured-output request); they are applied after every other
rule, so no bias can bring a masked token back, and rows without one pay nothing.

Logprobs are those of the model's own distribution (log_softmax of the raw logits, before any
penalty or temperature), as vLLM reports them by default. Each sequence draws from its own
generator, so a seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections import Counter

import torch

from cpuserve.engine.sampling_params import SamplingParams
from cpuserve.engine.sequence import Sequence, TokenLogprobs
from cpuserve.model import ops


def logprob_entries(logits: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprobs]:
    """Per row of logits [N, V]: its token's logprob and rank (1 = most likely) and its k most likely
    tokens, all rows in one native pass (model/ops.token_logprobs). Sampled and prompt tokens alike."""
    chosen, ranks, top_i, top_v = ops.token_logprobs(
        logits.float().contiguous(), torch.tensor(tokens, dtype=torch.int64), max(ks, default=0)
    )
    chosen_l, ranks_l, ids_l, vals_l = chosen.tolist(), ranks.tolist(), top_i.tolist(), top_v.tolist()
    return [
        TokenLogprobs(
            token_id=t, logprob=chosen_l[j], rank=ranks_l[j], top=dict(zip(ids_l[j][:k], vals_l[j][:k], strict=True))
        )
        for j, (t, k) in enumerate(zip(tokens, ks, strict=True))
    ]


NO_TOKEN_LEFT = (
    "the request's constraints (allowed_token_ids, its grammar, min_tokens holding back the stop tokens) "
    "leave no token to draw here"
)


def processed_logits(
    raw: torch.Tensor, seq: Sequence, stop_ids: set[int], forbidden: torch.Tensor | None = None
) -> torch.Tensor:
    """Penalties and bias, then the row's masks (`forbidden`: this step's grammar mask, True = masked)."""
    x = _penalised(raw, seq, stop_ids)
    if seq.allowed is not None:
        x = x.masked_fill(~seq.allowed, float("-inf"))
    if forbidden is not None:
        x = x.masked_fill(forbidden, float("-inf"))
    return x


def _draw_masked(x: torch.Tensor, seq: Sequence) -> int:
    """A draw from a masked row: a masked-out token is never returned (one check of the drawn
    token instead of a pass over the vocabulary)."""
    try:
        token = _draw(x, seq)
    except RuntimeError:  # multinomial over a row with nothing left
        raise ValueError(NO_TOKEN_LEFT) from None
    if x[token] == float("-inf"):
        raise ValueError(NO_TOKEN_LEFT)
    return token


def _needs_penalties(seq: Sequence) -> bool:
    p = seq.params
    return bool(
        p.logit_bias
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
        or len(seq.output_ids) < p.min_tokens
    )


def _plain_greedy(logits: torch.Tensor, seqs: list[Sequence], masks: list) -> list[int | None]:
    """The argmax of every greedy row that nothing else touches (no penalty, bias or mask), in one
    call over those rows: row by row, a batch of 8 paid 8 calls over the vocabulary. None elsewhere."""
    plain = [
        i
        for i, (seq, mask) in enumerate(zip(seqs, masks, strict=True))
        if mask is None and seq.allowed is None and seq.params.greedy and not _needs_penalties(seq)
    ]
    best: list[int | None] = [None] * len(seqs)
    if plain:
        rows = logits if len(plain) == len(seqs) else logits[torch.tensor(plain)]
        for i, token in zip(plain, rows.argmax(-1).tolist(), strict=True):
            best[i] = token
    return best


def _penalised(raw: torch.Tensor, seq: Sequence, stop_ids: set[int]) -> torch.Tensor:
    p = seq.params
    if not _needs_penalties(seq):
        return raw
    x = raw.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), dtype=torch.long)
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_ids:
        counts = Counter(seq.output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long)
        n = torch.tensor(list(counts.values()), dtype=x.dtype)
        x[ids] -= p.frequency_penalty * n + p.presence_penalty
    for token, bias in p.logit_bias.items():
        x[int(token)] += bias
    if len(seq.output_ids) < p.min_tokens and stop_ids:
        x[torch.tensor(sorted(stop_ids), dtype=torch.long)] = float("-inf")
    return x


def distribution(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Sampling probabilities from processed logits: temperature, then top-k, top-p, min-p."""
    x = x / p.temperature
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the most likely token always stays.
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order[drop], 0.0)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _draw(x: torch.Tensor, seq: Sequence) -> int:
    if seq.params.greedy:
        return int(torch.argmax(x))
    return int(torch.multinomial(distribution(x, seq.params), 1, generator=seq.generator))


Drawn = tuple[int, TokenLogprobs | None] | Exception


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    eos_ids: set[int],
    grammar_masks: list[torch.Tensor | Exception | None] | None = None,
) -> list[Drawn]:
    """One (token, logprobs or None) per row of fp32 logits [N, V], or the exception that row
    raised: a fault in one sequence must not cost the others their token (nor, by a retry, a second
    draw from their random generators). `grammar_masks`: one bool [V] row of forbidden tokens (or
    None) per row."""
    tokens: list[int | Exception] = []
    masks = grammar_masks or [None] * len(seqs)
    greedy = _plain_greedy(logits, seqs, masks)
    for raw, seq, mask, best in zip(logits, seqs, masks, greedy, strict=True):
        if best is not None:
            tokens.append(best)
            continue
        try:
            if isinstance(mask, Exception):
                raise mask
            stop_ids = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else eos_ids)
            x = processed_logits(raw, seq, stop_ids, mask)
            masked = seq.allowed is not None or mask is not None
            tokens.append(_draw_masked(x, seq) if masked else _draw(x, seq))
        except Exception as exc:
            tokens.append(exc)
    infos: list[TokenLogprobs | Exception | None] = [None] * len(seqs)
    wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None and isinstance(tokens[i], int)]
    if wanted:
        try:
            _logprobs_into(infos, logits, seqs, tokens, wanted)  # type: ignore[arg-type]
        except Exception:
            for i in wanted:  # no randomness here: row by row gives the same values
                try:
                    _logprobs_into(infos, logits, seqs, tokens, [i])  # type: ignore[arg-type]
                except Exception as exc:
                    infos[i] = exc
    return [
        t if isinstance(t, Exception) else info if isinstance(info, Exception) else (t, info)
        for t, info in zip(tokens, infos, strict=True)
    ]


def _logprobs_into(
    infos: list, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int], wanted: list[int]
) -> None:  # type: ignore[type-arg]
    """The rows that asked, in one pass."""
    rows = logits[torch.tensor(wanted)] if len(wanted) < len(logits) else logits
    entries = logprob_entries(rows, [tokens[i] for i in wanted], [seqs[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, entries, strict=True):
        infos[i] = entry
