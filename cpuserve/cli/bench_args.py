"""`cpuserve bench ...`: the benchmark subcommands and their flags (what each runs: cli/bench.py)."""

from __future__ import annotations

import argparse

from cpuserve.bench.gguf_types import FTYPES
from cpuserve.cli.bench import (
    cmd_bench_cluster,
    cmd_bench_engine,
    cmd_bench_export_gguf,
    cmd_bench_gguf_types,
    cmd_bench_itl,
    cmd_bench_load,
    cmd_bench_make_model,
    cmd_bench_peak,
    cmd_bench_perplexity,
    cmd_bench_serving,
    cmd_bench_speed,
    cmd_bench_startup,
    cmd_bench_structured,
    cmd_bench_vllm,
)
from cpuserve.cli.common import add_model_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks and benchmark models")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    be = bench_sub.add_parser("engine", help="aggregate decode tok/s at several concurrencies; logprobs cost")
    add_model_args(be)
    be.add_argument("--concurrency", default="1,4,8,16")
    be.add_argument("--new-tokens", type=int, default=32)
    be.add_argument("--prompt-words", type=int, default=32)
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--max-model-len", type=int, default=1024)
    be.add_argument(
        "--kv-cache-dtype", default="auto", help="one or several, comma-separated (auto,int8): compared in one run"
    )
    be.set_defaults(func=cmd_bench_engine)
    bs = bench_sub.add_parser("startup", help="seconds from `cpuserve serve` to the first answered request")
    bs.add_argument("model", nargs="?", default=None)
    bs.add_argument("--cache-dir", default=None)
    bs.add_argument("--repeats", type=int, default=3)
    bs.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra `serve` flags after --")
    bs.set_defaults(func=cmd_bench_startup)
    bl = bench_sub.add_parser("load", help="concurrent streaming clients against a server: errors, TTFT, memory")
    bl.add_argument("model", nargs="?", default=None)
    bl.add_argument("--cache-dir", default=None)
    bl.add_argument("--clients", type=int, default=64)
    bl.add_argument("--seconds", type=float, default=60.0)
    bl.add_argument("--kv-cache-gib", type=float, default=1.0)
    bl.add_argument("--seed", type=int, default=0)
    bl.add_argument("serve_args", nargs=argparse.REMAINDER, help="extra `serve` flags after --")
    bl.set_defaults(func=cmd_bench_load)
    bp = bench_sub.add_parser("perplexity", help="perplexity of cpuserve models and llama.cpp GGUFs, one run")
    bp.add_argument("models", nargs="+", help="HF directories, optionally LABEL=PATH; the first is the baseline")
    bp.add_argument("--gguf", action="append", help="LABEL=FILE.gguf evaluated by llama.cpp on the same windows")
    bp.add_argument("--llamacpp-python", default=None, help="a python with llama_cpp installed")
    bp.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    bp.add_argument("--ctx", type=int, default=512)
    bp.add_argument("--dtype", default="float32")
    bp.add_argument(
        "--kv-cache-dtype",
        action="append",
        help="through the engine's paged KV cache in this dtype (auto, int8, ...); repeat to compare",
    )
    bp.set_defaults(func=cmd_bench_perplexity)
    bg = bench_sub.add_parser("export-gguf", help="an unquantized HF llama directory as a llama.cpp GGUF")
    bg.add_argument("model", nargs="?", default=None)
    bg.add_argument("out")
    bg.add_argument("--type", default="q4_0", choices=["f16", "q8_0", "q4_0"])
    bg.add_argument("--tokenizer-gguf", default=None, help="GGUF to copy tokenizer metadata from (default: bundled)")
    bg.add_argument("--cache-dir", default=None)
    bg.set_defaults(func=cmd_bench_export_gguf)
    bsp = bench_sub.add_parser("speed", help="cpuserve against llama.cpp on the same weights, side by side")
    bsp.add_argument(
        "--pair", action="append", required=True, help="LABEL=CPUSERVE_DIR,LABEL=LLAMACPP.gguf (repeatable)"
    )
    bsp.add_argument("--llamacpp-python", required=True, help="a python with llama-cpp-python installed")
    bsp.add_argument("--threads", type=int, default=2)
    bsp.add_argument("--prompt", type=int, default=512)
    bsp.add_argument("--decode", type=int, default=64)
    bsp.add_argument("--repeats", type=int, default=3)
    bsp.add_argument("--long", type=int, default=0, help="also a prompt of this many tokens and decode behind it")
    bsp.set_defaults(func=cmd_bench_speed)
    bgt = bench_sub.add_parser("gguf-types", help="per GGUF type: cpuserve and llama.cpp perplexity on the same file")
    bgt.add_argument("--llamacpp-python", required=True, help="a python with llama-cpp-python installed")
    bgt.add_argument("--work", default="benchmarks/.work/gguf-types", help="where the quantized files are kept")
    bgt.add_argument("--types", default=",".join(FTYPES), help="llama.cpp file types of SmolLM2, comma-separated")
    bgt.add_argument("--file", action="append", default=[], help="LABEL=FILE.gguf compared as it is (repeatable)")
    bgt.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    bgt.add_argument("--ctx", type=int, default=512)
    bgt.add_argument("--threads", type=int, default=2)
    bgt.set_defaults(func=cmd_bench_gguf_types)
    bpk = bench_sub.add_parser("peak", help="the batched linears of a model shape against the measured int8 peak")
    bpk.add_argument("--shape", default="minicpm5-2b", help="a shape of `bench make-model` (its layer's linears)")
    bpk.add_argument("--m", default="16,512", help="rows per call, comma-separated")
    bpk.add_argument("--group", type=int, default=128, help="W4A8's group size (a multiple of 32 dividing every K)")
    bpk.add_argument("--threads", type=int, default=2)
    bpk.set_defaults(func=cmd_bench_peak)
    mm = bench_sub.add_parser("make-model", help="a checkpoint with a real model's shapes and random weights")
    mm.add_argument("out_dir")
    mm.add_argument("--shape", default="minicpm5-2b", help="minicpm5-2b | minicpm5-tiny | smollm2-135m")
    mm.add_argument("--scheme", default="bf16", choices=["bf16", "w8a8", "w4a8"])
    mm.add_argument("--group-size", type=int, default=128, help="w4a8 group size (default 128, as the seed)")
    mm.add_argument("--pack", action="store_true", help="w4a8 as pack-quantized (as the reference image serves it)")
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--force", action="store_true")
    mm.add_argument("--cache-dir", default=None)
    mm.set_defaults(func=cmd_bench_make_model)
    itl = bench_sub.add_parser("itl", help="how long streams already decoding stall when a ~2,000-token prompt arrives")
    itl.add_argument("model", nargs="?", default=None)
    itl.add_argument("--cache-dir", default=None)
    itl.add_argument(
        "--checkout", default=None, help="serve the cpuserve of this source tree (default: the one running this)"
    )
    itl.add_argument("--clients", type=int, default=8)
    itl.add_argument("--long-tokens", type=int, default=2000, help="tokens of the long prompt")
    itl.add_argument("--max-tokens", type=int, default=2000, help="per stream; the streams are closed long before")
    itl.add_argument("--before", type=float, default=4.0, help="seconds of decoding measured before the long prompt")
    itl.add_argument("--after", type=float, default=2.0, help="seconds the streams go on after its answer")
    itl.add_argument("--repeats", type=int, default=3, help="long prompts sent in turn, one table row each")
    itl.add_argument("--kv-cache-gib", type=float, default=1.0)
    itl.add_argument("--log", default=None, help="the server's log (default: a temporary file)")
    itl.add_argument(
        "--serve-flags", default="", help="extra `serve` flags as one string, e.g. '--max-num-batched-tokens 256'"
    )
    itl.set_defaults(func=cmd_bench_itl)
    bst = bench_sub.add_parser(
        "structured", help="decode tok/s with every row held to a JSON schema vs none; compile and mask times"
    )
    add_model_args(bst)
    bst.add_argument("--streams", type=int, default=8, help="concurrent sequences (default 8)")
    bst.add_argument("--new-tokens", type=int, default=64, help="tokens each stream generates (default 64)")
    bst.add_argument("--repeats", type=int, default=3, help="constrained/unconstrained pairs, order alternating")
    bst.add_argument("--json", action="store_true", help="machine-readable output")
    bst.set_defaults(func=cmd_bench_structured)
    bv = bench_sub.add_parser(
        "vllm", help="one checkpoint: vLLM's own kernels vs vLLM + the cpuserve plugin vs cpuserve serve"
    )
    bv.add_argument("model", help="a compressed-tensors checkpoint directory")
    bv.add_argument("--vllm-python", required=True, help="the python of a vLLM CPU environment (./run vllm-env)")
    bv.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    bv.add_argument("--decode", type=int, default=32, help="new tokens for the decode measurement")
    bv.add_argument("--repeats", type=int, default=2, help="prefill repeats (median)")
    bv.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    bv.add_argument("--timeout", type=float, default=1800, help="seconds allowed per request and per start")
    bv.set_defaults(func=cmd_bench_vllm)
    from cpuserve.bench.serving_bench import WORKLOADS

    bsv = bench_sub.add_parser(
        "serving", help="cpuserve's server against llama-server: 1/4/8/16 streams, output tok/s and TTFT"
    )
    bsv.add_argument("model", nargs="?", default=None, help="what cpuserve serves (default: the bundled model)")
    bsv.add_argument("--gguf", default=None, help="the GGUF llama-server serves (default: the model, if a GGUF)")
    bsv.add_argument("--llama-server", default=None, help="the llama-server binary (none: cpuserve alone)")
    bsv.add_argument("--threads", type=int, default=2, help="threads for each server (default 2)")
    bsv.add_argument(
        "--workload", action="append", choices=sorted(WORKLOADS), help="prompt-heavy (256/64), decode-heavy (32/128)"
    )
    bsv.add_argument("--work", default="benchmarks/.work/serving", help="where the servers' logs go")
    bsv.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after MODEL: more `cpuserve serve` flags (options go before MODEL)",
    )
    bsv.set_defaults(func=cmd_bench_serving)
    bcl = bench_sub.add_parser(
        "cluster",
        help="the same cores as one cpuserve serve or as replicas behind the Ray ingress: tok/s and the ingress's TTFT",
    )
    bcl.add_argument("model", nargs="?", default=None, help="what is served (default: the bundled model)")
    bcl.add_argument("--threads", type=int, default=2, help="cores in every set-up (default 2)")
    bcl.add_argument(
        "--workload", action="append", choices=sorted(WORKLOADS), help="prompt-heavy (256/64), decode-heavy (32/128)"
    )
    bcl.add_argument("--work", default="benchmarks/.work/cluster", help="where the servers' logs go")
    bcl.set_defaults(func=cmd_bench_cluster)
