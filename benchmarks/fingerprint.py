"""Greedy tokens and logprobs of models through the engine, as one fingerprint per model: run it on
two checkouts to show a change kept every bit (`python benchmarks/fingerprint.py DIR...`, run from
the checkout's root; prints JSON lines: model, dtype, the tokens, and a SHA-256 of every logprob's
exact float value)."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

from cpuserve.engine.llm_engine import EngineConfig, LLMEngine  # (both checkouts have these)
from cpuserve.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def fingerprint(model_dir: Path, dtype: str) -> dict:
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=128, max_model_len=512), dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    h = hashlib.sha256()
    tokens = []
    for i in range(len(PROMPTS)):
        out = outs[f"r{i}"]
        tokens.append(out.outputs[0].token_ids)
        for e in [*(out.prompt_logprobs or []), *(out.outputs[0].logprobs or [])]:
            if e is None:
                continue
            h.update(struct.pack("<qdq", e.token_id, e.logprob, e.rank))
            for t, lp in sorted(e.top.items()):
                h.update(struct.pack("<qd", t, lp))
    return {"model": str(model_dir), "dtype": dtype, "tokens": tokens, "logprobs_sha256": h.hexdigest()}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        path, _, dtype = arg.partition(":")
        print(json.dumps(fingerprint(Path(path), dtype or "auto")), flush=True)
