"""Embeddings from the engine: a prompt's final hidden states pooled into one vector.

How to pool is the model's to say, as sentence-transformers writes it (`1_Pooling/config.json`:
last token for decoder embedding models, mean, or the first token) and whether to normalize
(`modules.json` lists a Normalize module); a model that says nothing is mean-pooled and
normalized, as OpenAI's embeddings are unit vectors. An embedding request is an ordinary prompt
with max_tokens 0: it is prefilled in chunks under the same token budget as everything else (so a
long input never holds up decoding for more than a chunk), its KV blocks are freed when it ends,
and the runner folds each chunk's hidden states into the sequence's running pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

MODES = ("mean", "last", "cls")
_ST_KEYS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"
    normalize: bool = True
    source: str = "default (no sentence-transformers pooling config)"
    # Matryoshka models (config.json `is_matryoshka` / `matryoshka_dimensions`, as vLLM reads them)
    # may be cut to fewer dimensions; others only give their full width.
    any_dimensions: bool = False
    dimensions: tuple[int, ...] = ()

    @classmethod
    def load(cls, model_dir: Path) -> PoolingConfig:
        """The model directory's sentence-transformers pooling, if it has one (absent files: the default)."""
        config = _json(model_dir / "config.json")
        dims = tuple(int(d) for d in config.get("matryoshka_dimensions") or ())
        matryoshka = {"any_dimensions": bool(config.get("is_matryoshka")) and not dims, "dimensions": dims}
        modules_path = model_dir / "modules.json"
        if not modules_path.is_file():
            return cls(**matryoshka)
        modules = json.loads(modules_path.read_text())
        normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        pooling = next((m for m in modules if str(m.get("type", "")).endswith("Pooling")), None)
        if pooling is None:
            return cls(normalize=normalize, source=str(modules_path), **matryoshka)
        path = model_dir / pooling.get("path", "1_Pooling") / "config.json"
        st = _json(path)
        mode = next((m for key, m in _ST_KEYS.items() if st.get(key)), "mean")
        return cls(mode=mode, normalize=normalize, source=str(path), **matryoshka)


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


class PoolState:
    """One sequence's pool so far, in fp32 (a preempted sequence starts again from its first chunk)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.count = 0
        self.first: torch.Tensor | None = None
        self.last: torch.Tensor | None = None

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """Hidden states [n, H] of prompt positions start .. start + n - 1."""
        if start == 0:
            self.total, self.count, self.first = None, 0, hidden[0].float()
        rows = hidden.float()
        self.total = rows.sum(0) if self.total is None else self.total + rows.sum(0)
        self.count += rows.shape[0]
        self.last = rows[-1]

    def result(self, mode: str, normalize: bool) -> torch.Tensor:
        assert self.total is not None and self.first is not None and self.last is not None
        vec = {"mean": lambda: self.total / self.count, "last": lambda: self.last, "cls": lambda: self.first}[mode]()
        return torch.nn.functional.normalize(vec, dim=0) if normalize else vec
