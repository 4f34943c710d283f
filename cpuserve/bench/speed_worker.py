"""One engine's single-stream speed, in its own process (so peak RSS is its own). Prints JSON.

python -m cpuserve.bench.speed_worker MODEL_DIR_OR_GGUF PROMPT_TOKENS DECODE_TOKENS [LONG_TOKENS]

LONG_TOKENS (0: skip): after the rest and after peak RSS is read, a prompt of that many tokens
(pp<LONG>) and DECODE_TOKENS decoded behind it (tg<LONG>), in a cache of its own.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    model_dir, prompt_tokens, decode_tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    long_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    start = time.perf_counter()
    import os

    import torch

    from cpuserve.model.loader import lm_head_setting, load_model
    from cpuserve.platform.overrides import read_overrides

    # CPUSERVE_QUANTIZE_LM_HEAD (the suite sets it) is read with the other overrides, as serve does.
    head = lm_head_setting(None, read_overrides(os.environ).quantize_lm_head)
    if model_dir.suffix == ".gguf":  # served as it is, as `cpuserve serve file.gguf` does
        from cpuserve.model.resolve import resolve_model

        model_dir = resolve_model(str(model_dir))
    model = load_model(model_dir, "auto", quantize_lm_head=head)
    load_s = time.perf_counter() - start
    import gc

    # As `serve` does after loading: the model's objects out of the collector's sight, so a
    # collection during decode walks only what the steps allocate (unfrozen: 2% of a 2B decode's
    # samples, avx512_vnni on a Zen 5 host).
    gc.collect()
    gc.freeze()
    from cpuserve.quant.linear import Linear

    reference = [m for m in model.modules() if isinstance(m, Linear) and m.quant is not None and m.kernel is None]
    if reference:  # e.g. kernels edited (new build key) and not rebuilt: a number of the wrong engine
        sys.exit(f"speed_worker: {len(reference)} quantized linears are not on the native kernels; ./run setup")
    from cpuserve.model.footprint import auto_kv_storage

    storage = auto_kv_storage(model.spec, "auto", model.dtype)  # the cache `serve` would hold here
    cache_dtype = getattr(torch, storage) if storage else None
    ids = torch.arange(100, 100 + prompt_tokens).unsqueeze(0)
    result = {"load_s": load_s}
    for n in (128, prompt_tokens):
        cache = model.new_cache(1, n + decode_tokens + 1, cache_dtype)
        t = time.perf_counter()
        hidden = model.hidden_states(ids[:, :n], cache)
        model.logits(hidden[:, -1])
        result[f"pp{n}"] = n / (time.perf_counter() - t)
    result["tg"] = _decode_rate(model, cache, decode_tokens)
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss starts from the parent's peak.
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(line for line in status if line.startswith("VmHWM:"))
    result["peak_rss_mb"] = int(hwm.split()[1]) / 1024
    if long_tokens:
        cache = model.new_cache(1, long_tokens + decode_tokens + 1, cache_dtype)
        long_ids = torch.arange(100, 100 + long_tokens).unsqueeze(0) % model.spec.vocab_size
        t = time.perf_counter()
        model.logits(model.hidden_states(long_ids, cache)[:, -1])
        result[f"pp{long_tokens}"] = long_tokens / (time.perf_counter() - t)
        result[f"tg{long_tokens}"] = _decode_rate(model, cache, decode_tokens)
    print(json.dumps(result))


def _decode_rate(model: Any, cache: Any, tokens: int) -> float:
    """Greedy single-token steps behind what `cache` holds: tokens per second."""
    import torch

    token = torch.tensor([[7]])
    t = time.perf_counter()
    for _ in range(tokens):
        token = model.logits(model.hidden_states(token, cache)[:, -1]).argmax(-1, keepdim=True)
    return tokens / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
