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
) -> str:
    tokenizer = Tokenizer(next(iter(models.values())))
    windows = token_windows(tokenizer, text_path.read_text(), ctx)
    rows = []
    for label, path in models.items():
        nll, n = cpuserve_nll(path, windows, dtype)
        rows.append((f"cpuserve {label}", math.exp(nll / n), n))
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
