"""`cpuserve generate`: one prompt through the reference decoder, streamed to the terminal."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from cpuserve.cli.common import add_model_args, platform_plan
from cpuserve.errors import CpuserveError

log = logging.getLogger("cpuserve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="a system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument(
        "--quantize-lm-head", default=None, choices=["int8", "int4", "none"], help="as serve's (default int8)"
    )
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise CpuserveError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise CpuserveError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CpuserveError(f"--top-p must be in (0, 1], got {args.top_p}")
    machine, overrides, _ = platform_plan(args)  # before torch loads: threads pinned one per core
    import torch

    from cpuserve.detokenizer import IncrementalDetokenizer
    from cpuserve.generate import SimpleSampling, generate_ids
    from cpuserve.model.footprint import model_facts, plan_model_memory
    from cpuserve.model.loader import lm_head_setting, load_model
    from cpuserve.model.resolve import resolve_model
    from cpuserve.model.source import ModelSource
    from cpuserve.tokenizer import GenerationDefaults, Tokenizer

    model_dir = resolve_model(args.model, args.cache_dir)
    source = ModelSource.open(model_dir)  # config and headers read once, for the plan and the loader
    spec, _, facts = model_facts(source, args.dtype)  # refuse before reading weights if it cannot fit
    plan_model_memory(machine, overrides, spec, facts, spec.max_position_embeddings, 1, 512)
    tokenizer = Tokenizer(model_dir)
    defaults = GenerationDefaults.load(model_dir)
    head = lm_head_setting(args.quantize_lm_head, overrides.quantize_lm_head)
    model = load_model(source, args.dtype, quantize_lm_head=head)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = tokenizer.encode_chat(messages)
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise CpuserveError("the prompt encodes to no tokens")
    limit = model.spec.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > limit:
        raise CpuserveError(
            f"prompt ({len(prompt_ids)} tokens) + --max-tokens ({args.max_tokens}) exceeds the model's "
            f"context of {limit} tokens"
        )
    stop = set(defaults.eos_token_ids) | set(model.spec.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stop.add(tokenizer.eos_token_id)
    params = SimpleSampling(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=tuple(sorted(stop)),
    )
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    log.info("model %s, %d prompt tokens", model_dir, len(prompt_ids))
    start = time.perf_counter()
    first = None
    count = 0
    storage = facts.get("kv_cache_storage")  # footprint.auto_kv_storage: what serve's cache would hold
    for token in generate_ids(model, prompt_ids, params, getattr(torch, storage) if storage else None):
        if first is None:
            first = time.perf_counter()
        count += 1
        if token in params.stop_token_ids:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    decode_rate = (count - 1) / (end - first) if count > 1 and first else 0.0
    log.info(
        "%d tokens; prefill %.0f tok/s (%.2f s to first token), decode %.1f tok/s",
        count,
        len(prompt_ids) / (first - start) if first else 0.0,
        (first or end) - start,
        decode_rate,
    )
    return 0
