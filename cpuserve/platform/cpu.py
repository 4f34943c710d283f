"""CPU detection: architecture, ISA features, and core topology (SMT, big.LITTLE, NUMA)."""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass, field

from cpuserve.platform.sysfs import SystemFiles

# Features the kernels care about, as /proc/cpuinfo spells them.
X86_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
)
ARM_FEATURES = ("asimd", "asimdhp", "asimddp", "i8mm", "sve", "sve2", "bf16", "svei8mm", "sme")
# The same features as the kernel's aarch64 HWCAP bits (uapi asm/hwcap.h): (AT_HWCAP or AT_HWCAP2, bit).
AT_HWCAP, AT_HWCAP2 = 16, 26
ARM_HWCAPS = {
    "asimd": (AT_HWCAP, 1),
    "asimdhp": (AT_HWCAP, 10),
    "asimddp": (AT_HWCAP, 20),
    "sve": (AT_HWCAP, 22),
    "sve2": (AT_HWCAP2, 1),
    "svei8mm": (AT_HWCAP2, 9),
    "i8mm": (AT_HWCAP2, 13),
    "bf16": (AT_HWCAP2, 14),
    "sme": (AT_HWCAP2, 23),
}

# Arm MIDR part numbers (implementer 0x41) of efficiency ("LITTLE") cores.
ARM_LITTLE_PARTS = {
    0xD03: "Cortex-A53",
    0xD04: "Cortex-A35",
    0xD05: "Cortex-A55",
    0xD46: "Cortex-A510",
    0xD80: "Cortex-A520",
}
ARM_PART_NAMES = {
    **ARM_LITTLE_PARTS,
    0xD08: "Cortex-A72",
    0xD0B: "Cortex-A76",
    0xD0C: "Neoverse-N1",
    0xD0D: "Cortex-A77",
    0xD40: "Neoverse-V1",
    0xD41: "Cortex-A78",
    0xD44: "Cortex-X1",
    0xD47: "Cortex-A710",
    0xD48: "Cortex-X2",
    0xD49: "Neoverse-N2",
    0xD4D: "Cortex-A715",
    0xD4E: "Cortex-X3",
    0xD4F: "Neoverse-V2",
    0xD81: "Cortex-A720",
    0xD82: "Cortex-X4",
    0xD87: "Cortex-A725",
    0xD85: "Cortex-X925",
}
# Heuristics when no part number says which cores are little.
LITTLE_CAPACITY_RATIO = 0.6
LITTLE_FREQ_RATIO = 0.75


@dataclass(frozen=True)
class LogicalCpu:
    id: int
    package: int
    core: int
    siblings: tuple[int, ...]
    node: int
    capacity: int | None
    max_freq_khz: int | None
    part: int | None

    @property
    def part_name(self) -> str | None:
        return ARM_PART_NAMES.get(self.part, f"part {self.part:#x}") if self.part is not None else None


@dataclass(frozen=True)
class CpuInfo:
    arch: str
    model_name: str
    features: frozenset[str]
    cpus: tuple[LogicalCpu, ...]
    little: frozenset[int] = field(default_factory=frozenset)
    little_reason: str = ""

    @property
    def ids(self) -> list[int]:
        return [c.id for c in self.cpus]

    @property
    def nodes(self) -> list[int]:
        return sorted({c.node for c in self.cpus})

    @property
    def smt(self) -> bool:
        return any(len(c.siblings) > 1 for c in self.cpus)

    def physical_cores(self, among: list[int]) -> list[int]:
        """One logical CPU (the lowest id) per physical core, among the given CPUs."""
        # Siblings, not (package, core_id): Arm clusters may repeat core ids within one package.
        seen: set[tuple[int, ...]] = set()
        chosen = []
        for cpu in sorted((c for c in self.cpus if c.id in among), key=lambda c: c.id):
            key = cpu.siblings
            if key not in seen:
                seen.add(key)
                chosen.append(cpu.id)
        return chosen


