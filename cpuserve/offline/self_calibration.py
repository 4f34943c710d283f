"""Calibration text the model writes itself: what `cpuserve quantize` calibrates on when the user
gives no text. SmoothQuant and GPTQ need activations that look like the ones the model will see;
samples of the model's own distribution (from a handful of neutral starts, plain and, for a chat
model, as chat turns) carry its outlier channels and correlations without any dataset, as in
LLM-QAT's data-free distillation. Seeded: the same model and options give the same windows."""

from __future__ import annotations

import gc
import logging
import sys
from pathlib import Path

import torch

from cpuserve.errors import ConfigError
from cpuserve.model.config import load_spec
from cpuserve.tokenizer import Tokenizer

# Plain-text starts: a word or two each, no topic of their own.
PLAIN_STARTS = ("The", "In", "A", "It", "When", "There", "One", "This", "If", "We", "I", "As", "For", "After")
# Chat starts, for a model with a chat template: open requests the model answers at length.
CHAT_STARTS = (
    "Tell me a story.",
    "Explain something you know well.",
    "Write a short essay about a topic of your choice.",
    "Describe a place in detail.",
    "Write some code and explain it.",
    "What should I know about history?",
)
MAX_ROUNDS = 8  # sequences that stop early at an end token are made up in later rounds
MAX_SEQS = 16  # sampled together (the rest queue): bounds the sampling engine's KV cache
log = logging.getLogger("cpuserve")


def self_calibration_windows(src: Path, tokens: int, window: int, seed: int = 0, progress: bool = True) -> torch.Tensor:
    """Token windows [tokens // window, window] cut from samples of the model at SRC (float32,
    temperature 1, each sequence seeded), prompts included, sequences joined end to end."""
    from cpuserve.engine.core import EngineConfig
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    count = tokens // window
    if count == 0:
        raise ConfigError(f"--calibration-tokens {tokens}: at least one window of {window} tokens is needed")
    tok = Tokenizer(src)
    starts = [tok.encode(text) for text in PLAIN_STARTS]
    if tok.chat_template is not None:  # plain and chat starts in turn
        chats = [tok.encode_chat([{"role": "user", "content": text}]) for text in CHAT_STARTS]
        starts = [s for pair in zip(starts, chats * 3, strict=False) for s in pair]
    # a context for a start and a window, within the model's; a KV cache for MAX_SEQS of them only
    # (the engine's default takes most of the free memory)
    context = min(window + max(map(len, starts)), load_spec(src).max_position_embeddings)
    seqs, block = min(count, MAX_SEQS), EngineConfig.block_size
    llm = LLM(
        str(src),
        dtype="float32",
        quantize_lm_head="none",
        max_num_seqs=seqs,
        max_model_len=context,
        num_kv_blocks=seqs * (-(-context // block) + 1),
    )
    stream: list[int] = []
    sampled = 0  # sequences so far: each one's start and seed follow from its number
    per_sequence = window  # tokens a sequence adds, as seen so far (early ends make it less)
    for rnd in range(MAX_ROUNDS):
        missing = count * window - len(stream)
        if missing <= 0:
            break
        n = -(-missing // per_sequence)
        numbers = range(sampled, sampled + n)
        prompts = [starts[i % len(starts)] for i in numbers]
        params = [
            SamplingParams(max_tokens=min(window, context - len(p)), temperature=1.0, seed=seed * 1_000_003 + i)
            for p, i in zip(prompts, numbers, strict=True)
        ]
        if progress:
            what = f"{n} sequences of up to {window} tokens from the model itself (round {rnd + 1})"
            print(f"[calibration] sampling {what}", file=sys.stderr)
        before = len(stream)
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            stream += prompt + list(out.outputs[0].token_ids)
        sampled += n
        per_sequence = max(1, (len(stream) - before) // n)
    del llm
    gc.collect()  # the sampling engine's weights and KV cache go before calibration loads the model again
    made = min(count, len(stream) // window)
    if made == 0:
        raise ConfigError(f"the model wrote {len(stream)} tokens in {MAX_ROUNDS} rounds: not one window of {window}")
    if made < count:
        log.warning("calibration: the model wrote %d windows of %d tokens, not %d", made, window, count)
    return torch.tensor(stream[: made * window]).view(made, window)
