"""Where cpuserve keeps what it derives from models (GGUF serving directories, conversions) and
the vLLM plugin's last record: one rule, importable without the model stack."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(override: str | None = None) -> Path:
    """--cache-dir, else $CPUSERVE_CACHE_DIR, else $XDG_CACHE_HOME/cpuserve, else ~/.cache/cpuserve."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("CPUSERVE_CACHE_DIR"):
        return Path(os.environ["CPUSERVE_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "cpuserve"
