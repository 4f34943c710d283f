"""`cpuserve serve`: check the flags (serve_flags), load the model, build the app and serve it."""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpuserve.errors import CpuserveError
from cpuserve.server.serve_flags import (
    check_model_flags,
    check_serve_args,
    checked_generation_overrides,
    local_tokenizer,
)

log = logging.getLogger("cpuserve")


def _sampling_defaults(choice: str, model_dir: Path) -> dict:
    from cpuserve.tokenizer import GenerationDefaults

    if choice == "vllm":
        return {}
    folder = model_dir if choice == "auto" else Path(choice)
    if choice != "auto" and not (folder / "generation_config.json").is_file():
        raise CpuserveError(f"--generation-config {choice}: no generation_config.json there")
    d = GenerationDefaults.load(folder)
    return {
        k: v
        for k, v in {
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": d.top_k,
            "repetition_penalty": d.repetition_penalty,
        }.items()
        if v is not None
    }


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise CpuserveError(f"--chat-template {value}: no such file (and not a template)")
    return value


@dataclass
class BuiltServer:
    """What `cpuserve serve` runs: the engine (loaded, on its own thread) and the app in front of it."""

    engine: Any  # AsyncEngine
    app: Any  # FastAPI
    api_key: str | None


def build_server(args: argparse.Namespace, platform_plan, on_fatal: Callable[[BaseException], None]) -> BuiltServer:  # type: ignore[no-untyped-def]
    """Check the flags, plan the machine, load the model and build the app; logs what was chosen.

    `cpuserve serve` and each replica of `cpuserve cluster` call this, so both validate, answer and
    refuse requests the same way. `on_fatal` is called on the engine thread after a fatal engine error.
    """
    if args.model_flag and args.model and args.model_flag != args.model:
        raise CpuserveError("give the model once: positional MODEL or --model")
    args.model = args.model or args.model_flag
    check_serve_args(args)
    machine, overrides, _ = platform_plan(args)
    sampling_overrides = checked_generation_overrides(args.override_generation_config)  # before the load
    from cpuserve.engine import AsyncEngine, EngineConfig, LLMEngine
    from cpuserve.model.resolve import BUNDLED_NAME, resolve_model
    from cpuserve.server.app import ServerConfig, create_app
    from cpuserve.server.state import CorsPolicy

    tokenizer_dir = local_tokenizer(args.tokenizer)
    config = EngineConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        max_logprobs=args.max_logprobs,
    )

    def load() -> LLMEngine:
        model_dir = resolve_model(args.model, args.cache_dir)  # a GGUF's directory is made here, once
        check_model_flags(args, model_dir)
        return LLMEngine.from_model_dir(
            model_dir, config, args.dtype, machine, overrides, args.quantize_lm_head, tokenizer_dir=tokenizer_dir
        )

    # Loaded on the engine thread, which alone computes in parallel (AsyncEngine.load says why).
    async_engine = AsyncEngine.load(load, on_fatal=on_fatal)
    engine = async_engine.engine
    model_dir = Path(engine.facts["path"])
    engine.grammars.prepare_in_background()  # structured outputs' token trie, off the first request's path
    # What loading made lives as long as the server: out of the collector's sight, a full
    # collection during a decode step walks only what requests allocate.
    gc.collect()
    gc.freeze()
    facts = engine.facts
    names = args.served_model_name or [args.model or BUNDLED_NAME]
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    app = create_app(
        async_engine,
        ServerConfig(
            served_model_names=names,
            api_key=api_key,
            chat_template=_chat_template(args.chat_template),
            sampling_defaults={
                **_sampling_defaults(args.generation_config, model_dir),
                **{k: v for k, v in sampling_overrides.items() if k != "max_new_tokens"},
            },
            default_max_tokens=sampling_overrides.get("max_new_tokens"),
            max_waiting_requests=args.max_waiting_requests,
            max_request_bytes=args.max_request_bytes,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            log_requests=not args.disable_log_requests,
            log_prompts=args.log_prompts,
            log_stats=not args.disable_log_stats,
            prompt_tokens_details=args.enable_prompt_tokens_details,
            api_docs=not args.disable_fastapi_docs,
            root_path=args.root_path or "",
            cors=CorsPolicy(args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials),
        ),
    )
    log.info(
        "model %s (%s) as %s; %s; max_model_len %d",
        model_dir,
        facts["architecture"],
        ", ".join(names),
        facts["scheme"],
        engine.max_model_len,
    )
    log.info("kernels: %s", "; ".join(f"{k}: {v}" for k, v in facts["kernels"].items()))
    return BuiltServer(async_engine, app, api_key)


def uvicorn_config(args: argparse.Namespace, app: Any) -> Any:
    """uvicorn's settings from the flags: address, log level and HTTPS (--ssl-*; check_tls has built
    the same context once)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=False,  # cpuserve.access logs each request (access_log.py)
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )


def serve(args: argparse.Namespace, platform_plan) -> int:  # type: ignore[no-untyped-def]
    """Load, log what was chosen, and serve until interrupted."""
    from cpuserve.server.shutdown import HttpServer

    built = build_server(args, platform_plan, on_fatal=lambda exc: http.stop_for_fatal_error(exc))
    log.info(
        "listening on %s://%s:%d%s (OpenAI API under /v1)%s",
        "https" if args.ssl_certfile else "http",
        args.host,
        args.port,
        args.root_path or "",
        "; API key required" if built.api_key else "",
    )
    http = HttpServer(uvicorn_config(args, built.app), built.app.state.server, args.shutdown_timeout)
    http.run()
    built.engine.shutdown()
    if http.fatal is not None:
        log.error("exiting after a fatal engine error: %s", http.fatal)
        return 1
    return 0
