"""`cpuserve doctor`: what was detected, what will be chosen and why, and whether a model fits."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cpuserve import defaults
from cpuserve.errors import CpuserveError
from cpuserve.model.footprint import model_facts, plan_model_memory
from cpuserve.platform.machine import Machine
from cpuserve.platform.overrides import read_overrides
from cpuserve.platform.plan import GiB, plan_kernel, plan_threads
from cpuserve.platform.sysfs import format_cpulist
from cpuserve.vllm_plugin.status import plugin_report, render_plugin


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def build_report(
    machine: Machine,
    env: Mapping[str, str],
    model_dir: Path | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = defaults.MAX_NUM_SEQS,
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Everything doctor says, as data; `problems` lists what will not work (one line each)."""
    cpu, res = machine.cpu, machine.resources
    problems: list[str] = []
    report: dict[str, Any] = {
        "machine": {
            "arch": cpu.arch,
            "model": cpu.model_name,
            "features": sorted(cpu.features),
            "online_cpus": format_cpulist(cpu.ids),
            "allowed_cpus": format_cpulist(res.allowed_cpus),
            "physical_cores": len(cpu.physical_cores(cpu.ids)),
            "smt": cpu.smt,
            "numa_nodes": len(cpu.nodes),
            "little_cores": format_cpulist(cpu.little) if cpu.little else "",
            "little_by": cpu.little_reason,
            "cgroup": res.cgroup_version,
            "cpu_quota": res.cpu_quota,
            "memory_total_bytes": res.mem_total,
            "memory_available_bytes": res.mem_available,
            "memory_limit_bytes": res.mem_limit,
        },
        "decisions": {},
        "environment": {},
        "problems": problems,
    }
    try:
        ov = read_overrides(env)
    except CpuserveError as exc:
        problems.append(str(exc))
        return report
    report["environment"] = {"used": dict(ov.sources), "not_needed": dict(ov.not_needed)}
    report["vllm_plugin"] = plugin_report(env)
    for name, step in (("threads", lambda: plan_threads(cpu, res, ov)), ("kernel", lambda: plan_kernel(cpu, ov))):
        try:
            report["decisions"][name] = step().__dict__
        except CpuserveError as exc:
            problems.append(str(exc))
    if report["decisions"].get("kernel", {}).get("variant") == "avx512_vnni":
        from cpuserve.kernels import amx_note

        report["decisions"]["kernel"] = {**report["decisions"]["kernel"], "amx": amx_note()}
    if model_dir is None:
        return report
    try:
        spec, _, facts = model_facts(model_dir, dtype, kv_cache_dtype)
    except CpuserveError as exc:
        problems.append(str(exc))
        return report
    report["model"] = facts
    model_len = spec.max_position_embeddings
    if max_model_len is not None:
        model_len = max_model_len
        if max_model_len > spec.max_position_embeddings:
            problems.append(
                f"--max-model-len {max_model_len} is longer than the model's {spec.max_position_embeddings} positions"
            )
    try:
        mem = plan_model_memory(machine, ov, spec, facts, model_len, max_num_seqs, max_num_batched_tokens)
    except CpuserveError as exc:
        problems.append(str(exc))
        return report
    report["decisions"]["memory"] = mem.__dict__
    if max_model_len is not None and mem.kv_tokens < max_model_len:
        problems.append(
            f"--max-model-len {max_model_len} needs {max_model_len} tokens of KV cache; {mem.kv_tokens} fit "
            f"({_gib(mem.kv_bytes)}); lower --max-model-len or free memory"
        )
    return report


def render_text(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = ["machine"]
    lines.append(f"  cpu          {m['model']} ({m['arch']})")
    lines.append(f"  features     {' '.join(m['features']) or 'none of interest'}")
    topo = [f"{m['physical_cores']} physical cores", f"online {m['online_cpus']}", f"allowed {m['allowed_cpus']}"]
    topo.append("SMT" if m["smt"] else "no SMT")
    topo.append(f"{m['numa_nodes']} NUMA node{'s' * (m['numa_nodes'] > 1)}")
    topo.append(f"little cores {m['little_cores']} (by {m['little_by']})" if m["little_cores"] else "no little cores")
    lines.append(f"  cores        {', '.join(topo)}")
    limit = _gib(m["memory_limit_bytes"]) if m["memory_limit_bytes"] else "none"
    quota = f"{m['cpu_quota']:g} CPUs" if m["cpu_quota"] else "none"
    lines.append(f"  cgroup       v{m['cgroup'] or '-'}: CPU quota {quota}, memory limit {limit}")
    lines.append(f"  memory       {_gib(m['memory_total_bytes'])} total, {_gib(m['memory_available_bytes'])} available")
    d = report["decisions"]
    lines.append("decisions")
    if "threads" in d:
        t = d["threads"]
        where = f"pinned to {format_cpulist(t['cpus'])}" if t["pinned"] else "not pinned"
        lines.append(f"  threads      {t['count']}, {where} ({t['reason']})")
    if "kernel" in d:
        k = d["kernel"]
        lines.append(f"  kernels      {k['variant']} ({k['reason']}; supported: {', '.join(k['supported'])})")
        if "amx" in k:
            lines.append(f"  amx          {k['amx']}")
    if "model" in report:
        f = report["model"]
        lines.append(f"model          {f['path']}")
        lines.append(
            f"  format       {f['format']}, {f['architecture']}, {f['layers']} layers, hidden {f['hidden_size']}"
        )
        lines.append(f"  scheme       {f['scheme']}")
        lines.append(f"  activations  {f['compute_dtype']} ({f['compute_dtype_reason']})")
        for layer, kernel in f["kernels"].items():
            lines.append(f"  kernel       {layer}: {kernel}")
        lines.append(f"  weights      {f['parameters'] / 1e6:.1f} M parameters, {_gib(f['weights_bytes'])}")
    if "memory" in d:
        mem = d["memory"]
        lines.append(
            f"  memory       {_gib(mem['available'])} available = {_gib(mem['weights'])} weights + "
            f"{_gib(mem['workspace'])} workspace + {_gib(mem['kv_bytes'])} KV cache + rest "
            f"(margin {_gib(mem['margin'])})"
        )
        lines.append(
            f"  KV cache     {mem['kv_tokens']} tokens at {mem['kv_bytes_per_token'] / 1024:.1f} KiB/token, "
            f"{report['model']['kv_cache_dtype']} ({mem['reason']}); longest context {mem['longest_context']}"
        )
    if "vllm_plugin" in report:
        lines.append("vllm plugin")
        lines.extend(render_plugin(report["vllm_plugin"]))
    env = report.get("environment") or {}
    if env.get("used") or env.get("not_needed"):
        lines.append("environment")
        for setting in env.get("used", {}).values():
            lines.append(f"  {setting}: honoured")
        for setting, why in env.get("not_needed", {}).items():
            lines.append(f"  {setting}: not needed ({why})")
    if report["problems"]:
        lines.append("problems")
        lines.extend(f"  {p}" for p in report["problems"])
    else:
        lines.append("verdict        ready")
    return "\n".join(lines)


def render_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2, default=list)
