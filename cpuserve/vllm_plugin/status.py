"""What the vLLM plugin did in the last vLLM process that loaded a model, for `cpuserve doctor`.

The plugin runs inside vLLM's processes; doctor runs in another. The record is a small JSON file
in cpuserve's cache directory, rewritten by each vLLM start (the last one wins)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cpuserve.cache_dir import cache_dir

STATUS_FILE = "vllm-plugin.json"


def status_path() -> Path:
    return cache_dir() / STATUS_FILE


def _write(record: dict[str, Any]) -> None:
    path = status_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**record, "pid": os.getpid(), "time": time.time()}, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache never stops vLLM; doctor then has nothing to report


def record_inactive(vllm_version: str | None, reason: str) -> None:
    _write({"active": False, "vllm": vllm_version, "reason": reason})


def record_active(
    vllm_version: str | None, variant: str, taken: dict[str, int], declined: dict[str, int], layers: list[str]
) -> None:
    _write(
        {
            "active": True,
            "vllm": vllm_version,
            "variant": variant,
            "taken": taken,
            "declined": declined,
            "layers": layers,
        }
    )


def read_status() -> dict[str, Any] | None:
    try:
        return json.loads(status_path().read_text())
    except (OSError, ValueError):
        return None


def plugin_report(env: Mapping[str, str]) -> dict[str, Any]:
    """For doctor: is the plugin installed where this Python looks, would vLLM load it, and what
    did the last vLLM start with it do (from the record)."""
    import importlib.metadata as md

    from cpuserve.vllm_plugin import PLUGIN_NAME, vllm_version

    entry = any(ep.name == PLUGIN_NAME for ep in md.entry_points(group="vllm.general_plugins"))
    allowed = env.get("VLLM_PLUGINS")
    loads = allowed is None or PLUGIN_NAME in allowed.split(",")  # as vLLM reads it: no spaces stripped
    why = "VLLM_PLUGINS unset: every installed plugin loads" if allowed is None else f"VLLM_PLUGINS={allowed}"
    return {
        "entry_point": entry,
        "vllm": vllm_version(),
        "loads": loads,
        "loads_reason": why,
        "last_run": read_status(),
    }


def render_plugin(r: dict[str, Any]) -> list[str]:
    where = (
        "entry point registered" if r["entry_point"] else "entry point missing (cpuserve not installed as a package?)"
    )
    vllm = f"vLLM {r['vllm']} here" if r["vllm"] else "no vLLM in this environment"
    lines = [f"  plugin       {where}; {vllm}; {'loads' if r['loads'] else 'excluded'} ({r['loads_reason']})"]
    last = r["last_run"]
    if last is None:
        lines.append("  last run     no vLLM start with the plugin recorded")
    elif last.get("active"):
        taken = last.get("taken", {})
        schemes = ", ".join(f"{n} {s}" for s, n in sorted(taken.items())) or "none"
        declined = ", ".join(f"{n} ({why})" for why, n in sorted(last.get("declined", {}).items())) or "none"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last.get("time", 0)))
        lines.append(
            f"  last run     vLLM {last.get('vllm')} (pid {last.get('pid')}, {when}): active on {last.get('variant')}, "
            f"took {sum(taken.values())} linears ({schemes}); declined: {declined}"
        )
    else:
        lines.append(f"  last run     vLLM {last.get('vllm')} (pid {last.get('pid')}): inactive: {last.get('reason')}")
    return lines
