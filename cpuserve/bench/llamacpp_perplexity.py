"""Perplexity of a GGUF under llama.cpp (llama-cpp-python), on token windows given as JSON.

Runs in whatever Python has llama_cpp installed (a peer, not a cpuserve dependency), so it imports
nothing from cpuserve:  python llamacpp_perplexity.py MODEL.gguf WINDOWS.json THREADS
Prints one JSON line: {"nll": total negative log-likelihood, "tokens": predicted tokens}.
"""

import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama


def main() -> None:
    model_path, windows_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    windows = json.loads(Path(windows_path).read_text())
    ctx = max(len(w) for w in windows)
    llm = Llama(model_path=model_path, n_ctx=ctx, n_batch=ctx, n_threads=threads, logits_all=True, verbose=False)
    nll, count = 0.0, 0
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        targets = np.asarray(window[1:])
        nll -= float(logprobs[np.arange(len(window) - 1), targets].sum())
        count += len(window) - 1
    print(json.dumps({"nll": nll, "tokens": count}))


if __name__ == "__main__":
    main()
