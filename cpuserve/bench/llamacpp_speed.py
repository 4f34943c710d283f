"""llama.cpp's single-stream speed through llama-cpp-python (run by the peer's Python; imports nothing
from cpuserve). Same measurements as speed_worker.py. Prints JSON.

    python llamacpp_speed.py MODEL.gguf PROMPT_TOKENS DECODE_TOKENS THREADS
"""

import json
import sys
import time
from pathlib import Path

from llama_cpp import Llama


def main() -> None:
    path, prompt_tokens, decode_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    start = time.perf_counter()
    llm = Llama(
        model_path=path,
        n_ctx=prompt_tokens + decode_tokens + 8,
        n_batch=prompt_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    result = {"load_s": time.perf_counter() - start}
    ids = list(range(100, 100 + prompt_tokens))
    for n in (128, prompt_tokens):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids[:n])
        result[f"pp{n}"] = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(decode_tokens):
        llm.eval([7])
    result["tg"] = decode_tokens / (time.perf_counter() - t)
    # VmHWM, not ru_maxrss: after fork + exec, ru_maxrss starts from the parent's peak.
    status = Path("/proc/self/status").read_text().splitlines()
    hwm = next(line for line in status if line.startswith("VmHWM:"))
    result["peak_rss_mb"] = int(hwm.split()[1]) / 1024
    print(json.dumps(result))


if __name__ == "__main__":
    main()
