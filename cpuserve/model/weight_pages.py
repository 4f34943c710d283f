"""Packed weights moved into 2 MB pages (transparent huge pages).

A decode step streams every packed weight once. Left where torch allocated them, in 4 KB pages, the
stream crosses a page every 64 cache lines, each a TLB miss and a page walk competing with the
weight loads. Moved into an anonymous mapping advised MADV_HUGEPAGE, one TLB entry covers 2 MB:
single-stream decode ran 2-6% faster in one process (avx512_vnni, a Zen 5 host; docs/benchmarks.md,
"Packed weights in 2 MB pages"). llama.cpp's weights stay in the file's 4 KB page-cache pages.
The price is paid at load: the kernel faults in and zeroes each 2 MB page, slow where a VM backs
guest memory lazily (on a Firecracker guest the 2B shape's W4A8 1.3 GB took 2 s more, its W8A8
2.5 GB 5 s, the bundled model 0.15 s); the log says how long.

Each layer is moved as soon as its method has packed it (model/loader.py): every tensor of 4 KB or
more the linear holds (packed weights, scales, biases; whatever its method keeps). A tensor under 32 MB is
copied into chunks of 64 MB filled in turn (a chunk lives as long as some tensor in it does); a
larger one stays where it is and the kernel collapses its 2 MB-aligned interior into huge pages in
place (MADV_COLLAPSE, Linux 6.1+): copied, an output head's two copies at once raised a load's
peak RSS by the head's size (+197 MB for the 2B shape's). Only tensors that own their whole storage,
allocated by torch and referenced by nothing else, move: a view, a tensor mapped from a file or
one some other object shares keeps its place (moving it would leave the old copy alive). The bits
do not change, only where they live. A moved tensor is a view into its chunk's storage: a
`torch.save` or deepcopy of one copies the whole chunk, and one survivor keeps the chunk alive
(nothing in cpuserve does either to a loaded model). The move is off (the log says why) with
CPUSERVE_HUGE_PAGES=0, without THP, where the huge page is not 2 MB (arm64 kernels with 16 or
64 KB base pages) or the libc has no madvise.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
import re
import time
from dataclasses import dataclass

import torch
from torch import nn

from cpuserve.platform.sysfs import SystemFiles

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20  # bytes a chunk holds: a few of the 2B shape's largest linears
IN_PLACE = CHUNK // 2  # tensors from this size on are collapsed where they are, not copied
MADV_COLLAPSE = 25  # linux/mman.h (Python's mmap module names it from 3.13 on)
ALIGN = 64  # each tensor on a cache line, as torch's allocator places it
MIN_BYTES = 4096  # a smaller tensor lies within one 4 KB page: nothing to gain
THP_ENABLED = "sys/kernel/mm/transparent_hugepage/enabled"
THP_SIZE = "sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


def thp_mode(files: SystemFiles | None = None) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never), None where it has none."""
    text = (files or SystemFiles()).read(THP_ENABLED)
    chosen = re.search(r"\[(\w+)\]", text or "")
    return chosen.group(1) if chosen else None


def _off_reason(mode: str | None, huge_page: int | None) -> str | None:
    """Why weights stay in their pages, or None when they move (huge_page: the THP size in bytes)."""
    if os.environ.get("CPUSERVE_HUGE_PAGES", "1") == "0":
        return "CPUSERVE_HUGE_PAGES=0"
    if not hasattr(mmap, "MADV_HUGEPAGE") or _libc() is None:
        return "no madvise (MADV_HUGEPAGE) on this system"
    if not hasattr(torch._C, "_storage_Use_Count"):
        return "this torch cannot tell whether a tensor's storage is shared"
    if mode is None:
        return "the kernel has no transparent huge pages"
    if mode == "never":
        return "transparent huge pages are off (never)"
    if huge_page != HUGE_PAGE:
        return f"the kernel's huge page is {huge_page} bytes, not 2 MB"
    return None


@dataclass
class _Chunk:
    bytes: torch.Tensor  # uint8, starting on a 2 MB boundary; keeps its mapping alive
    used: int = 0


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _movable(t: torch.Tensor) -> bool:
    """Whether t alone owns its whole storage, one torch allocated (not a file mapping or a view)."""
    if t.device.type != "cpu" or t.is_meta or not t.is_contiguous() or t.storage_offset() != 0:
        return False
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if nbytes < MIN_BYTES or storage.nbytes() != nbytes or not storage.resizable():
        return False
    # 2: t and the storage object just made; a view or another tensor on it adds one
    return torch._C._storage_Use_Count(storage._cdata) == 2


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library with madvise, or None (then nothing moves)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def _madvise(address: int, length: int, advice: int) -> int:
    """libc madvise on a range of this process: 0, or the errno."""
    return 0 if _libc().madvise(address, length, advice) == 0 else ctypes.get_errno()


