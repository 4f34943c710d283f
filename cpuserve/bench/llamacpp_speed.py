"""llama.cpp's single-stream speed through llama-cpp-python (run by the peer's Python; imports nothing
from cpuserve). Same measurements as speed_worker.py. Prints JSON.

    python llamacpp_speed.py MODEL.gguf PROMPT_TOKENS DECODE_TOKENS THREADS [LONG_TOKENS]

LONG_TOKENS (0: skip): after peak RSS is read, a second context of that many tokens plus DECODE_TOKENS
with flash attention on (llama.cpp's fastest long-context path): pp<LONG> and tg<LONG>.
"""

import json
import sys
import time
from pathlib import Path

from llama_cpp import Llama


def main() -> None:
    path, prompt_tokens, decode_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    long_tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    start = time.perf_counter()
    llm = _open(path, prompt_tokens, decode_tokens, threads, flash_attn=False)
    result = {"load_s": time.perf_counter() - start}
    ids = list(range(100, 100 + prompt_tokens))
    for n in (128, prompt_tokens):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids[:n])
        result[f"pp{n}"] = n / (time.perf_counter() - t)
    result["tg"] = _decode_rate(llm, decode_tokens)
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss starts from the parent's peak.
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(line for line in status if line.startswith("VmHWM:"))
    result["peak_rss_mb"] = int(hwm.split()[1]) / 1024
    if long_tokens:
        del llm
        llm = _open(path, long_tokens, decode_tokens, threads, flash_attn=True)
        t = time.perf_counter()
        llm.eval(list(range(100, 100 + long_tokens)))
        result[f"pp{long_tokens}"] = long_tokens / (time.perf_counter() - t)
        result[f"tg{long_tokens}"] = _decode_rate(llm, decode_tokens)
    print(json.dumps(result))


def _open(path: str, prompt_tokens: int, decode_tokens: int, threads: int, flash_attn: bool) -> Llama:
    """A context for one prompt of `prompt_tokens` in one batch and `decode_tokens` behind it."""
    return Llama(
        model_path=path,
        n_ctx=prompt_tokens + decode_tokens + 8,
        n_batch=prompt_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=flash_attn,
        verbose=False,
    )


def _decode_rate(llm: Llama, tokens: int) -> float:
    """Single-token steps behind what the context holds: tokens per second."""
    t = time.perf_counter()
    for _ in range(tokens):
        llm.eval([7])
    return tokens / (time.perf_counter() - t)


if __name__ == "__main__":
    main()
