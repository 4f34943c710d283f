"""`cpuserve bench vllm`: one checkpoint served three ways in one run, one after another on the same
cores: vLLM with its own CPU kernels, vLLM with the cpuserve plugin, and `cpuserve serve`.

Each server is started, asked the same requests through the OpenAI completions API, and stopped:
- start-up: seconds from launch to the first answered request;
- prefill: a fresh random-token prompt of --prompt tokens with max_tokens=1 (median of --repeats;
  a new prompt each time so no prefix cache helps), reported as prompt tokens per second;
- decode: a 32-token prompt and --decode new tokens with ignore_eos, less the time of the same
  request with 1 new token: (completion_tokens - 1) / (T_N - T_1);
- peak RSS of the server's whole process tree (vLLM runs an API server, an engine core and a
  worker), sampled every 0.2 s.
vLLM runs from its own environment (--vllm-python, e.g. .venv-vllm/bin/python from ./run vllm-env).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cpuserve.bench.server_process import free_port


@dataclass
class Result:
    name: str
    startup_s: float = float("nan")
    prefill_tok_s: float = float("nan")
    decode_tok_s: float = float("nan")
    peak_rss_mib: float = 0.0
    note: str = ""
    kernels: list[str] = field(default_factory=list)


def _tree_rss_mib(root: int) -> float:
    """RSS of a process and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parts = f.read().rsplit(")", 1)[1].split()
            children.setdefault(int(parts[1]), []).append(int(entry))
            rss[int(entry)] = int(parts[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total / 2**20


def _post(base: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


def measure(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    port: int,
    model: str,
    vocab: int,
    prompt_tokens: int,
    decode_tokens: int,
    repeats: int,
    log_path: Path,
    timeout: float,
) -> Result:
    result = Result(name)
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _tree_rss_mib(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    rng = random.Random(0)
    try:
        while True:
            if proc.poll() is not None:
                result.note = f"exited with {proc.returncode} (see {log_path})"
                return result
            try:
                _post(base, {"model": model, "prompt": [1000, 1001], "max_tokens": 1}, timeout=5)
                break
            except OSError:
                if time.monotonic() - started > timeout:
                    result.note = f"not answering after {timeout:.0f} s"
                    return result
                time.sleep(0.5)
        result.startup_s = time.monotonic() - started
        times = []
        for _ in range(repeats):
            t0 = time.monotonic()
            body = {"model": model, "prompt": _prompt(rng, prompt_tokens, vocab), "max_tokens": 1}
            _post(base, body, timeout)
            times.append(time.monotonic() - t0)
        result.prefill_tok_s = prompt_tokens / statistics.median(times)

        # decode: a request of N new tokens minus one of 1 (same prompt length, fresh prompts), so
        # text a server holds back while it is not whole UTF-8 (random weights) cannot skew it
        def timed(max_tokens: int) -> tuple[float, int]:
            body = {"model": model, "prompt": _prompt(rng, 32, vocab), "max_tokens": max_tokens}
            t0 = time.monotonic()
            out = _post(base, {**body, "ignore_eos": True, "temperature": 0}, timeout)
            return time.monotonic() - t0, out["usage"]["completion_tokens"]

        one = statistics.median(timed(1)[0] for _ in range(repeats))
        seconds, tokens = timed(decode_tokens)
        result.decode_tok_s = (tokens - 1) / (seconds - one) if seconds > one and tokens > 1 else float("nan")
    except OSError as exc:
        result.note = f"request failed: {exc}"
    finally:
        stop.set()
        sampler.join()
        result.peak_rss_mib = peak[0]
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        text = log_path.read_text(errors="replace")
        result.kernels = sorted(
            {word for line in text.splitlines() for word in line.split() if word.endswith("LinearKernel")}
        )
        taken = [line for line in text.splitlines() if "cpuserve plugin took" in line]
        if taken:
            result.note = (result.note + " " + taken[-1].split("] ", 1)[-1]).strip()
    return result


def run_vllm_bench(
    model: Path,
    vllm_python: Path,
    prompt_tokens: int,
    decode_tokens: int,
    repeats: int,
    eager: bool,
    timeout: float,
    work: Path,
) -> list[Result]:
    config = json.loads((model / "config.json").read_text())
    vocab = int(config["vocab_size"])
    cpus = sorted(os.sched_getaffinity(0))
    vllm_env = {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}",  # every core, as cpuserve uses them
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "HF_HUB_OFFLINE": "1",
    }
    results = []
    for name, plugins in (("vLLM (own kernels)", ""), ("vLLM + cpuserve plugin", None)):
        port = free_port()
        cmd = [
            str(vllm_python),
            "-m",
            "cpuserve.vllm_plugin.cli",
            "serve",
            str(model),
            "--port",
            str(port),
            "--max-model-len",
            "2048",
        ]
        cmd += ["--enforce-eager"] if eager else []
        env = dict(vllm_env)
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins  # "": an allow-list matching no plugin
        else:
            env.pop("VLLM_PLUGINS", None)
        log = work / f"{'plugin' if plugins is None else 'native'}.log"
        print(f"[bench vllm] {name} ...", file=sys.stderr, flush=True)
        results.append(
            measure(name, cmd, env, port, str(model), vocab, prompt_tokens, decode_tokens, repeats, log, timeout)
        )
    port = free_port()
    cmd = [sys.executable, "-m", "cpuserve", "serve", str(model), "--port", str(port), "--max-model-len", "2048"]
    print("[bench vllm] cpuserve serve ...", file=sys.stderr, flush=True)
    results.append(
        measure(
            "cpuserve serve",
            cmd,
            dict(os.environ),
            port,
            str(model),
            vocab,
            prompt_tokens,
            decode_tokens,
            repeats,
            work / "cpuserve.log",
            timeout,
        )
    )
    return results


def render(results: list[Result], command: str) -> str:
    lines = [
        f"`{command}`",
        "",
        "| server | start-up s | prefill tok/s | decode tok/s | peak RSS MiB | linear kernels | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.startup_s:.1f} | {r.prefill_tok_s:.1f} | {r.decode_tok_s:.2f} | {r.peak_rss_mib:.0f} "
            f"| {', '.join(r.kernels) or '-'} | {r.note} |"
        )
    return "\n".join(lines)