def _anon_huge_bytes() -> int:
    """This process's anonymous memory in huge pages (AnonHugePages of /proc/self/smaps_rollup)."""
    text = SystemFiles().read("proc/self/smaps_rollup") or ""
    found = re.search(r"AnonHugePages:\s+(\d+) kB", text)
    return int(found.group(1)) * 1024 if found else 0


def _release_freed() -> None:
    """The freed copies' memory back to the kernel. Below glibc's mmap threshold (which rises to
    32 MB as large blocks are freed) a tensor comes from the heap, and free() keeps those pages:
    without this the 2B W8A8 load kept 680 MB of freed copies resident."""
    if hasattr(_libc(), "malloc_trim"):  # glibc
        _libc().malloc_trim(0)


class WeightPages:
    """Where one model's packed weights live: chunks of anonymous memory advised MADV_HUGEPAGE, and
    large tensors collapsed into huge pages in place."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode  # the kernel's THP mode, for the log
        self._chunk: _Chunk | None = None
        self.moved_bytes = 0
        self.moved_tensors = 0
        self.collapse_errors: dict[int, int] = {}  # errno -> collapses that failed with it
        self.stopped: str | None = None  # why moving stopped part way (a mapping refused)
        self._huge_before = _anon_huge_bytes()
        self.seconds = 0.0  # the load's time spent moving: faulting in huge pages is the kernel's work

    @staticmethod
    def _region(size: int) -> _Chunk:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: the faults then take 2 MB pages
        whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while any view lives
        start = -whole.data_ptr() % HUGE_PAGE
        return _Chunk(whole[start : start + size])

    def _place(self, nbytes: int) -> torch.Tensor:
        if self._chunk is None or self._chunk.used + nbytes > CHUNK:
            self._chunk = self._region(CHUNK)
        at = self._chunk.used
        self._chunk.used = _round_up(at + nbytes, ALIGN)
        return self._chunk.bytes[at : at + nbytes]

    def _collapse(self, address: int, nbytes: int) -> bool:
        """The 2 MB pages inside [address, address + nbytes) made huge where they are."""
        start, end = _round_up(address, HUGE_PAGE), (address + nbytes) // HUGE_PAGE * HUGE_PAGE
        _madvise(start, end - start, mmap.MADV_HUGEPAGE)  # khugepaged keeps them so
        error = _madvise(start, end - start, MADV_COLLAPSE)
        if error:
            self.collapse_errors[error] = self.collapse_errors.get(error, 0) + 1
        return error == 0

    def move(self, t: torch.Tensor) -> bool:
        """t's values into huge pages (every holder of t sees them); False if they stay in 4 KB pages."""
        if self.stopped is not None or not _movable(t):
            return False
        started = time.perf_counter()
        try:
            return self._move(t)
        except OSError as exc:  # a mapping or its advice refused: the rest stays where it is
            self.stopped = str(exc)
            return False
        finally:
            self.seconds += time.perf_counter() - started

    def _move(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        if nbytes >= IN_PLACE:
            if not self._collapse(t.data_ptr(), nbytes):
                return False
        else:
            dst = self._place(nbytes).view(t.dtype).view(t.shape)
            with torch.no_grad():
                dst.copy_(t)
                t.set_(dst)
        self.moved_bytes += nbytes
        self.moved_tensors += 1
        return True

    def summary(self) -> str:
        """What the load's log says: what moved, and what the kernel backs with huge pages (the
        faults fall back to 4 KB pages when it cannot find free 2 MB)."""
        huge = max(0, _anon_huge_bytes() - self._huge_before)
        text = (
            f"{self.moved_bytes / 1e6:.0f} MB ({self.moved_tensors} tensors) moved in {self.seconds:.1f} s,"
            f" {huge / 1e6:.0f} MB more of the process in huge pages (transparent huge pages: {self.mode})"
        )
        for error, count in sorted(self.collapse_errors.items()):
            text += f"; {count} tensor(s) of {IN_PLACE >> 20} MB or more left in place: MADV_COLLAPSE failed"
            text += f" ({errno.errorcode.get(error, error)}{'; Linux 6.1+ has it' if error == errno.EINVAL else ''})"
        if self.stopped is not None:
            text += f"; stopped part way: {self.stopped}"
        return text

    def settle(self, layer: nn.Module) -> None:
        """Every tensor layer itself holds (attributes, buffers, parameters; not its children's)."""
        seen: set[int] = set()
        moved = False
        for t in [*vars(layer).values(), *layer._buffers.values(), *layer._parameters.values()]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                moved = self.move(t) or moved
        if moved:
            started = time.perf_counter()
            _release_freed()
            self.seconds += time.perf_counter() - started


def weight_pages() -> WeightPages | None:
    """A model load's WeightPages, or None (the reason logged) when weights stay in 4 KB pages."""
    mode = thp_mode()
    reason = _off_reason(mode, SystemFiles().read_int(THP_SIZE))
    if reason is not None:
        log.info("packed weights stay where torch allocated them: %s", reason)
        return None
    return WeightPages(mode)
