"""`cpuserve serve`: the reference image's `vllm serve` command line, on this engine.

Every flag of the reference launch command is accepted with its vLLM meaning; flags that mean
nothing here are accepted and logged once as such; unknown flags are an error (argparse).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cpuserve import defaults
from cpuserve.errors import CpuserveError
from cpuserve.kv_cache_dtype import is_int8

log = logging.getLogger("cpuserve")

# Accepted for compatibility; what each means on this engine.
NO_EFFECT = {
    "enforce_eager": "cpuserve never captures graphs or compiles at run time: always eager",
    "distributed_executor_backend": "one process, one engine: nothing to distribute",
    "language_model_only": "text-only models are all cpuserve loads",
    "gpu_memory_utilization": "no GPU; the KV cache is sized from available memory",
    "swap_space": "no swap space: preempted sequences are recomputed",
    "device": "cpuserve runs on the CPU",
    "trust_remote_code": "remote code is never run; supported architectures are built in",
}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="at most this many prompt tokens of one request per step (0: no cap), so running streams "
        "wait for one chunk of a long prompt, not all of it",
    )
    p.add_argument(
        "--generation-config",
        default="auto",
        help="auto: sampling defaults from the model's generation_config.json; vllm: none; or a folder",
    )
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help="required bearer key (default: $VLLM_API_KEY)")
    p.add_argument("--chat-template", default=None, help="a Jinja file, or the template text itself")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model writes calls its own way, --tool-call-parser reads them',
    )
    p.add_argument("--tool-call-parser", default=None, help="hermes, llama3_json or mistral")
    p.add_argument(
        "--reasoning-parser", default=None, help="deepseek_r1 or qwen3: <think>...</think> becomes reasoning_content"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="waiting sequences beyond which requests get 503 with Retry-After",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="request bodies larger than this get 413 before they are read",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they are stopped",
    )
    p.add_argument(
        "--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info", "debug", "trace"]
    )
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic engine stats log lines")
    p.add_argument(
        "--disable-log-requests",
        "--no-enable-log-requests",  # vLLM 0.10+'s spelling
        action="store_true",
        help="no access log line per request (logger cpuserve.access)",
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_false",
        dest="disable_log_requests",
        help="an access log line per request (the default here; vLLM 0.10+'s flag, accepted)",
    )
    p.add_argument(
        "--log-prompts",
        action="store_true",
        help="access lines carry the prompt's first 200 characters (as the model sees it: the rendered template)",
    )
    p.add_argument("--cache-dir", default=None)
    p.add_argument(
        "--seed", type=int, default=None, help="seed of the generator unseeded requests draw from (a reproducible run)"
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto (the model's dtype; the checkpoint's where --dtype auto computes it in float32), bfloat16, "
        "float16 (under any compute dtype), or int8 (also fp8, fp8_e4m3, fp8_e5m2): int8 rows + per-row scales",
    )
    p.add_argument(
        "--quantize-lm-head",
        default=None,
        choices=["int8", "int4", "none"],
        help="the float output head quantized at load (default int8: W8A8, half a bf16 head's bytes; int4: W4A8"
        " in groups of 128/64/32, a quarter; none: as the checkpoint has it): faster decode, logits and"
        " logprobs carry the rounding error",
    )
    # Accepted, no effect here (see NO_EFFECT).
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument("--language-model-only", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--swap-space", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--trust-remote-code", action="store_true")


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse flag values the engine cannot honour (one line each); log the accepted no-ops."""
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise CpuserveError("--tensor-parallel-size and --pipeline-parallel-size must be 1: cpuserve runs one engine")
    is_int8(args.kv_cache_dtype)  # refuses a name it does not know
    if args.device not in (None, "cpu", "auto"):
        raise CpuserveError(f"--device {args.device}: cpuserve runs on the CPU only")
    if args.shutdown_timeout < 0:
        raise CpuserveError("--shutdown-timeout must be >= 0")
    if args.long_prefill_token_threshold < 0:
        raise CpuserveError("--long-prefill-token-threshold must be >= 0 (0: no cap)")
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_waiting_requests", "max_request_bytes"):
        if getattr(args, name) < 1:
            raise CpuserveError(f"--{name.replace('_', '-')} must be at least 1")
    from cpuserve.server.reasoning import get_reasoning_parser
    from cpuserve.server.tool_parsers import get_tool_parser

    try:
        if args.tool_call_parser is not None:
            get_tool_parser(args.tool_call_parser)
        if args.reasoning_parser is not None:
            get_reasoning_parser(args.reasoning_parser)
    except ValueError as exc:
        raise CpuserveError(str(exc)) from None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CpuserveError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    for name, why in NO_EFFECT.items():
        value = getattr(args, name)
        if value not in (None, False):
            log.info("--%s accepted; no effect: %s", name.replace("_", "-"), why)


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
    from cpuserve.engine import AsyncEngine, EngineConfig, LLMEngine
    from cpuserve.model.resolve import BUNDLED_NAME, resolve_model
    from cpuserve.server.app import ServerConfig, create_app

    config = EngineConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
    )

    def load() -> LLMEngine:
        model_dir = resolve_model(args.model, args.cache_dir)  # a GGUF's directory is made here, once
        return LLMEngine.from_model_dir(model_dir, config, args.dtype, machine, overrides, args.quantize_lm_head)

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
            sampling_defaults=_sampling_defaults(args.generation_config, model_dir),
            max_waiting_requests=args.max_waiting_requests,
            max_request_bytes=args.max_request_bytes,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            log_requests=not args.disable_log_requests,
            log_prompts=args.log_prompts,
            log_stats=not args.disable_log_stats,
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


def serve(args: argparse.Namespace, platform_plan) -> int:  # type: ignore[no-untyped-def]
    """Load, log what was chosen, and serve until interrupted."""
    import uvicorn

    from cpuserve.server.shutdown import HttpServer

    built = build_server(args, platform_plan, on_fatal=lambda exc: http.stop_for_fatal_error(exc))
    log.info(
        "listening on http://%s:%d (OpenAI API under /v1)%s",
        args.host,
        args.port,
        "; API key required" if built.api_key else "",
    )
    http = HttpServer(
        uvicorn.Config(built.app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, access_log=False),
        built.app.state.server,
        args.shutdown_timeout,
    )
    http.run()
    built.engine.shutdown()
    if http.fatal is not None:
        log.error("exiting after a fatal engine error: %s", http.fatal)
        return 1
    return 0
