"""The arithmetic of `cpuserve bench itl` (the run itself needs minutes of a quiet machine)."""

from __future__ import annotations

import sys

from cpuserve.bench.itl_bench import ItlResult, LongRun, StreamTimes, long_prompt, render, server_entry
from cpuserve.tokenizer import Tokenizer


def test_gaps_before_and_the_longest_around_the_window():
    t = StreamTimes([0.0, 0.1, 0.2, 0.3, 1.5, 1.6])
    assert [round(g, 3) for g in t.gaps(0.05, 1.0)] == [0.1, 0.1]  # 0.0 precedes the start
    assert t.longest_overlapping(1.0, 1.2) == 1.2  # the stall began before the window opened
    assert round(t.longest_overlapping(1.45, 2.0), 3) == 1.2  # ...or ended inside it
    assert round(t.longest_overlapping(1.55, 2.0), 3) == 0.1
    assert StreamTimes([5.0]).longest_overlapping(0, 1) == 0.0


def test_long_prompt_has_about_the_asked_tokens(smol_dir):
    tokenizer = Tokenizer(smol_dir)
    text = long_prompt(tokenizer, 2000, seed=1)
    assert 2000 <= len(tokenizer.encode(text)) < 2010
    assert text == long_prompt(tokenizer, 2000, seed=1) != long_prompt(tokenizer, 2000, seed=2)


def test_server_entry_imports_the_given_checkout_first(tmp_path):
    entry = server_entry(tmp_path)
    assert entry[:2] == [sys.executable, "-c"] and f"sys.path.insert(0, {str(tmp_path)!r})" in entry[2]


def test_render_has_a_row_per_long_prompt_and_their_median():
    runs = [
        LongRun(2001, 0.5, [0.1, 0.12], [0.4, 0.6]),
        LongRun(2002, 0.7, [0.1, 0.1], [0.5, 0.9]),
    ]
    text = render(ItlResult("/x/cpuserve/__init__.py", [40, 41], runs), "cpuserve serve m")
    assert "2 streams, 81 tokens streamed" in text
    assert "| 1 | 2001 | 500 | 110.0 | 600 | 400 |" in text and "| 2 | 2002 | 700 | 100.0 | 900 | 500 |" in text
    assert "| median | | 600 | 105.0 | 750 | 450 |" in text
