"""Reasoning out of generated text, for the chat route's `reasoning_content` (vLLM's `--reasoning-parser`).

Reasoning models think in a `<think>...</think>` block before they answer; the API returns the thinking
as `reasoning_content` and the answer as `content`. Each parser splits the whole output (`split`) or
does it incrementally (`stream`), so a streamed choice sends what a non-streamed one returns.

Whitespace: reasoning and content are each stripped of leading and trailing whitespace (so the newlines
around the markers go), and an empty one is None. The markers themselves are never part of either. A
stream sends text as soon as it knows which side it is on, holding back only a tail that may still grow
into a marker and whitespace that may turn out to be trailing; its deltas concatenate to `split()`'s
strings (None as ""), for any split of the text into deltas, with the single qwen3 exception documented
on Qwen3ReasoningParser.

Only the first `</think>` ends reasoning (later ones are content); `<think>` counts only at the very
start of the output (after whitespace), elsewhere it is text.
"""

from __future__ import annotations

import abc
from typing import ClassVar

from cpuserve.server.tool_parsers import Stripper, split_marker


def _opt(text: str) -> str | None:
    return text.strip() or None


class ReasoningStream(abc.ABC):
    """The incremental splitter of one choice."""

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) now safe to send; never part of a marker."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, str]:
        """At the end of generation: what was held back, on the side split() puts it."""

    @property
    @abc.abstractmethod
    def reasoning_done(self) -> bool:
        """The end marker has been seen, or the stream treats the rest of the output as content."""


class ReasoningParser(abc.ABC):
    """One model family's reasoning format."""

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    # The output is reasoning until `end` even without `start` (the template wrote `start` into the prompt).
    implicit_start: ClassVar[bool] = True

    def split(self, text: str, *, in_reasoning: bool = False) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of the whole output; in_reasoning: the prompt ends inside a think block."""
        body = text.lstrip()
        if body.startswith(self.start):
            reasoning, found, content = body[len(self.start) :].partition(self.end)
        else:
            reasoning, found, content = text.partition(self.end)
            if not found and not (self.implicit_start or in_reasoning):
                return None, _opt(text)
        return _opt(reasoning), _opt(content)

    def stream(self, *, in_reasoning: bool = False) -> ReasoningStream:
        """A fresh incremental splitter for one choice (in_reasoning as for split)."""
        return _ThinkStream(self, self.implicit_start or in_reasoning)


class _ThinkStream(ReasoningStream):
    def __init__(self, parser: ReasoningParser, implicit_start: bool) -> None:
        self._start, self._end, self._implicit = parser.start, parser.end, implicit_start
        self._reasoning, self._content = Stripper(), Stripper()
        self._held = ""
        # "start": the output may still open with the start marker; "reasoning": before the end marker;
        # "watch": content that a lone end marker may interrupt (qwen3, no start marker); "content": the rest.
        self._state = "start"

    @property
    def reasoning_done(self) -> bool:
        return self._state in ("watch", "content")

    def feed(self, delta: str) -> tuple[str, str]:
        if self._state == "content":
            return "", self._content.push(delta)
        self._held += delta
        if self._state == "start":
            body = self._held.lstrip()
            if self._start.startswith(body) and body != self._start:  # nothing yet, or maybe the marker
                return "", ""
            if body.startswith(self._start):
                self._held, self._state = body[len(self._start) :], "reasoning"
            else:
                self._state = "reasoning" if self._implicit else "watch"
        before, self._held, found = split_marker(self._held, self._end)
        thinking = self._state == "reasoning"
        reasoning = self._reasoning.push(before) if thinking else ""
        content = "" if thinking else self._content.push(before)
        if found:
            self._state, rest, self._held = "content", self._held, ""
            content += self._content.push(rest)
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        on_reasoning = self._state == "reasoning" or (self._state == "start" and self._implicit)
        self._state = "content"
        return (self._reasoning.push(held), "") if on_reasoning else ("", self._content.push(held))


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 (and its distills): reasoning up to `</think>`, whether or not the output opens with
    `<think>` (the template may have put it in the prompt); with no `</think>` at all, all of it is reasoning
    (generation was cut while thinking). in_reasoning changes nothing here."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: `<think>...</think>` then content; an output with neither marker is all content (thinking off);
    `<think>` that never closes makes the rest reasoning; text before a lone `</think>` is reasoning (the
    template put `<think>` in the prompt).

    Streaming exception: a stream cannot know whether a lone `</think>` will come, so when the output does
    not open with `<think>` it sends the text as content at once (reasoning_done is then True). If a lone
    `</think>` does follow non-whitespace text, split() calls that text reasoning while the stream has sent
    it as content: the stream's content is then (before + after).strip() without the marker, and its
    reasoning empty. Pass in_reasoning=True (to both) when the prompt ends inside `<think>`: then qwen3 splits
    like deepseek_r1 and the stream agrees with split() exactly.
    """

    name = "qwen3"
    implicit_start = False


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser by its vLLM name; ValueError naming the known ones for any other."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
