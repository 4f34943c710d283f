"""`cpuserve quantize`: symmetric quantization of a bf16/fp16/fp32 checkpoint into a
compressed-tensors checkpoint (calibrated by calibrate.py on a user's texts or the model's own
samples, or round-to-nearest; in Python `calibration=None`, the CLI's `--no-calibration`, is
round-to-nearest), written with the same conventions llm-compressor uses (so vLLM
could load it): q = clamp(round(w / scale), -2^(bits-1), 2^(bits-1) - 1), scales stored in bf16 and
q computed from the stored scale. The scale is compressed-tensors' amax / ((2^bits - 1) / 2)
(`minmax`) or, by default, the error-minimising one among a few candidates (`mse`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from cpuserve.errors import ConfigError
from cpuserve.model.checkpoint import SafetensorsCheckpoint, ShardWriter, atomic_directory, refuse_existing
from cpuserve.model.config import load_spec
from cpuserve.model.decoder import CausalLM
from cpuserve.model.prefused import split_prefused
from cpuserve.offline.calibrate import CalibrationOptions, Quantizer, calibrate_and_quantize
from cpuserve.quant.config import GROUP_SIZES, WeightQuant, is_ignored
from cpuserve.quant.linear import Linear
from cpuserve.quant.packing import pack_int
from cpuserve.quant.rtn import quantize_weight, quantize_weight_in_chunks

COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
)
SCHEMES = {"w4a8": 4, "w8a8": 8}

# Self-calibrated W8A8 SmolLM2 (docs/benchmarks.md): 8192 sampled tokens +1.48% perplexity on one host
# and +1.54% on another, 16384 tokens +1.27% (issue 18 asks for 1.5%), at about 1.7x the time.
DEFAULT_CALIBRATION_TOKENS = 16384


def quantization_config(quant: WeightQuant, ignore: list[str]) -> dict[str, Any]:
    fmt = "pack-quantized" if quant.packed else "int-quantized"
    args = {
        # GPTQ visits columns in act-order with static groups (calibrate.py): contiguous groups, no
        # g_idx, stored exactly as actorder null (compressed-tensors would also say "weight"); null
        # is what the reference's contract and this project's reader take
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "observer": "minmax",
        "observer_kwargs": {},
        "scale_dtype": None,
        "zp_dtype": None,
        "symmetric": True,
        "type": "int",
    }
    weights = {
        **args,
        "num_bits": quant.bits,
        "strategy": "group" if quant.group_size else "channel",
        "group_size": quant.group_size,
    }
    # per token (the reference's contract, what vLLM reads), or per group of the weights' (--activations group)
    strategy, act_group = ("group", quant.group_size) if quant.act_groups else ("token", None)
    activations = {**args, "num_bits": 8, "strategy": strategy, "group_size": act_group, "dynamic": True}
    activations["observer"] = None
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "format": fmt,
                "weights": weights,
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def quantize_checkpoint(
    src: Path,
    out: Path,
    scheme: str,
    group_size: int | None = None,
    pack: bool = False,
    ignore: list[str] | None = None,
    force: bool = False,
    progress: bool = True,
    scale_method: str = "mse",
    calibration: list[Path] | Literal["self"] | None = None,
    calibration_options: CalibrationOptions | None = None,
    calibration_tokens: int = DEFAULT_CALIBRATION_TOKENS,
    calibration_window: int = 512,
    calibration_seed: int = 0,
    act_groups: bool = False,
) -> Path:
    """Write OUT as a compressed-tensors checkpoint; with calibration texts, or "self" (text the model
    writes itself, offline/self_calibration.py), smoothing and GPTQ (cpuserve/offline/calibrate.py)
    replace plain round-to-nearest."""
    if scheme not in SCHEMES:
        raise ConfigError(f"--scheme {scheme!r}: expected one of {', '.join(SCHEMES)}")
    refuse_existing(out, force)  # before minutes of calibration, not after
    bits = SCHEMES[scheme]
    if bits == 4:
        group_size = 128 if group_size is None else group_size
        if group_size not in GROUP_SIZES and group_size != 0:
            raise ConfigError(
                f"--group-size {group_size}: expected {', '.join(map(str, GROUP_SIZES))} (0: per channel)"
            )
    elif group_size not in (None, 0):
        raise ConfigError("--group-size: w8a8 is channel-wise (one scale per output channel)")
    if act_groups and not (bits == 4 and group_size):
        raise ConfigError("--activations group: needs weights in groups (w4a8 with a --group-size)")
    quant = WeightQuant(bits=bits, group_size=group_size or None, packed=pack, act_groups=act_groups)
    ignore = list(ignore) if ignore is not None else ["lm_head"]
    spec = load_spec(src)
    if spec.quantization_config is not None:
        raise ConfigError(f"{src / 'config.json'}: the checkpoint is already quantized")
    with torch.device("meta"):
        linears = {n: m for n, m in CausalLM(spec).named_modules() if isinstance(m, Linear)}
    targets = {n: m for n, m in linears.items() if not is_ignored(ignore, n)}
    if spec.tie_word_embeddings and "lm_head" in targets:
        raise ConfigError("lm_head is tied to the embeddings: keep it in --ignore")
    for name, m in targets.items():
        if quant.group_size and m.in_features % quant.group_size:
            raise ConfigError(
                f"{name}: input size {m.in_features} is not a multiple of --group-size {quant.group_size}; "
                f"use a group size that divides it ({', '.join(str(g) for g in GROUP_SIZES if m.in_features % g == 0)})"
            )
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(quant, ignore)
    calibrated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    changed: dict[str, torch.Tensor] = {}
    if calibration:
        calibrated, changed = _calibrate(
            src,
            {name: quant for name in targets},
            lambda w, q: quantize_weight(w, q, scale_method),
            calibration,
            calibration_options or CalibrationOptions(),
            calibration_tokens,
            calibration_window,
            calibration_seed,
            progress,
        )
    stored = split_prefused(SafetensorsCheckpoint(src), spec)  # Phi-3: qkv_proj written as q/k/v_proj
    with stored as ckpt, atomic_directory(out, force) as partial:
        writer = ShardWriter(partial)
        for name in tqdm(ckpt.names(), desc=f"writing {quant.name}", unit="tensor", disable=not progress):
            module = name.removesuffix(".weight")
            tensor = ckpt.get(name)
            if name in changed:
                writer.add(name, changed[name].to(tensor.dtype))
            elif name.endswith(".weight") and module in targets:
                q, scale = calibrated.get(module) or quantize_weight_in_chunks(tensor, quant, scale_method)
                if quant.packed:
                    writer.add(f"{module}.weight_packed", pack_int(q, quant.bits))
                    writer.add(f"{module}.weight_shape", torch.tensor(list(q.shape), dtype=torch.int64))
                else:
                    writer.add(name, q)
                writer.add(f"{module}.weight_scale", scale)
            else:
                writer.add(name, tensor)
        writer.finish()
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        for fname in COPIED_FILES:
            if (src / fname).is_file():
                shutil.copy(src / fname, partial / fname)
    return out


def calibration_windows(tokenizer, texts: list[Path], tokens: int, window: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Token windows [B, window] cut from the concatenated texts, at most `tokens` in all."""
    ids: list[int] = []
    for path in texts:
        if not path.is_file():
            raise ConfigError(f"--calibration {path}: no such file")
        ids += tokenizer.encode(path.read_text(errors="replace"), add_special_tokens=False)
    count = min(tokens, len(ids)) // window
    if count == 0:
        raise ConfigError(f"--calibration: {len(ids)} tokens in all; at least one window of {window} is needed")
    return torch.tensor(ids[: count * window]).view(count, window)


def _calibrate(
    src: Path,
    targets: dict[str, WeightQuant],
    quantizer: Quantizer,
    texts: list[Path] | Literal["self"],
    opts: CalibrationOptions,
    tokens: int,
    window: int,
    seed: int,
    progress: bool,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor]]:
    from cpuserve.model.loader import load_model
    from cpuserve.offline.self_calibration import self_calibration_windows
    from cpuserve.tokenizer import Tokenizer

    spec = load_spec(src)
    if texts == "self":
        windows = self_calibration_windows(src, tokens, window, seed, progress)
    else:
        windows = calibration_windows(Tokenizer(src), texts, tokens, window)
    # smoothing works per projection, on the weights as torch tensors
    model = load_model(src, "float32", progress=progress, fuse=False, pack_float=False)
    storage = getattr(torch, spec.torch_dtype, torch.bfloat16)
    return calibrate_and_quantize(model, windows, targets, quantizer, opts, storage, progress)
