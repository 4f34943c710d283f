"""`cpuserve serve`'s flags: the reference image's `vllm serve` command line, and vLLM's other
flags people write, each with its vLLM meaning or refused.

Flags that mean nothing here are accepted and logged once as such (NO_EFFECT); a value the engine
cannot honour is refused with one line naming the flag; unknown flags are an error (argparse).
"""

from __future__ import annotations

import argparse
import json
import logging
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
    "enable_chunked_prefill": "prompts are always prefilled in chunks of --max-num-batched-tokens",
    "max_seq_len_to_capture": "no graphs are captured",
    "disable_custom_all_reduce": "one process: nothing is all-reduced",
    "disable_frontend_multiprocessing": "the API server and the engine share one process",
    "max_parallel_loading_workers": "weights are read from memory-mapped files, in one process",
    "disable_uvicorn_access_log": "uvicorn's access log is always off (cpuserve.access logs each request)",
    "revision": "models load from local paths, never from a hub",
    "tokenizer_revision": "tokenizers load from local paths, never from a hub",
    "code_revision": "remote code is never run",
    "download_dir": "nothing is ever downloaded",
}

# vLLM's --load-format values cpuserve reads (check_model_flags holds them to the checkpoint found).
LOAD_FORMATS = frozenset({"auto", "safetensors", "gguf"})


def _json_list(text: str) -> list[str]:
    """vLLM's CORS flags take JSON lists (`'["https://a.example"]'`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


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
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="the checkpoint's quantization method as vLLM names it (compressed-tensors, gguf): checked, "
        "since cpuserve quantizes offline (`cpuserve quantize`)",
    )
    p.add_argument("--load-format", default="auto", help="auto, safetensors or gguf (checked against the model)")
    p.add_argument("--tokenizer", default=None, help="a local directory with the tokenizer (default: the model's)")
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.MAX_LOGPROBS,
        help="the most logprobs / top_logprobs a request may ask for (-1: the vocabulary)",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        help="JSON sampling defaults over the generation config's, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument("--root-path", default=None, help="the path prefix a proxy in front of the server strips")
    p.add_argument(
        "--allowed-origins", type=_json_list, default=[], help="CORS: JSON list of origins (default none, as vLLM)"
    )
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help='CORS: JSON list (default ["*"])')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help='CORS: JSON list (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key (and --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None)
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to check client certificates with")
    p.add_argument(
        "--ssl-cert-reqs", type=int, default=0, help="client certificates: 0 none, 1 optional, 2 required (ssl module)"
    )
    p.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--enable-prompt-tokens-details", action="store_true", help="usage says how much was cached")
    # Accepted, no effect here (see NO_EFFECT).
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--max-seq-len-to-capture", type=int, default=None)
    p.add_argument("--disable-custom-all-reduce", action="store_true")
    p.add_argument("--disable-frontend-multiprocessing", action="store_true")
    p.add_argument("--max-parallel-loading-workers", type=int, default=None)
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--revision", default=None)
    p.add_argument("--tokenizer-revision", default=None)
    p.add_argument("--code-revision", default=None)
    p.add_argument("--download-dir", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument("--language-model-only", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--swap-space", type=float, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--trust-remote-code", action="store_true")


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse flag values the engine cannot honour (one line each); log the accepted no-ops."""
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1 or args.data_parallel_size != 1:
        raise CpuserveError(
            "--tensor-parallel-size, --pipeline-parallel-size and --data-parallel-size must be 1: cpuserve runs one "
            "engine (`cpuserve cluster` runs replicas)"
        )
    if args.enable_chunked_prefill is False:
        raise CpuserveError(
            "--no-enable-chunked-prefill cannot be honoured: prompts longer than --max-num-batched-tokens are "
            "always prefilled in chunks (raise --max-num-batched-tokens to prefill longer prompts in one step)"
        )
    if args.load_format not in LOAD_FORMATS:
        why = "pickled weights are never loaded" if args.load_format in ("pt", "npcache") else "not supported"
        raise CpuserveError(f"--load-format {args.load_format}: {why} (auto, safetensors or gguf)")
    if args.max_logprobs < -1:
        raise CpuserveError("--max-logprobs must be -1 (the vocabulary) or >= 0")
    check_tls(args)
    if args.root_path is not None and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise CpuserveError(f"--root-path {args.root_path}: a path prefix like /api (leading /, no trailing /)")
    generation_overrides(args.override_generation_config)  # refuses what it cannot honour (values: build_server)
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


# --override-generation-config keys this engine applies as request defaults (vLLM's names).
# max_new_tokens: the default max_tokens of chat and completions requests.
GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "max_new_tokens",
)


