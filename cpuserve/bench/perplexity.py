"""`cpuserve bench perplexity`: perplexity of cpuserve models (any scheme) and, side by side in the
same run on the same token windows, of llama.cpp GGUFs, on a fixed text every machine here has."""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch

from cpuserve.model.loader import load_model
from cpuserve.tokenizer import Tokenizer

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")
# Run by the peer's Python (it imports llama_cpp, which cpuserve does not depend on).
LLAMACPP_SCRIPT = Path(__file__).with_name("llamacpp_perplexity.py")


def token_windows(tokenizer: Tokenizer, text: str, ctx: int) -> list[list[int]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[i : i + ctx] for i in range(0, len(ids) - 1, ctx) if len(ids[i : i + ctx]) > 1]


@torch.inference_mode()
def cpuserve_nll(model_dir: Path, windows: list[list[int]], dtype: str) -> tuple[float, int]:
    model = load_model(model_dir, dtype)
    nll, count = 0.0, 0
    for window in windows:
        logprobs = torch.log_softmax(model(torch.tensor([window]))[0], dim=-1)
        targets = torch.tensor(window[1:])
        nll -= logprobs[:-1].gather(1, targets.unsqueeze(1)).sum().item()
        count += len(window) - 1
    return nll, count


@torch.inference_mode()
def engine_nll(model_dir: Path, windows: list[list[int]], dtype: str, kv_cache_dtype: str) -> tuple[float, int]:
    """The same sum through the serving engine: each window a prompt whose tokens' logprobs come from
    attention over the paged KV cache (quantized when kv_cache_dtype asks), as a served request sees it."""
    from cpuserve.engine.llm import run_to_completion
    from cpuserve.engine.llm_engine import EngineConfig, LLMEngine
    from cpuserve.engine.sampling_params import SamplingParams
    from cpuserve.model.footprint import auto_kv_storage
    from cpuserve.tokenizer import GenerationDefaults

    model = load_model(model_dir, dtype)
    if kv_cache_dtype == "auto":  # what serve's auto stores (the checkpoint's dtype under a float32 auto)
        kv_cache_dtype = auto_kv_storage(model.spec, dtype, model.dtype) or "auto"
    seqs, block = 4, 16
    longest = max(len(w) for w in windows)
    config = EngineConfig(
        max_num_seqs=seqs,
        num_kv_blocks=seqs * (-(-(longest + 1) // block) + 1),
        block_size=block,
        max_model_len=longest + 1,
        enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = LLMEngine(model, Tokenizer(model_dir), config, GenerationDefaults.load(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, ignore_eos=True)
    done = run_to_completion(engine, {f"w{i}": w for i, w in enumerate(windows)}, params)
    nll = -sum(entry.logprob for out in done for entry in out.prompt_logprobs[1:])
    return nll, sum(len(w) - 1 for w in windows)


def llamacpp_nll(python: str, gguf_path: Path, windows: list[list[int]], threads: int) -> tuple[float, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(windows, f)
    out = subprocess.run(
        [python, str(LLAMACPP_SCRIPT), str(gguf_path), f.name, str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["nll"], result["tokens"]


def run_perplexity(
    models: dict[str, Path],
    ggufs: dict[str, Path],
    text_path: Path,
    ctx: int,
    dtype: str,
    llamacpp_python: str | None,
    threads: int,
    kv_cache_dtypes: list[str] | None = None,
) -> str:
    """One table, the first row the baseline. kv_cache_dtypes: evaluate every model through the
    engine once per KV cache dtype (else directly, with no cache)."""
    tokenizer = Tokenizer(next(iter(models.values())))
    windows = token_windows(tokenizer, text_path.read_text(), ctx)
    rows = []
    for label, path in models.items():
        for kv in kv_cache_dtypes or [None]:
            nll, n = cpuserve_nll(path, windows, dtype) if kv is None else engine_nll(path, windows, dtype, kv)
            rows.append((f"cpuserve {label}" + (f", KV cache {kv}" if kv else ""), math.exp(nll / n), n))
    for label, path in ggufs.items():
        if llamacpp_python is None:
            break
        nll, n = llamacpp_nll(llamacpp_python, path, windows, threads)
        rows.append((f"llama.cpp {label}", math.exp(nll / n), n))
    base = rows[0][1]
    lines = [
        f"text {text_path}, {sum(len(w) for w in windows)} tokens in windows of {ctx}, cpuserve in {dtype}",
        "",
        "| model | perplexity | vs first row |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |" for label, ppl, _ in rows]
    return "\n".join(lines)
