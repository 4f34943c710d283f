"""Decisions from what was detected: worker threads, kernel variant, KV cache size; each with a reason.

Everything here is pure (detected facts + overrides in, a plan out), so recorded machines can be
planned in tests exactly as a live one is.
"""

from __future__ import annotations

from dataclasses import dataclass

from cpuserve.errors import ConfigError
from cpuserve.platform.cpu import CpuInfo
from cpuserve.platform.overrides import Overrides
from cpuserve.platform.resources import Resources
from cpuserve.platform.sysfs import format_cpulist

GiB = 1024**3
MiB = 1024**2

# The kernels' variants (the same names as their variant table, kernels/csrc/variants.cpp) with the
# /proc/cpuinfo flags each needs, best first: the first whose features the CPU has is chosen. The
# kernel's own detector (csrc/arch/*/cpu_features_*.cpp) needs the same; a test checks they agree.
# No SVE2 variant: on the cores we target (Cortex-A720/A520, Neoverse-N2/V2) SVE's vector length is
# 128 bits, NEON's, and SVE2's int8 dot products are the same instructions at the same width, so
# those CPUs run neon_i8mm (docs/kernels.md).
KERNEL_VARIANTS: dict[str, list[tuple[str, frozenset[str]]]] = {
    "x86_64": [
        ("avx512_vnni", frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"})),
        ("avx_vnni", frozenset({"avx2", "fma", "avx_vnni"})),
        ("avx2", frozenset({"avx2", "fma"})),
        ("generic", frozenset()),
    ],
    "aarch64": [
        ("neon_i8mm", frozenset({"asimddp", "i8mm"})),
        ("neon_dotprod", frozenset({"asimddp"})),
        ("neon", frozenset({"asimd"})),
        ("generic", frozenset()),
    ],
}
REFERENCE = "reference"  # CPUSERVE_ISA=reference: the pure-torch linears and float ops


@dataclass(frozen=True)
class ThreadPlan:
    count: int
    cpus: tuple[int, ...]  # one per thread, in order; empty when not pinned
    pinned: bool
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    variant: str
    supported: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class MemoryPlan:
    available: int
    weights: int
    workspace: int
    margin: int
    kv_bytes: int
    kv_bytes_per_token: int
    kv_tokens: int
    longest_context: int
    reason: str


def plan_threads(cpu: CpuInfo, res: Resources, ov: Overrides) -> ThreadPlan:
    allowed = list(res.allowed_cpus)
    if ov.bind == "list":
        missing = [c for c in ov.bind_cpus if c not in allowed]
        if missing:
            raise ConfigError(
                f"{ov.sources['bind']}: CPUs {format_cpulist(missing)} are not available to this process "
                f"(it may use {format_cpulist(allowed)}); bind a subset of those, or 'auto'"
            )
        cpus = list(ov.bind_cpus)
        if ov.num_threads is not None:
            if ov.num_threads > len(cpus):
                raise ConfigError(
                    f"{ov.sources['threads']} asks for more threads than {ov.sources['bind']} binds "
                    f"({len(cpus)} CPUs); make them agree"
                )
            cpus = cpus[: ov.num_threads]
        return ThreadPlan(len(cpus), tuple(cpus), True, f"{ov.sources['bind']}")

    big = [c for c in allowed if c not in cpu.little] or allowed
    cores = cpu.physical_cores(big)
    why = ["one per physical core"]
    if cpu.little and len(big) < len(allowed):
        why.append(f"big cores only ({format_cpulist(cpu.little)} are efficiency cores, by {cpu.little_reason})")
    if cpu.smt:
        why.append("one SMT sibling each")
    nodes = sorted({c.node for c in cpu.cpus if c.id in cores})
    if len(nodes) > 1:
        counts = {n: sum(1 for c in cpu.cpus if c.id in cores and c.node == n) for n in nodes}
        node = max(nodes, key=lambda n: (counts[n], -n))
        cores = [c.id for c in cpu.cpus if c.id in cores and c.node == node]
        why.append(f"NUMA node {node} only (of {len(nodes)}), so weights and threads share local memory")
    if res.cpu_quota_threads is not None and res.cpu_quota_threads < len(cores):
        cores = cores[: res.cpu_quota_threads]
        why.append(f"cgroup CPU quota of {res.cpu_quota:g} CPUs")
    if ov.num_threads is not None:
        why.append(ov.sources["threads"])
        if ov.num_threads > len(allowed):
            raise ConfigError(
                f"{ov.sources['threads']} asks for {ov.num_threads} threads but this process may use "
                f"{len(allowed)} CPUs ({format_cpulist(allowed)}); ask for at most {len(allowed)}"
            )
        extra = [c for c in big + allowed if c not in cores]
        cores = (cores + list(dict.fromkeys(extra)))[: ov.num_threads]
    if ov.bind == "nobind":
        return ThreadPlan(len(cores), (), False, f"{ov.sources['bind']}: {len(cores)} threads, not pinned")
    return ThreadPlan(len(cores), tuple(cores), True, "; ".join(why))


def plan_kernel(cpu: CpuInfo, ov: Overrides) -> KernelPlan:
    variants = KERNEL_VARIANTS.get(cpu.arch, [("generic", frozenset())])
    supported = tuple(name for name, needs in variants if needs <= cpu.features)
    if ov.kernel_variant is not None:
        if ov.kernel_variant not in (*supported, REFERENCE):
            raise ConfigError(
                f"{ov.sources['kernel']}: this CPU supports {', '.join(supported)}; choose one of those or {REFERENCE}"
            )
        return KernelPlan(ov.kernel_variant, supported, ov.sources["kernel"])
    best = supported[0]
    needs = dict(variants)[best]
    reason = f"best this CPU supports ({', '.join(sorted(needs))})" if needs else "no SIMD features detected"
    return KernelPlan(best, supported, reason)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def plan_memory(
    res: Resources,
    ov: Overrides,
    *,
    weights: int,
    kv_bytes_per_token: int,
    model_max_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    activation_bytes_per_token: int,
) -> MemoryPlan:
    """KV cache = available - weights - workspace - margin, capped at what max_num_seqs full-length
    sequences could use; never a fixed fraction of total memory."""
    margin = max(512 * MiB, res.mem_total // 20)
    workspace = 256 * MiB + max_num_batched_tokens * activation_bytes_per_token
    usable = res.mem_available - weights - workspace
    if usable < margin:
        raise ConfigError(
            f"the model needs {_gib(weights)} for weights and {_gib(workspace)} of workspace, but "
            f"{_gib(res.mem_available)} of memory is available; use a smaller or quantized model"
        )
    if ov.kvcache_bytes is not None:
        if ov.kvcache_bytes > usable:
            raise ConfigError(
                f"{ov.sources['kvcache']} asks for a {_gib(ov.kvcache_bytes)} KV cache, but only "
                f"{_gib(usable)} is available after weights and workspace; ask for at most "
                f"{int(usable / GiB * 10) / 10:g} GiB, or unset it to size the cache automatically"
            )
        kv = ov.kvcache_bytes
        reason = ov.sources["kvcache"]
    else:
        free = usable - margin
        wanted = max_num_seqs * model_max_len * kv_bytes_per_token
        kv = max(0, min(free, wanted))
        if kv == wanted:
            reason = f"enough for {max_num_seqs} sequences of {model_max_len} tokens"
        else:
            reason = f"available memory minus weights, workspace and a {_gib(margin)} margin"
    tokens = kv // kv_bytes_per_token
    if tokens < 1:
        raise ConfigError(
            f"no memory is left for the KV cache ({_gib(res.mem_available)} available, {_gib(weights)} of "
            f"weights); use a smaller model or free memory"
        )
    return MemoryPlan(
        available=res.mem_available,
        weights=weights,
        workspace=workspace,
        margin=margin,
        kv_bytes=kv,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_tokens=tokens,
        longest_context=min(tokens, model_max_len),
        reason=reason,
    )
