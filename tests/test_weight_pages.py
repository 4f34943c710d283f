"""Packed weights moved into 2 MB pages (model/weight_pages.py): the same values in place, only
tensors that own their storage, mappings advised MADV_HUGEPAGE, and a loaded model's logits
unchanged by the move."""

from __future__ import annotations

import errno
import logging
import mmap
import platform
import re
from pathlib import Path

import pytest
import torch

from cpuserve.model import weight_pages
from cpuserve.model.weight_pages import HUGE_PAGE, IN_PLACE, WeightPages, thp_mode
from cpuserve.platform.sysfs import SystemFiles

pytestmark = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE") or thp_mode() is None, reason="no transparent huge pages on this system"
)


def _mapping(address: int) -> str:
    """The /proc/self/smaps block of the mapping that holds address."""
    text = Path("/proc/self/smaps").read_text()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        start, end = (int(x, 16) for x in block.split()[0].split("-"))
        if start <= address < end:
            return block
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapping_flags(address: int) -> list[str]:
    """VmFlags of the mapping that holds address."""
    return re.search(r"VmFlags:(.*)", _mapping(address)).group(1).split()


@pytest.mark.parametrize(
    "text, mode",
    [
        ("always [madvise] never\n", "madvise"),
        ("[always] madvise never\n", "always"),
        ("always madvise [never]\n", "never"),
    ],
)
def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path, text: str, mode: str) -> None:
    f = tmp_path / "sys/kernel/mm/transparent_hugepage/enabled"
    f.parent.mkdir(parents=True)
    f.write_text(text)
    assert thp_mode(SystemFiles(tmp_path)) == mode


def test_no_thp_file_is_none(tmp_path: Path) -> None:
    assert thp_mode(SystemFiles(tmp_path)) is None


def test_off_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPUSERVE_HUGE_PAGES", "0")
    assert weight_pages._off_reason("madvise", HUGE_PAGE) == "CPUSERVE_HUGE_PAGES=0"
    monkeypatch.delenv("CPUSERVE_HUGE_PAGES")
    assert weight_pages._off_reason("never", HUGE_PAGE) == "transparent huge pages are off (never)"
    assert weight_pages._off_reason(None, None) == "the kernel has no transparent huge pages"
    # arm64 kernels with 64 KB base pages: 512 MB huge pages, never filled by 64 MB chunks
    assert weight_pages._off_reason("madvise", 512 << 20) == "the kernel's huge page is 536870912 bytes, not 2 MB"
    assert weight_pages._off_reason("madvise", HUGE_PAGE) is None
    assert weight_pages._off_reason("always", HUGE_PAGE) is None


def test_a_moved_tensor_keeps_its_values_in_an_advised_2mb_aligned_chunk() -> None:
    pages = WeightPages()
    a = torch.randn(300, 70)
    b = torch.randint(0, 255, (5000,), dtype=torch.uint8)
    a_ref, b_ref, a_ptr = a.clone(), b.clone(), a.data_ptr()
    assert pages.move(a) and pages.move(b)
    assert torch.equal(a, a_ref) and torch.equal(b, b_ref)
    assert a.data_ptr() != a_ptr
    assert a.data_ptr() % HUGE_PAGE == 0  # a chunk's first tensor starts its first 2 MB page
    assert b.data_ptr() == a.data_ptr() + (300 * 70 * 4 + 63) // 64 * 64  # the next cache line after a
    assert "hg" in _mapping_flags(a.data_ptr())  # MADV_HUGEPAGE
    assert pages.moved_tensors == 2 and pages.moved_bytes == 300 * 70 * 4 + 5000
    assert not pages.move(a)  # already there


