"""Calibration text the model writes itself: what `cpuserve quantize` calibrates on when the user
gives no text. SmoothQuant and GPTQ need activations that look like the ones the model will see;
samples of the model's own distribution (from a handful of neutral starts, plain and, for a chat
model, as chat turns) carry its outlier channels and correlations without any dataset, as in
LLM-QAT's data-free distillation. Seeded: the same model and options give the same windows."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from cpuserve.errors import ConfigError
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
MAX_ROUNDS = 4
BLOCK_SIZE = 16  # sequences that stop early at an end token are made up in later rounds


def self_calibration_windows(src: Path, tokens: int, window: int, seed: int = 0, progress: bool = True) -> torch.Tensor:
    """Token windows [tokens // window, window] cut from samples of the model at SRC (float32,
    temperature 1, each sequence seeded), prompts included, sequences joined end to end."""
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
    # a KV cache for these sequences only (the engine's default takes most of the free memory)
    longest = window + max(map(len, starts))
    blocks = count * (-(-longest // BLOCK_SIZE) + 1)
    llm = LLM(
        str(src),
        dtype="float32",
        quantize_lm_head="none",
        max_num_seqs=count,
        max_model_len=longest,
        num_kv_blocks=blocks,
        block_size=BLOCK_SIZE,
    )
    stream: list[int] = []
    for rnd in range(MAX_ROUNDS):
        missing = count * window - len(stream)
        if missing <= 0:
            break
        n = min(count, -(-missing // window))
        prompts = [starts[(rnd * count + i) % len(starts)] for i in range(n)]
        seeds = [seed * 1_000_003 + rnd * count + i for i in range(n)]
        params = [SamplingParams(max_tokens=window, temperature=1.0, seed=s) for s in seeds]
        if progress:
            what = f"{n} x {window} tokens from the model itself (round {rnd + 1})"
            print(f"[calibration] sampling {what}", file=sys.stderr)
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            stream += prompt + list(out.outputs[0].token_ids)
    del llm
    gc.collect()  # the sampling engine's weights and KV cache go before calibration loads the model again
    count = min(count, len(stream) // window)
    if count == 0:
        raise ConfigError(f"the model wrote {len(stream)} tokens in {MAX_ROUNDS} rounds: not one window of {window}")
    return torch.tensor(stream[: count * window]).view(count, window)
