"""The `cpuserve` command line: one sub-command per job, user errors as one line on stderr."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from cpuserve import __version__, defaults
from cpuserve.errors import CpuserveError

log = logging.getLogger("cpuserve")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where converted models are kept (default: $CPUSERVE_CACHE_DIR or ~/.cache/cpuserve)",
    )
    p.add_argument("--dtype", default="auto", help="auto | bfloat16 | float16 | float32 (default: auto)")


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise CpuserveError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise CpuserveError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CpuserveError(f"--top-p must be in (0, 1], got {args.top_p}")
    machine, overrides, _ = _platform_plan(args)  # before torch loads: threads pinned one per core
    from cpuserve.detokenizer import IncrementalDetokenizer
    from cpuserve.generate import SimpleSampling, generate_ids
    from cpuserve.model.footprint import model_facts, plan_model_memory
    from cpuserve.model.loader import load_model
    from cpuserve.model.resolve import resolve_model
    from cpuserve.tokenizer import GenerationDefaults, Tokenizer

    model_dir = resolve_model(args.model, args.cache_dir)
    spec, _, facts = model_facts(model_dir, args.dtype)  # refuse before reading weights if it cannot fit
    plan_model_memory(machine, overrides, spec, facts, spec.max_position_embeddings, 1, 512)
    tokenizer = Tokenizer(model_dir)
    defaults = GenerationDefaults.load(model_dir)
    model = load_model(model_dir, args.dtype)
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
    for token in generate_ids(model, prompt_ids, params):
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


def _platform_plan(args: argparse.Namespace):
    """Detect the machine, read overrides, size and pin the thread pool; log what was chosen."""
    import os

    from cpuserve.platform.machine import apply_thread_plan, detect_machine
    from cpuserve.platform.overrides import log_not_needed, read_overrides
    from cpuserve.platform.plan import plan_kernel, plan_threads
    from cpuserve.platform.sysfs import format_cpulist

    machine = detect_machine()
    overrides = read_overrides(os.environ)
    log_not_needed(overrides)
    threads = plan_threads(machine.cpu, machine.resources, overrides)
    kernel = plan_kernel(machine.cpu, overrides)
    apply_thread_plan(threads)
    where = f"pinned to {format_cpulist(threads.cpus)}" if threads.pinned else "not pinned"
    log.info(
        "%s, %s; %d threads %s (%s); kernel variant %s",
        machine.cpu.model_name,
        machine.cpu.arch,
        threads.count,
        where,
        threads.reason,
        kernel.variant,
    )
    return machine, overrides, threads


def _cmd_doctor(args: argparse.Namespace) -> int:
    import os

    from cpuserve.doctor import build_report, render_json, render_text
    from cpuserve.model.resolve import resolve_model
    from cpuserve.platform.machine import detect_machine

    model_dir = None
    problems = []
    if not args.no_model:
        try:
            model_dir = resolve_model(args.model, args.cache_dir)
        except CpuserveError as exc:
            problems.append(str(exc))
    report = build_report(
        detect_machine(),
        os.environ,
        model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    report["problems"][:0] = problems
    print(render_json(report) if args.json else render_text(report))
    return 1 if report["problems"] else 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    _, _, threads = _platform_plan(args)
    from cpuserve.bench.engine_bench import render, run_engine_bench
    from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
    from cpuserve.model.resolve import resolve_model

    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CpuserveError(f"--concurrency {args.concurrency!r}: expected numbers like 1,4,8,16") from None
    model_dir = resolve_model(args.model, args.cache_dir)
    config = EngineConfig(max_model_len=args.max_model_len, max_num_seqs=max(concurrencies))
    engine = LLMEngine.from_model_dir(model_dir, config, args.dtype)
    result = run_engine_bench(engine, concurrencies, args.new_tokens, args.prompt_words, args.repeats)
    print(render(str(model_dir), str(engine.model.dtype).removeprefix("torch."), threads.count, result))
    return 0


def _cmd_bench_startup(args: argparse.Namespace) -> int:
    from cpuserve.bench.startup_bench import run_startup_bench
    from cpuserve.model.resolve import resolve_model

    model_dir = resolve_model(args.model, args.cache_dir)  # convert once, outside the measurement
    print(
        run_startup_bench(
            [str(model_dir) if args.model else "", *args.serve_args][bool(not args.model) :], args.repeats
        )
    )
    return 0


def _cmd_bench_load(args: argparse.Namespace) -> int:
    from cpuserve.bench.load_test import render, run_load
    from cpuserve.model.resolve import resolve_model

    model_dir = resolve_model(args.model, args.cache_dir)  # convert once, before the clock starts
    serve_args = [str(model_dir), "--max-num-seqs", str(args.clients), *args.serve_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    result = run_load(serve_args, env, args.clients, args.seconds, args.seed)
    command = (
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib} cpuserve serve {' '.join(serve_args)}; "
        f"{args.clients} streaming chat clients for {args.seconds:.0f} s"
    )
    print(render(result, command))
    return 1 if result.errors else 0


def _cmd_bench_perplexity(args: argparse.Namespace) -> int:
    import torch

    from cpuserve.bench.perplexity import run_perplexity

    def labelled(items: list[str]) -> dict[str, Path]:
        pairs = [item.split("=", 1) if "=" in item else (Path(item).name, item) for item in items]
        return {label: Path(path) for label, path in pairs}

    print(
        run_perplexity(
            labelled(args.models),
            labelled(args.gguf or []),
            Path(args.text),
            args.ctx,
            args.dtype,
            args.llamacpp_python,
            torch.get_num_threads(),
        )
    )
    return 0


def _cmd_bench_export_gguf(args: argparse.Namespace) -> int:
    from cpuserve.bench.gguf_export import export_gguf
    from cpuserve.model.resolve import bundled_gguf, resolve_model

    src = resolve_model(args.model, args.cache_dir)
    export_gguf(src, Path(args.out), args.type, Path(args.tokenizer_gguf) if args.tokenizer_gguf else bundled_gguf())
    log.info("wrote %s", args.out)
    return 0


def _cmd_bench_speed(args: argparse.Namespace) -> int:
    from cpuserve.bench.speed import decode_bytes, measure_speed, render_speed

    pairs, weight_bytes = [], {}
    for item in args.pair:
        try:
            ours, theirs = item.split(",", 1)
            ours_label, ours_dir = ours.split("=", 1)
            theirs_label, gguf = theirs.split("=", 1)
        except ValueError:
            raise CpuserveError(f"--pair {item!r}: expected LABEL=DIR,LABEL=FILE.gguf") from None
        weight_bytes.update(decode_bytes(ours_label, Path(ours_dir), theirs_label, Path(gguf)))
        pairs.append((ours_label, Path(ours_dir), theirs_label, Path(gguf)))
    result = measure_speed(
        pairs, args.llamacpp_python, args.threads, args.prompt, args.decode, args.repeats, weight_bytes
    )
    print(render_speed(result))
    return 0


def _cmd_bench_make_model(args: argparse.Namespace) -> int:
    from cpuserve.bench.make_model import make_model
    from cpuserve.model.resolve import resolve_model

    tokenizer_dir = resolve_model(None, args.cache_dir)
    out = Path(args.out_dir)
    if args.scheme == "bf16":
        make_model(args.shape, out, tokenizer_dir, args.seed, args.force)
    else:
        import tempfile

        from cpuserve.offline.quantize import quantize_checkpoint

        if out.exists() and not args.force:
            raise CpuserveError(f"{out}: already exists (pass --force to replace it)")
        with tempfile.TemporaryDirectory(dir=out.parent if out.parent.exists() else None) as tmp:
            bf16 = make_model(args.shape, Path(tmp) / "bf16", tokenizer_dir, args.seed)
            group = args.group_size if args.scheme == "w4a8" else None
            quantize_checkpoint(bf16, out, args.scheme, group, args.pack, force=args.force)
    log.info("wrote %s", out)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from cpuserve.server.serve import serve

    return serve(args, _platform_plan)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from cpuserve.model.resolve import resolve_model
    from cpuserve.offline.calibrate import CalibrationOptions
    from cpuserve.offline.quantize import quantize_checkpoint

    src = resolve_model(args.src, args.cache_dir)
    ignore = None if args.ignore is None else [i for part in args.ignore for i in part.split(",") if i]
    out = quantize_checkpoint(
        src,
        Path(args.out_dir),
        args.scheme,
        args.group_size,
        args.pack,
        ignore,
        args.force,
        scale_method=args.scale_method,
        calibration=[Path(p) for p in args.calibration or []],
        calibration_options=CalibrationOptions(
            smoothquant_alpha=None if args.smoothquant <= 0 else args.smoothquant, gptq=args.gptq
        ),
        calibration_tokens=args.calibration_tokens,
    )
    log.info("wrote %s", out)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from cpuserve.offline.gguf_convert import convert_gguf

    out = convert_gguf(Path(args.gguf), Path(args.out_dir), force=args.force)
    log.info("wrote %s", out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpuserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"cpuserve {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text (the user message with --chat)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default=None, help="a system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)

    from cpuserve.server.serve import add_serve_args

    srv = sub.add_parser("serve", help="serve a model over the OpenAI API (a drop-in for `vllm serve`)")
    add_serve_args(srv)
    srv.set_defaults(func=_cmd_serve)

    doc = sub.add_parser("doctor", help="explain what was detected and chosen, and whether a model fits")
    _add_model_args(doc)
    doc.add_argument("--no-model", action="store_true", help="report on the machine only")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--max-model-len", type=int, default=None)
    doc.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS)
    doc.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS)
    doc.set_defaults(func=_cmd_doctor)

    bench = sub.add_parser("bench", help="benchmarks and benchmark models")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    be = bench_sub.add_parser("engine", help="aggregate decode tok/s at several concurrencies; logprobs cost")
    _add_model_args(be)
    be.add_argument("--concurrency", default="1,4,8,16")
    be.add_argument("--new-tokens", type=int, default=32)
    be.add_argument("--prompt-words", type=int, default=32)
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--max-model-len", type=int, default=1024)
    be.set_defaults(func=_cmd_bench_engine)
    bs = bench_sub.add_parser("startup", help="seconds from `cpuserve serve` to the first answered request")
    bs.add_argument("model", nargs="?", default=None)
    bs.add_argument("--cache-dir", default=None)
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra `serve` flags after --")
    bs.set_defaults(func=_cmd_bench_startup)
    bl = bench_sub.add_parser("load", help="concurrent streaming clients against a server: errors, TTFT, memory")
    bl.add_argument("model", nargs="?", default=None)
    bl.add_argument("--cache-dir", default=None)
    bl.add_argument("--clients", type=int, default=64)
    bl.add_argument("--seconds", type=float, default=60.0)
    bl.add_argument("--kv-cache-gib", type=float, default=1.0)
    bl.add_argument("--seed", type=int, default=0)
    bl.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra `serve` flags after --")
    bl.set_defaults(func=_cmd_bench_load)
    bp = bench_sub.add_parser("perplexity", help="perplexity of cpuserve models and llama.cpp GGUFs, one run")
    bp.add_argument("models", nargs="+", help="HF directories, optionally LABEL=PATH; the first is the baseline")
    bp.add_argument("--gguf", action="append", help="LABEL=FILE.gguf evaluated by llama.cpp on the same windows")
    bp.add_argument("--llamacpp-python", default=None, help="a python with llama_cpp installed")
    bp.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    bp.add_argument("--ctx", type=int, default=512)
    bp.add_argument("--dtype", default="float32")
    bp.set_defaults(func=_cmd_bench_perplexity)
    bg = bench_sub.add_parser("export-gguf", help="an unquantized HF llama directory as a llama.cpp GGUF")
    bg.add_argument("model", nargs="?", default=None)
    bg.add_argument("out")
    bg.add_argument("--type", default="q4_0", choices=["f16", "q8_0", "q4_0"])
    bg.add_argument("--tokenizer-gguf", default=None, help="GGUF to copy tokenizer metadata from (default: bundled)")
    bg.add_argument("--cache-dir", default=None)
    bg.set_defaults(func=_cmd_bench_export_gguf)
    bsp = bench_sub.add_parser("speed", help="cpuserve against llama.cpp on the same weights, side by side")
    bsp.add_argument(
        "--pair", action="append", required=True, help="LABEL=CPUSERVE_DIR,LABEL=LLAMACPP.gguf (repeatable)"
    )
    bsp.add_argument("--llamacpp-python", required=True, help="a python with llama-cpp-python installed")
    bsp.add_argument("--threads", type=int, default=2)
    bsp.add_argument("--prompt", type=int, default=512)
    bsp.add_argument("--decode", type=int, default=64)
    bsp.add_argument("--repeats", type=int, default=3)
    bsp.set_defaults(func=_cmd_bench_speed)
    mm = bench_sub.add_parser("make-model", help="a checkpoint with a real model's shapes and random weights")
    mm.add_argument("out_dir")
    mm.add_argument("--shape", default="minicpm5-2b", help="minicpm5-2b | smollm2-135m")
    mm.add_argument("--scheme", default="bf16", choices=["bf16", "w8a8", "w4a8"])
    mm.add_argument("--group-size", type=int, default=128, help="w4a8 group size (default 128, as the seed)")
    mm.add_argument("--pack", action="store_true", help="w4a8 as pack-quantized (as the reference image serves it)")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--force", action="store_true")
    mm.add_argument("--cache-dir", default=None)
    mm.set_defaults(func=_cmd_bench_make_model)

    qz = sub.add_parser("quantize", help="quantize a checkpoint to compressed-tensors W4A8 or W8A8")
    qz.add_argument("src", nargs="?", default=None, help="HF directory or .gguf (default: the bundled SmolLM2)")
    qz.add_argument("out_dir")
    qz.add_argument("--scheme", required=True, choices=["w4a8", "w8a8"])
    qz.add_argument("--group-size", type=int, default=None, help="w4a8: 32, 64 or 128 (default), 0 per channel")
    qz.add_argument("--pack", action="store_true", help="pack-quantized (int32 words) instead of int-quantized")
    qz.add_argument(
        "--ignore",
        action="append",
        default=None,
        help="modules left unquantized: names or re:patterns, comma-separated (default: lm_head)",
    )
    qz.add_argument(
        "--scale-method",
        default="mse",
        choices=["mse", "minmax"],
        help="mse: least-error scale per group (default); minmax: compressed-tensors' amax rule",
    )
    qz.add_argument(
        "--calibration",
        nargs="+",
        default=None,
        metavar="TEXT_FILE",
        help="plain-text files to calibrate on: enables SmoothQuant folding and GPTQ (default: data-free RTN)",
    )
    qz.add_argument("--calibration-tokens", type=int, default=8192, help="at most this many calibration tokens")
    qz.add_argument(
        "--smoothquant",
        type=float,
        default=0.65,
        help="SmoothQuant strength alpha with --calibration; 0: off",
    )
    qz.add_argument(
        "--gptq", action=argparse.BooleanOptionalAction, default=True, help="GPTQ error feedback with --calibration"
    )
    qz.add_argument("--force", action="store_true")
    qz.add_argument("--cache-dir", default=None)
    qz.set_defaults(func=_cmd_quantize)

    conv = sub.add_parser("convert", help="convert a llama GGUF file into an HF directory (bf16 safetensors)")
    conv.add_argument("gguf", help="the .gguf file")
    conv.add_argument("out_dir", help="the HF directory to create")
    conv.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    conv.set_defaults(func=_cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="[cpuserve] %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except CpuserveError as exc:
        if args.debug:
            raise
        print(f"cpuserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cpuserve: interrupted", file=sys.stderr)
        return 130