def _kernel_at_least(major: int, minor: int) -> bool:
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (major, minor)


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping that holds address."""
    return int(re.search(r"AnonHugePages:\s+(\d+)", _mapping(address)).group(1))


def test_a_large_tensor_is_collapsed_where_it_is() -> None:
    """From IN_PLACE bytes on, no second copy: the 2 MB pages inside the tensor become huge in place
    (MADV_COLLAPSE, Linux 6.1+); small tensors still go to the chunk."""
    pages = WeightPages()
    large = torch.arange(IN_PLACE // 4 + 3 * HUGE_PAGE // 4 + 16, dtype=torch.int32)
    expected, where = large.clone(), large.data_ptr()
    moved = pages.move(large)
    assert large.data_ptr() == where and torch.equal(large, expected)
    if not moved and (
        not _kernel_at_least(6, 1) or {errno.ENOMEM, errno.EAGAIN, errno.EBUSY} & set(pages.collapse_errors)
    ):
        pytest.skip(f"MADV_COLLAPSE failed on Linux {platform.release()}: {pages.summary()}")
    assert moved and not pages.collapse_errors
    interior = (where + large.numel() * 4) // HUGE_PAGE * HUGE_PAGE - -(-where // HUGE_PAGE) * HUGE_PAGE
    assert _anon_huge_kb(where + HUGE_PAGE) * 1024 >= interior  # every whole 2 MB page inside it
    small = torch.ones(2048)
    assert pages.move(small) and small.data_ptr() % HUGE_PAGE == 0
    assert pages.moved_tensors == 2 and pages.moved_bytes == large.numel() * 4 + 2048 * 4


def test_views_shared_file_mapped_and_tiny_tensors_stay() -> None:
    pages = WeightPages()
    base = torch.randn(64, 64)
    view = base[8:]
    shared = torch.randn(4096)
    holder = shared.view(64, 64)  # another tensor on the same storage: moving would keep two copies
    region = mmap.mmap(-1, 1 << 16, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapped = torch.frombuffer(region, dtype=torch.uint8)
    tiny = torch.randn(16)
    before = {
        name: t.data_ptr() for name, t in [("view", view), ("shared", shared), ("mapped", mapped), ("tiny", tiny)]
    }
    assert not pages.move(view) and not pages.move(shared) and not pages.move(mapped) and not pages.move(tiny)
    after = {name: t.data_ptr() for name, t in [("view", view), ("shared", shared), ("mapped", mapped), ("tiny", tiny)]}
    assert after == before and holder.data_ptr() == shared.data_ptr()
    assert pages.moved_tensors == 0


def test_a_failed_collapse_leaves_the_tensor_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def refuse_collapse(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        return errno.EINVAL if advice == weight_pages.MADV_COLLAPSE else 0

    monkeypatch.setattr(weight_pages, "_madvise", refuse_collapse)
    pages = WeightPages()
    large = torch.ones(IN_PLACE // 4 + HUGE_PAGE // 4)
    assert not pages.move(large)
    assert calls == [mmap.MADV_HUGEPAGE, weight_pages.MADV_COLLAPSE]
    assert pages.moved_tensors == 0 and pages.collapse_errors == {errno.EINVAL: 1}
    assert "1 tensor(s) of 32 MB or more left in place: MADV_COLLAPSE failed (EINVAL; Linux 6.1+ has it)" in (
        pages.summary()
    )


def test_settle_moves_what_the_layer_itself_holds_once() -> None:
    """Parameters, buffers and plain attributes, each once however often it is named; a child's
    tensors are its own layer's business."""
    layer = torch.nn.Linear(64, 64)
    layer.register_buffer("codes", torch.randint(0, 255, (8192,), dtype=torch.uint8))
    layer.packed = torch.randn(32, 64)
    layer.alias = layer.packed  # the same tensor again
    layer.child = torch.nn.Linear(64, 64)
    before = {n: t.clone() for n, t in [("w", layer.weight), ("codes", layer.codes), ("packed", layer.packed)]}
    child_ptr = layer.child.weight.data_ptr()
    pages = WeightPages()
    pages.settle(layer)
    assert pages.moved_tensors == 3  # weight, codes, packed (the bias is under 4 KB)
    for name, t in [("w", layer.weight), ("codes", layer.codes), ("packed", layer.packed)]:
        assert torch.equal(t, before[name]) and "hg" in _mapping_flags(t.data_ptr())
    assert isinstance(layer.weight, torch.nn.Parameter)
    assert layer.alias is layer.packed and layer.child.weight.data_ptr() == child_ptr
    assert torch.equal(layer(torch.ones(2, 64)), torch.ones(2, 64) @ before["w"].T + layer.bias)


def test_a_loaded_models_logits_are_the_same_in_either_pages(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kernels, cache_dir: Path
) -> None:
    """The bundled GGUF on the native kernels, loaded with and without the move: the same logits
    bit for bit; moved, every packed weight in an advised mapping. (Not moved, the log says so;
    their mappings are not checked: in a long test process glibc can place them in memory some
    earlier madvise left advised.)"""
    from cpuserve.model.loader import load_model
    from cpuserve.model.resolve import resolve_model
    from cpuserve.quant.linear import Linear

    ids = torch.tensor([[1, 4093, 314, 253, 3575, 282, 4649, 30]])
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("CPUSERVE_HUGE_PAGES", flag)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cpuserve"):
            model = load_model(resolve_model(None, str(cache_dir)), "auto")
        said = [r.getMessage() for r in caplog.records if "packed weights" in r.getMessage()]
        if flag == "0":
            assert said == ["packed weights stay where torch allocated them: CPUSERVE_HUGE_PAGES=0"]
        else:
            assert len(said) == 1 and re.match(r"packed weights: \d+ MB \(\d+ tensors\) moved in", said[0])
        packed = [m.packed for m in model.modules() if isinstance(m, Linear) and getattr(m, "packed", None) is not None]
        assert len(packed) >= 4 * model.spec.num_layers
        # a tensor collapsed in place is advised from its first whole 2 MB page on
        inside = [
            t.data_ptr() if t.numel() * t.element_size() < IN_PLACE else -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
            for t in packed
        ]
        flags = ["hg" in _mapping_flags(address) for address in inside]
        cache = model.new_cache(1, 16, None)
        runs[flag] = (model.logits(model.hidden_states(ids, cache)[:, -1]), flags)
    assert torch.equal(runs["0"][0], runs["1"][0])
    if thp_mode() in ("always", "madvise"):
        assert all(runs["1"][1])