def check_tls(args: argparse.Namespace) -> None:
    """The --ssl-* flags, checked by building the TLS context uvicorn will (a bad PEM or a key that
    does not match the certificate fails here, in one line, not after the model has loaded)."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs != 0:
            raise CpuserveError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile")
        return
    if args.ssl_certfile is None:
        raise CpuserveError("--ssl-keyfile needs --ssl-certfile (which may hold the key too)")
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        value = getattr(args, name)
        if value is not None and not Path(value).is_file():
            raise CpuserveError(f"--{name.replace('_', '-')} {value}: no such file")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise CpuserveError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
    if args.ssl_cert_reqs != 0 and args.ssl_ca_certs is None:
        raise CpuserveError(
            "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (what client certificates are checked against)"
        )
    import ssl

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        key = f" / --ssl-keyfile {args.ssl_keyfile}" if args.ssl_keyfile else ""
        raise CpuserveError(f"--ssl-certfile {args.ssl_certfile}{key}: {exc}") from None
    if args.ssl_ca_certs is not None:
        try:
            context.load_verify_locations(args.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise CpuserveError(f"--ssl-ca-certs {args.ssl_ca_certs}: {exc}") from None


def generation_overrides(text: str | None) -> dict[str, Any]:
    """--override-generation-config's JSON object, checked as a request's values are: sampling
    defaults over the model's, which no request would be refused for."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CpuserveError(f"--override-generation-config: not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CpuserveError("--override-generation-config: expected a JSON object")
    unknown = sorted(set(value) - set(GENERATION_KEYS))
    if unknown:
        raise CpuserveError(
            f"--override-generation-config: {', '.join(unknown)} cannot be honoured "
            f"(supported: {', '.join(GENERATION_KEYS)})"
        )
    for key, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise CpuserveError(f"--override-generation-config: {key} must be a number, got {v!r}")
    for key in ("top_k", "max_new_tokens"):
        if key in value and value[key] != int(value[key]):
            raise CpuserveError(f"--override-generation-config: {key} must be an integer, got {value[key]}")
    if value.get("max_new_tokens", 1) < 1:
        raise CpuserveError(f"--override-generation-config: max_new_tokens must be >= 1, got {value['max_new_tokens']}")
    return {k: int(v) if k in ("top_k", "max_new_tokens") else v for k, v in value.items()}


def checked_generation_overrides(text: str | None) -> dict[str, Any]:
    """generation_overrides, their values held to a request's bounds (imports the engine, so torch:
    called after the platform plan has set the threads up)."""
    values = generation_overrides(text)
    from cpuserve.engine import InvalidRequest, SamplingParams

    try:  # the vocabulary is not known yet: top_k's upper bound is checked per request
        SamplingParams(**{k: v for k, v in values.items() if k != "max_new_tokens"}).validate(2**31 - 1)
    except InvalidRequest as exc:
        raise CpuserveError(f"--override-generation-config: {exc}") from None
    return values


def checkpoint_method(model_dir: Path) -> str | None:
    """The model's quantization method as vLLM's --quantization names it (None: unquantized)."""
    from cpuserve.model.gguf_source import POINTER_FILE

    if (model_dir / POINTER_FILE).is_file():
        return "gguf"
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader names what is wrong with the directory
    return (config.get("quantization_config") or {}).get("quant_method")


def check_model_flags(args: argparse.Namespace, model_dir: Path) -> None:
    """Flags that describe the checkpoint, checked against the one found (before its weights load)."""
    method = checkpoint_method(model_dir)
    if args.quantization is not None and args.quantization != method:
        has = f"is quantized with {method}" if method else "is not quantized"
        hint = "" if method else " (cpuserve quantizes offline: `cpuserve quantize`)"
        raise CpuserveError(f"--quantization {args.quantization}: {args.model or model_dir} {has}{hint}")
    is_gguf = method == "gguf"
    if args.load_format != "auto" and (args.load_format == "gguf") != is_gguf:
        raise CpuserveError(
            f"--load-format {args.load_format}: the model is {'a GGUF file' if is_gguf else 'a safetensors directory'}"
        )


def local_tokenizer(value: str | None) -> Path | None:
    """--tokenizer: a local directory with tokenizer.json (nothing is downloaded)."""
    if value is None:
        return None
    path = Path(value)
    if not (path / "tokenizer.json").is_file():
        raise CpuserveError(
            f"--tokenizer {value}: not a local directory with a tokenizer.json (tokenizers load from local paths)"
        )
    return path
