"""`cpuserve doctor`, `quantize` and `convert`: inspecting and preparing models."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from cpuserve import defaults
from cpuserve.cli.common import add_model_args
from cpuserve.errors import ConfigError, CpuserveError

log = logging.getLogger("cpuserve")


def add_doctor_parser(sub: argparse._SubParsersAction) -> None:
    doc = sub.add_parser("doctor", help="explain what was detected and chosen, and whether a model fits")
    add_model_args(doc)
    doc.add_argument("--no-model", action="store_true", help="report on the machine only")
    doc.add_argument("--json", action="store_true", help="machine-readable output")
    doc.add_argument("--max-model-len", type=int, default=None)
    doc.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS)
    doc.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS)
    doc.add_argument("--kv-cache-dtype", default="auto", help="as serve's: auto, bfloat16, float16, int8 (fp8)")
    doc.set_defaults(func=cmd_doctor)


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    qz = sub.add_parser("quantize", help="quantize a checkpoint to compressed-tensors W4A8 or W8A8")
    qz.add_argument("src", nargs="?", default=None, help="HF directory or .gguf (default: the bundled SmolLM2)")
    qz.add_argument("out_dir")
    qz.add_argument("--scheme", required=True, choices=["w4a8", "w8a8"])
    qz.add_argument("--group-size", type=int, default=None, help="w4a8: 32, 64 or 128 (default), 0 per channel")
    qz.add_argument("--pack", action="store_true", help="pack-quantized (int32 words) instead of int-quantized")
    qz.add_argument(
        "--activations",
        default="token",
        choices=["token", "group"],
        help="int8 activation scales per token (default; what vLLM reads) or per group of the weights' (w4a8)",
    )
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
    calib = qz.add_mutually_exclusive_group()
    calib.add_argument(
        "--calibration",
        nargs="+",
        default=None,
        metavar="TEXT_FILE",
        help="plain-text files to calibrate on (default: text the model writes itself, seeded)",
    )
    calib.add_argument(
        "--no-calibration",
        action="store_true",
        help="plain round-to-nearest: no SmoothQuant, no GPTQ, no calibration text",
    )
    # None: not given (a calibration flag with --no-calibration is refused, not ignored)
    qz.add_argument("--calibration-tokens", type=int, default=None, help="at most this many tokens (default 16384)")
    qz.add_argument("--calibration-window", type=int, default=None, help="tokens per window (default 512)")
    qz.add_argument(
        "--calibration-seed", type=int, default=None, help="seed of the text the model writes itself (default 0)"
    )
    qz.add_argument("--smoothquant", type=float, default=None, help="SmoothQuant alpha (default 0.65); 0: off")
    qz.add_argument(
        "--gptq", action=argparse.BooleanOptionalAction, default=None, help="GPTQ error feedback when calibrating"
    )
    qz.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="GPTQ visits the most active inputs first (default on; groups stay contiguous: no g_idx)",
    )
    qz.add_argument("--force", action="store_true")
    qz.add_argument("--cache-dir", default=None)
    qz.set_defaults(func=cmd_quantize)


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    conv = sub.add_parser("convert", help="convert a llama GGUF file into an HF directory (bf16 safetensors)")
    conv.add_argument("gguf", help="the .gguf file")
    conv.add_argument("out_dir", help="the HF directory to create")
    conv.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    conv.set_defaults(func=cmd_convert)


def cmd_doctor(args: argparse.Namespace) -> int:
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
        kv_cache_dtype=args.kv_cache_dtype,
    )
    report["problems"][:0] = problems
    print(render_json(report) if args.json else render_text(report))
    return 1 if report["problems"] else 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from cpuserve.model.resolve import resolve_hf_model
    from cpuserve.offline.calibrate import CalibrationOptions
    from cpuserve.offline.quantize import quantize_checkpoint

    given = {
        "--calibration-tokens": args.calibration_tokens,
        "--calibration-window": args.calibration_window,
        "--calibration-seed": args.calibration_seed,
        "--smoothquant": args.smoothquant,
        "--gptq/--no-gptq": args.gptq,
        "--act-order/--no-act-order": args.act_order,
    }
    moot = [flag for flag, value in given.items() if value is not None]
    if args.no_calibration and moot:
        raise ConfigError(f"{', '.join(moot)}: no effect with --no-calibration (round-to-nearest)")
    if args.calibration and args.calibration_seed is not None:
        raise ConfigError("--calibration-seed: no effect with --calibration (it seeds the text the model writes)")
    # what is not given keeps quantize_checkpoint's and CalibrationOptions' defaults
    options = {} if args.gptq is None else {"gptq": args.gptq}
    if args.act_order is not None:
        if args.gptq is False:
            raise ConfigError("--act-order/--no-act-order: no effect with --no-gptq")
        options["act_order"] = args.act_order
    if args.smoothquant is not None:
        options["smoothquant_alpha"] = args.smoothquant if args.smoothquant > 0 else None
    sizes = {"calibration_tokens": args.calibration_tokens, "calibration_window": args.calibration_window}
    sizes["calibration_seed"] = args.calibration_seed
    src = resolve_hf_model(args.src, args.cache_dir)  # float weights: a GGUF (the bundled one) converted once
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
        calibration=None if args.no_calibration else [Path(p) for p in args.calibration or []] or "self",
        calibration_options=CalibrationOptions(**options),
        act_groups=args.activations == "group",
        **{k: v for k, v in sizes.items() if v is not None},
    )
    log.info("wrote %s", out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from cpuserve.offline.gguf_convert import convert_gguf

    out = convert_gguf(Path(args.gguf), Path(args.out_dir), force=args.force)
    log.info("wrote %s", out)
    return 0