def _cpuinfo_blocks(text: str) -> list[dict[str, str]]:
    blocks, current = [], {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, _, value = line.partition(":")
        current[key.strip().lower()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def _arch(files: SystemFiles, blocks: list[dict[str, str]]) -> str:
    if not files.live:
        # A recorded tree says what it is through its cpuinfo.
        return "aarch64" if any("cpu implementer" in b for b in blocks) else "x86_64"
    machine = platform.machine().lower()
    return {"arm64": "aarch64", "amd64": "x86_64"}.get(machine, machine)


def _classify_little(cpus: list[LogicalCpu]) -> tuple[frozenset[int], str]:
    parts = {c.part for c in cpus if c.part is not None}
    if parts and len(parts) > 1:
        little = {c.id for c in cpus if c.part in ARM_LITTLE_PARTS}
        if little and len(little) < len(cpus):
            names = sorted({ARM_LITTLE_PARTS[c.part] for c in cpus if c.id in little})
            return frozenset(little), f"MIDR part numbers: {', '.join(names)}"
    caps = [c.capacity for c in cpus if c.capacity]
    if caps and len(caps) == len(cpus) and min(caps) < LITTLE_CAPACITY_RATIO * max(caps):
        cut = LITTLE_CAPACITY_RATIO * max(caps)
        return frozenset(c.id for c in cpus if c.capacity < cut), (
            f"cpu_capacity (below {LITTLE_CAPACITY_RATIO:.0%} of the largest, {max(caps)})"
        )
    freqs = [c.max_freq_khz for c in cpus if c.max_freq_khz]
    if freqs and len(freqs) == len(cpus) and min(freqs) < LITTLE_FREQ_RATIO * max(freqs):
        cut = LITTLE_FREQ_RATIO * max(freqs)
        return frozenset(c.id for c in cpus if c.max_freq_khz < cut), (
            f"cpuinfo_max_freq (below {LITTLE_FREQ_RATIO:.0%} of the fastest, {max(freqs) // 1000} MHz)"
        )
    return frozenset(), "all cores alike"


def _hwcap_features() -> set[str]:
    """This process's aarch64 features from the auxiliary vector, as the native kernels read them."""
    import ctypes

    getauxval = ctypes.CDLL(None).getauxval
    getauxval.restype = ctypes.c_ulong
    getauxval.argtypes = [ctypes.c_ulong]
    words = {AT_HWCAP: getauxval(AT_HWCAP), AT_HWCAP2: getauxval(AT_HWCAP2)}
    return {name for name, (word, bit) in ARM_HWCAPS.items() if words[word] >> bit & 1}


def detect_cpu(files: SystemFiles) -> CpuInfo:
    blocks = _cpuinfo_blocks(files.read("proc/cpuinfo") or "")
    arch = _arch(files, blocks)
    flag_key = "flags" if arch == "x86_64" else "features"
    wanted = X86_FEATURES if arch == "x86_64" else ARM_FEATURES
    flags: set[str] = set()
    per_cpu_part: dict[int, int] = {}
    model_name = ""
    for block in blocks:
        flags.update(block.get(flag_key, "").split())
        model_name = model_name or block.get("model name", "")
        if "processor" in block and block["processor"].isdigit() and "cpu part" in block:
            with contextlib.suppress(ValueError):
                per_cpu_part[int(block["processor"])] = int(block["cpu part"], 0)
    if arch == "aarch64" and files.live and not any(flag_key in b for b in blocks):
        # A /proc/cpuinfo of another architecture (qemu-user before 8.2 shows the host's): the
        # features are the emulated CPU's HWCAPs, and its name is not known.
        flags, model_name, per_cpu_part = _hwcap_features(), "Arm CPU (features from HWCAP)", {}
    if arch == "aarch64" and not model_name:
        parts = sorted({ARM_PART_NAMES.get(p, f"part {p:#x}") for p in per_cpu_part.values()})
        model_name = " + ".join(parts) if parts else "Arm CPU"

    online = files.read_cpulist("sys/devices/system/cpu/online")
    if online is None:
        online = [int(b["processor"]) for b in blocks if b.get("processor", "").isdigit()] or [0]
    node_of: dict[int, int] = {}
    node = 0
    while (cpulist := files.read_cpulist(f"sys/devices/system/node/node{node}/cpulist")) is not None:
        node_of.update(dict.fromkeys(cpulist, node))
        node += 1
    cpus = []
    for cid in online:
        base = f"sys/devices/system/cpu/cpu{cid}"
        midr = files.read_int(f"{base}/regs/identification/midr_el1")
        part = (midr >> 4) & 0xFFF if midr is not None else per_cpu_part.get(cid)
        siblings = files.read_cpulist(f"{base}/topology/thread_siblings_list") or [cid]
        core_id = files.read_int(f"{base}/topology/core_id")
        cpus.append(
            LogicalCpu(
                id=cid,
                package=files.read_int(f"{base}/topology/physical_package_id") or 0,
                core=cid if core_id is None else core_id,
                siblings=tuple(siblings),
                node=node_of.get(cid, 0),
                capacity=files.read_int(f"{base}/cpu_capacity"),
                max_freq_khz=files.read_int(f"{base}/cpufreq/cpuinfo_max_freq"),
                part=part,
            )
        )
    little, reason = _classify_little(cpus)
    return CpuInfo(
        arch=arch,
        model_name=model_name or arch,
        features=frozenset(f for f in wanted if f in flags),
        cpus=tuple(cpus),
        little=little,
        little_reason=reason,
    )
