"""Reasoning parsers: exact (reasoning, content) splits, and streams that agree with split() for any split."""

from __future__ import annotations

import random

import pytest

from cpuserve.server.reasoning import PARSERS, ReasoningParser, get_reasoning_parser
from tests.test_tool_parsers import splits

Split = tuple[str | None, str | None]

# (text, deepseek_r1's split, qwen3's split)
CASES: list[tuple[str, Split, Split]] = [
    (
        "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        ("Let me think.", "The answer is 4."),
        ("Let me think.", "The answer is 4."),
    ),
    ("  <think>a\n\nb</think>c", ("a\n\nb", "c"), ("a\n\nb", "c")),
    ("<think></think>\n\nJust the answer.", (None, "Just the answer."), (None, "Just the answer.")),
    ("<think>\n\n</think>", (None, None), (None, None)),
    ("", (None, None), (None, None)),
    ("  \n", (None, None), (None, None)),
    # The template wrote <think>: the output starts inside reasoning and has only </think>.
    ("Let me think.\n</think>\n\nFour.", ("Let me think.", "Four."), ("Let me think.", "Four.")),
    ("</think>Four.", (None, "Four."), (None, "Four.")),
    # No </think>: deepseek_r1 was cut while thinking; qwen3 had thinking off, unless <think> opened.
    ("Four.", ("Four.", None), (None, "Four.")),
    ("<think>\nStill thinking", ("Still thinking", None), ("Still thinking", None)),
    ("<think>", (None, None), (None, None)),
    ("<thi", ("<thi", None), (None, "<thi")),
    ("a </thin", ("a </thin", None), (None, "a </thin")),
    # Only the first </think> ends reasoning; <think> counts only at the start.
    ("<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("x <think>y</think> z", ("x <think>y", "z"), ("x <think>y", "z")),
    ("<think><think>y</think>z", ("<think>y", "z"), ("<think>y", "z")),
    ("<think>东京 🙂 é</think>答え", ("东京 🙂 é", "答え"), ("东京 🙂 é", "答え")),
    ("<think>a < b, c </ d</think> <x>", ("a < b, c </ d", "<x>"), ("a < b, c </ d", "<x>")),
]


def run_stream(parser: ReasoningParser, deltas: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    """The concatenated reasoning and content a stream sends for these deltas."""
    stream = parser.stream(in_reasoning=in_reasoning)
    reasoning, content = [], []
    for delta in deltas:
        r, c = stream.feed(delta)
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    assert stream.reasoning_done
    return "".join(reasoning) + r, "".join(content) + c


def as_sent(split: Split) -> tuple[str, str]:
    return split[0] or "", split[1] or ""


def qwen3_stream_differs(text: str) -> bool:
    """The documented exception: no leading <think>, and non-whitespace text before a lone </think>."""
    before, found, _ = text.partition("</think>")
    return not text.lstrip().startswith("<think>") and bool(found) and bool(before.strip())


@pytest.mark.parametrize(("text", "deepseek", "qwen3"), CASES)
def test_split_gives_the_exact_reasoning_and_content(text: str, deepseek: Split, qwen3: Split) -> None:
    assert get_reasoning_parser("deepseek_r1").split(text) == deepseek
    assert get_reasoning_parser("qwen3").split(text) == qwen3


@pytest.mark.parametrize(("text", "deepseek", "qwen3"), CASES)
def test_qwen3_in_reasoning_splits_like_deepseek_r1(text: str, deepseek: Split, qwen3: Split) -> None:
    assert get_reasoning_parser("qwen3").split(text, in_reasoning=True) == deepseek
    assert get_reasoning_parser("deepseek_r1").split(text, in_reasoning=True) == deepseek


@pytest.mark.parametrize("text", [case[0] for case in CASES])
@pytest.mark.parametrize(("name", "in_reasoning"), [("deepseek_r1", False), ("qwen3", False), ("qwen3", True)])
def test_a_stream_sends_what_split_returns_for_any_split(name: str, in_reasoning: bool, text: str) -> None:
    parser = get_reasoning_parser(name)
    expected = as_sent(parser.split(text, in_reasoning=in_reasoning))
    if name == "qwen3" and not in_reasoning and qwen3_stream_differs(text):
        before, _, after = text.partition("</think>")
        expected = ("", (before + after).strip())  # the documented exception
    for deltas in splits(text):
        assert run_stream(parser, deltas, in_reasoning) == expected, deltas


def test_qwen3_exception_is_only_the_lone_end_marker_after_text() -> None:
    differs = [text for text, _, _ in CASES if qwen3_stream_differs(text)]
    assert differs == ["Let me think.\n</think>\n\nFour.", "x <think>y</think> z"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_random_texts_stream_as_they_split(name: str) -> None:
    rng = random.Random(name)
    parser = get_reasoning_parser(name)
    pool = ["<think>", "</think>", "<th", "</thi", "<", "</", ">", "a", "é", " ", "\n", "think"]
    for _ in range(1500):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 7)))
        in_reasoning = rng.random() < 0.3
        expected = as_sent(parser.split(text, in_reasoning=in_reasoning))
        if name == "qwen3" and not in_reasoning and qwen3_stream_differs(text):
            before, _, after = text.partition("</think>")
            expected = ("", (before + after).strip())
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run_stream(parser, deltas, in_reasoning) == expected, (text, deltas)
        assert run_stream(parser, list(text), in_reasoning) == expected, text


def test_deepseek_stream_holds_back_only_a_possible_marker() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>\nStep one.\n</th") == ("Step one.", "")
    assert not stream.reasoning_done
    assert stream.feed("ink>\n\nAns") == ("", "Ans")
    assert stream.reasoning_done
    assert stream.feed("wer </think>") == ("", "wer </think>")  # after the end marker all is content
    assert stream.finish() == ("", "")


def test_qwen3_stream_decides_at_the_first_text() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("\n<") == ("", "")
    assert not stream.reasoning_done
    assert stream.feed("b>Bold") == ("", "<b>Bold")  # not <think>: content at once
    assert stream.reasoning_done
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>Hmm") == ("Hmm", "")
    assert not stream.reasoning_done
    assert stream.finish() == ("", "")
    stream = get_reasoning_parser("qwen3").stream(in_reasoning=True)
    assert stream.feed("Hmm") == ("Hmm", "")
    assert not stream.reasoning_done


def test_qwen3_stream_drops_a_lone_end_marker_from_content() -> None:
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("a </th") == ("", "a")
    assert stream.feed("ink> b") == ("", "  b")
    assert stream.finish() == ("", "")


def test_parsers_are_registered_by_name_and_unknown_names_are_refused() -> None:
    assert sorted(PARSERS) == ["deepseek_r1", "qwen3"]
    for name, cls in PARSERS.items():
        parser = get_reasoning_parser(name)
        assert isinstance(parser, cls) and cls.name == name
        assert (parser.start, parser.end) == ("<think>", "</think>")
    with pytest.raises(ValueError, match=r"'granite'.*deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
