"""`cpuserve bench ...`: what each benchmark command runs (their flags: cli/bench_args.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cpuserve.cli.common import platform_plan
from cpuserve.errors import CpuserveError

log = logging.getLogger("cpuserve")


def cmd_bench_engine(args: argparse.Namespace) -> int:
    _, _, threads = platform_plan(args)
    from cpuserve.bench.engine_bench import render, run_per_kv_cache_dtype
    from cpuserve.model.resolve import resolve_model

    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CpuserveError(f"--concurrency {args.concurrency!r}: expected numbers like 1,4,8,16") from None
    from cpuserve.kv_cache_dtype import is_int8

    kv_dtypes = [kv.strip() for kv in args.kv_cache_dtype.split(",")]
    for kv in kv_dtypes:
        is_int8(kv)  # every name checked before a model is resolved (converted) or loaded
    model_dir = resolve_model(args.model, args.cache_dir)
    results, dtype = run_per_kv_cache_dtype(
        model_dir,
        args.dtype,
        kv_dtypes,
        args.max_model_len,
        concurrencies,
        args.new_tokens,
        args.prompt_words,
        args.repeats,
    )
    print(render(str(model_dir), dtype, threads.count, results))
    return 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    from cpuserve.bench.startup_bench import run_startup_bench
    from cpuserve.model.resolve import resolve_model

    model_dir = resolve_model(args.model, args.cache_dir)  # convert once, outside the measurement
    print(
        run_startup_bench(
            [str(model_dir) if args.model else "", *args.serve_args][bool(not args.model) :], args.repeats
        )
    )
    return 0


def cmd_bench_serving(args: argparse.Namespace) -> int:
    from cpuserve.bench.serving_bench import WORKLOADS, host_isa, render, run
    from cpuserve.model.resolve import bundled_gguf, resolve_model

    model = str(resolve_model(args.model))  # a GGUF's directory: converted once, before the clock starts
    gguf = args.gguf or (str(bundled_gguf()) if args.model is None else None)
    if gguf is None and args.model.endswith(".gguf"):
        gguf = args.model
    workloads = [WORKLOADS[w] for w in (args.workload or list(WORKLOADS))]
    serve_args = [a for a in args.serve_args if a != "--"]
    label = Path(args.model).name if args.model else "SmolLM2-135M Q4_1 (bundled)"
    result = run(model, label, gguf, args.llama_server, serve_args, args.threads, workloads, {}, Path(args.work))
    command = "cpuserve bench serving " + " ".join(sys.argv[3:])
    print(render(result, command, host_isa()))
    return 1 if any(p.errors for pts in [result.ours, result.peer or {}] for ps in pts.values() for p in ps) else 0


def cmd_bench_cluster(args: argparse.Namespace) -> int:
    from cpuserve.bench.cluster_bench import render, run
    from cpuserve.bench.serving_bench import WORKLOADS, host_isa
    from cpuserve.model.resolve import resolve_model

    model = str(resolve_model(args.model))  # a GGUF's directory: made once, before the clock starts
    workloads = [WORKLOADS[w] for w in (args.workload or list(WORKLOADS))]
    results = run(model, args.threads, workloads, Path(args.work))
    print(render(results, "cpuserve bench cluster " + " ".join(sys.argv[3:]), host_isa(), args.threads))
    return 1 if any(p.errors for by in results.values() for pts in by.values() for p in pts) else 0


def cmd_bench_load(args: argparse.Namespace) -> int:
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


def cmd_bench_perplexity(args: argparse.Namespace) -> int:
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
            args.kv_cache_dtype,
        )
    )
    return 0


def cmd_bench_export_gguf(args: argparse.Namespace) -> int:
    from cpuserve.bench.gguf_export import export_gguf
    from cpuserve.model.resolve import bundled_gguf, resolve_hf_model

    src = resolve_hf_model(args.model, args.cache_dir)
    export_gguf(src, Path(args.out), args.type, Path(args.tokenizer_gguf) if args.tokenizer_gguf else bundled_gguf())
    log.info("wrote %s", args.out)
    return 0


def cmd_bench_speed(args: argparse.Namespace) -> int:
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
        pairs, args.llamacpp_python, args.threads, args.prompt, args.decode, args.repeats, weight_bytes, long=args.long
    )
    print(render_speed(result))
    return 0


def cmd_bench_gguf_types(args: argparse.Namespace) -> int:
    import torch

    from cpuserve.bench.gguf_types import FTYPES, compare, type_files

    types = [t.strip().upper() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in FTYPES]
    if unknown:
        raise CpuserveError(f"--types {','.join(unknown)}: expected some of {','.join(FTYPES)}")
    extra = {}
    for item in args.file:
        label, sep, path = item.partition("=")
        if not sep or not Path(path).is_file():
            raise CpuserveError(f"--file {item!r}: expected LABEL=FILE.gguf, an existing file")
        extra[label] = Path(path)
    torch.set_num_threads(args.threads)
    files = type_files(Path(args.work), args.llamacpp_python, types, args.threads) | extra
    print(compare(files, args.llamacpp_python, Path(args.text), args.ctx, args.threads))
    return 0


def cmd_bench_peak(args: argparse.Namespace) -> int:
    import torch

    from cpuserve.bench.make_model import SHAPES
    from cpuserve.bench.peak import measure_efficiency, model_linears, render_efficiency

    if args.shape not in SHAPES:
        raise CpuserveError(f"--shape {args.shape!r}: one of {', '.join(sorted(SHAPES))}")
    try:
        ms = tuple(int(m) for m in args.m.split(","))
    except ValueError:
        ms = ()
    if not ms or min(ms) < 1:
        raise CpuserveError(f"--m {args.m!r}: expected rows per call (at least 1), comma-separated (16,512)")
    for name, _, k in model_linears(SHAPES[args.shape]):
        if args.group < 32 or args.group % 32 or k % args.group:
            raise CpuserveError(f"--group {args.group}: {args.shape}'s {name} has K = {k}, not a multiple of it")
    torch.set_num_threads(args.threads)
    schemes = ((f"W4A8-G{args.group}", 4, args.group), ("W8A8", 8, None))
    print(render_efficiency(measure_efficiency(args.shape, ms, schemes=schemes)))
    return 0


def cmd_bench_make_model(args: argparse.Namespace) -> int:
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


def cmd_bench_itl(args: argparse.Namespace) -> int:
    import shlex
    import tempfile

    import cpuserve
    from cpuserve.bench.itl_bench import render, run_itl_bench
    from cpuserve.model.resolve import resolve_model

    checkout = Path(args.checkout) if args.checkout else Path(cpuserve.__file__).parent.parent
    if not (checkout / "cpuserve" / "__init__.py").is_file():
        raise CpuserveError(f"--checkout {checkout}: no cpuserve package there")
    if args.after <= 1.0 or args.before <= 0 or args.repeats < 1 or args.clients < 1:
        raise CpuserveError(
            "bench itl: --after must exceed 1 s (the window), --before > 0, --repeats and --clients >= 1"
        )
    model_dir = resolve_model(args.model, args.cache_dir)  # convert once, before the server starts
    extra = shlex.split(args.serve_flags)
    max_len = str(max(4096, args.long_tokens + args.max_tokens + 64))
    serve_args = [str(model_dir), "--max-model-len", max_len, "--max-num-seqs", str(args.clients + 1), *extra]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    if args.cache_dir:
        env["CPUSERVE_CACHE_DIR"] = args.cache_dir
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(args.log) if args.log else Path(tmp) / "server.log"
        result = run_itl_bench(
            model_dir,
            serve_args,
            env,
            checkout.resolve(),
            log,
            clients=args.clients,
            long_tokens=args.long_tokens,
            max_tokens=args.max_tokens,
            before=args.before,
            after=args.after,
            repeats=args.repeats,
        )
    command = (
        f"VLLM_CPU_KVCACHE_SPACE={args.kv_cache_gib} cpuserve serve {' '.join(serve_args)} (from {checkout}); "
        f"{args.clients} streaming completions; {args.repeats} x one {args.long_tokens}-token prompt"
    )
    print(render(result, command))
    return 0


def cmd_bench_structured(args: argparse.Namespace) -> int:
    machine, overrides, threads = platform_plan(args)
    from cpuserve.bench.structured_bench import render, result_json, run_structured_bench
    from cpuserve.engine import EngineConfig, LLMEngine
    from cpuserve.kernels import selected_variant_name
    from cpuserve.model.resolve import resolve_model

    if args.streams < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise CpuserveError("bench structured: --streams and --repeats must be >= 1, --new-tokens >= 2")
    model_dir = resolve_model(args.model, args.cache_dir)
    config = EngineConfig(max_model_len=max(1024, args.new_tokens + 256), max_num_seqs=args.streams)
    engine = LLMEngine.from_model_dir(model_dir, config, args.dtype, machine=machine, overrides=overrides)
    result = run_structured_bench(engine, args.streams, args.new_tokens, args.repeats)
    result["model"] = str(model_dir)
    result["dtype"] = str(engine.model.dtype).removeprefix("torch.")
    result["host"] = {
        "cpu": machine.cpu.model_name,
        "arch": machine.cpu.arch,
        "isa": selected_variant_name(),
        "threads": threads.count,
    }
    print(result_json(result) if args.json else render(result))
    return 0 if result["decode"]["same_token_count"] else 1


def cmd_bench_vllm(args: argparse.Namespace) -> int:
    import shlex
    import sys
    import tempfile

    from cpuserve.bench.vllm_bench import render, run_vllm_bench
    from cpuserve.kernels import selected_variant_name

    model, vllm_python = Path(args.model), Path(args.vllm_python)
    if not (model / "config.json").is_file():
        raise CpuserveError(f"bench vllm: {model} is not a checkpoint directory (no config.json)")
    if not vllm_python.is_file():
        raise CpuserveError(f"bench vllm: --vllm-python {vllm_python} does not exist (./run vllm-env makes one)")
    with tempfile.TemporaryDirectory() as work:
        results = run_vllm_bench(
            model, vllm_python, args.prompt, args.decode, args.repeats, args.enforce_eager, args.timeout, Path(work)
        )
    command = "cpuserve bench vllm " + shlex.join(sys.argv[3:])
    print(render(results, command))
    print(f"\nhost ISA: {selected_variant_name()}")
    return 0
