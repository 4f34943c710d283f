"""File access under a (possibly recorded) filesystem root, and CPU-list syntax."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


def parse_cpulist(text: str) -> list[int]:
    """'0-3,6,8-9' -> [0, 1, 2, 3, 6, 8, 9]; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{text.strip()!r} is not a CPU list like '0-3,6'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"{part!r} is a descending range")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpulist(cpus: list[int] | set[int]) -> str:
    """[0, 1, 2, 3, 6] -> '0-3,6'."""
    ordered = sorted(cpus)
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class SystemFiles:
    """Reads /proc and /sys files relative to `root` ("/" on a live machine)."""

    root: Path = Path("/")

    @property
    def live(self) -> bool:
        return self.root == Path("/")

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def read(self, rel: str) -> str | None:
        try:
            return self.path(rel).read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def read_int(self, rel: str) -> int | None:
        text = self.read(rel)
        if text is None:
            return None
        text = text.strip()
        try:
            return int(text, 0)
        except ValueError:
            return None

    def read_cpulist(self, rel: str) -> list[int] | None:
        text = self.read(rel)
        if text is None:
            return None
        try:
            return parse_cpulist(text)
        except ValueError:
            return None
