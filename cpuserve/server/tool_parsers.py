"""Tool calls out of generated text, for the chat route's `tool_calls` (vLLM's `--tool-call-parser`).

A model asked to call a tool writes the call as text in its own format; the API returns it as structured
`tool_calls` and the rest as `content`. Each parser reads one family's format from the whole output (`parse`)
and incrementally (`stream`), so a streamed choice sends what a non-streamed one returns.

- content: all text outside recognised calls, concatenated, then stripped of leading and trailing whitespace
  (None when nothing is left). Text that fails to parse as a call stays in it verbatim.
- a stream sends content once it is known to be content, holding back a tail that may grow into a marker, a
  call being read, and whitespace that may be trailing. For any split of a text into deltas, its content
  concatenates to exactly `parse(text).content or ""` and its calls are `parse(text).tool_calls`.
- arguments: `json.dumps(obj, ensure_ascii=False)` of the arguments object; a JSON string holding an object is
  decoded first; absent or null arguments are `{}`. JSON must be strict (no NaN/Infinity).
"""

from __future__ import annotations

import abc
import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


@dataclass(frozen=True)
class ToolCall:
    """One function call, as the API's `tool_calls[].function` carries it."""

    name: str
    arguments: str  # the arguments object as JSON text


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output, parsed."""

    content: str | None  # text outside the calls, stripped; None when empty
    tool_calls: list[ToolCall]


class ToolCallStream(abc.ABC):
    """The incremental parser of one choice."""

    @abc.abstractmethod
    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The content now safe to send (never part of a marker that may still complete) and the calls completed."""

    @abc.abstractmethod
    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of generation: what was held back, as parse() treats it (e.g. an unparseable block as content)."""


class ToolParser(abc.ABC):
    """One model family's tool-call format."""

    name: ClassVar[str]
    # True when the markers are special tokens that a detokenizer skipping special tokens would drop.
    needs_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of the whole generated text."""

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh incremental parser for one choice."""


def _decode(text: str, pos: int) -> tuple[Any, int]:
    """The JSON value at pos and where it ends, or (None, -1)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        return None, -1


def _loads(text: str) -> Any:
    """The JSON value of the whole text (whitespace around it allowed), or None."""
    obj, end = _decode(text, _skip_ws(text, 0))
    return obj if end >= 0 and _skip_ws(text, end) == len(text) else None


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _arguments(value: Any) -> str | None:
    """The arguments as JSON text of an object, or None when they are not an object."""
    if value is None:
        value = {}
    elif isinstance(value, str):
        value = _loads(value)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from `{"name": str, <one of keys>: arguments}`, or None when obj is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), None)
    arguments = _arguments(args)
    return None if arguments is None else ToolCall(obj["name"], arguments)


def split_marker(buf: str, marker: str) -> tuple[str, str, bool]:
    """Split buf at its first marker: (before, after, True); without one, (the part that cannot be the start of
    a marker, the tail that may still grow into one, False)."""
    i = buf.find(marker)
    if i >= 0:
        return buf[:i], buf[i + len(marker) :], True
    held = next((n for n in range(min(len(buf), len(marker) - 1), 0, -1) if buf.endswith(marker[:n])), 0)
    return buf[: len(buf) - held], buf[len(buf) - held :], False


def _content(text: str) -> str | None:
    return text.strip() or None


class Stripper:
    """Sends pushed text stripped as a whole: drops leading whitespace, holds whitespace that may be trailing."""

    def __init__(self) -> None:
        self._started = False
        self._pending = ""

    def push(self, text: str) -> str:
        """The part of text (after what is held) that is certainly not leading or trailing whitespace."""
        text = self._pending + text if self._started else text.lstrip()
        self._started = self._started or bool(text)
        out = text.rstrip()
        self._pending = text[len(out) :]
        return out


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(?P<body>.*?)(?:</tool_call>|\Z)", re.DOTALL)
_ARG_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen 2.5/3, Hermes, MiniCPM).

    Any number of blocks, text anywhere around them. A block whose JSON is not a call stays in the
    content verbatim. An unterminated block at the end is a call when its JSON is complete (models stop
    at EOS right after it), content otherwise.
    """

    name = "hermes"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []

        def outside(block: re.Match[str]) -> str:
            call = _call(_loads(block["body"]), _ARG_KEYS)
            if call is None:
                return block[0]
            calls.append(call)
            return ""

        return ParsedOutput(_content(_HERMES_BLOCK.sub(outside, text)), calls)

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class _HermesStream(ToolCallStream):
    def __init__(self) -> None:
        self._trim = Stripper()
        self._held = ""  # a tail that may be the start of the next marker
        self._body: str | None = None  # inside a block: its body so far

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        out: list[str] = []
        calls: list[ToolCall] = []
        found = True
        while found:
            if self._body is None:
                before, self._held, found = split_marker(self._held, _HERMES_OPEN)
                out.append(before)
                self._body = "" if found else None
                continue
            before, self._held, found = split_marker(self._held, _HERMES_CLOSE)
            self._body += before
            if found:
                body, self._body = self._body, None
                call = _call(_loads(body), _ARG_KEYS)
                if call is None:
                    out.append(_HERMES_OPEN + body + _HERMES_CLOSE)
                else:
                    calls.append(call)
        return self._trim.push("".join(out)), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._held = self._held, ""
        if self._body is not None:
            body, self._body = self._body + rest, None
            call = _call(_loads(body), _ARG_KEYS)
            if call is not None:
                return "", [call]
            rest = _HERMES_OPEN + body
        return self._trim.push(rest), []


_PYTHON_TAG = "<|python_tag|>"
_LLAMA_KEYS = ("parameters", "arguments")


def _llama_start(text: str) -> int:
    """Where the calls would start: past leading whitespace and an optional `<|python_tag|>`."""
    pos = _skip_ws(text, 0)
    return _skip_ws(text, pos + len(_PYTHON_TAG)) if text.startswith(_PYTHON_TAG, pos) else pos


def _skip_separator(text: str, pos: int) -> int:
    """Past the whitespace and at most one `;` after an object."""
    pos = _skip_ws(text, pos)
    return _skip_ws(text, pos + 1) if text.startswith(";", pos) else pos


def _llama_read(text: str, pos: int, calls: list[ToolCall]) -> tuple[int, bool]:
    """Append the calls complete in text from pos (the start, or the end of the last call in calls).

    Returns where the last complete call ends, and False when text cannot be calls whatever follows."""
    while True:
        start = _skip_separator(text, pos) if calls else _skip_ws(text, pos)
        if start == len(text):
            return pos, True
        if text[start] != "{":
            return pos, False
        obj, end = _decode(text, start)
        if end < 0:
            return pos, True  # incomplete (or invalid, which only the end can tell)
        call = _call(obj, _LLAMA_KEYS)
        if call is None:
            return pos, False
        calls.append(call)
        pos = end


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON calls: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
    objects (or "arguments") separated by whitespace and/or one `;` (a trailing `;` is allowed).

    All or nothing: unless the whole output is such calls, it is all content (the tag included) and there
    are no calls. A stream that sees the output start with `{` therefore holds everything until it knows:
    at the end, or as soon as an object is not a call or something other than a separator follows one.
    """

    name = "llama3_json"

    def parse(self, text: str) -> ParsedOutput:
        calls: list[ToolCall] = []
        pos, ok = _llama_read(text, _llama_start(text), calls)
        if ok and calls and _skip_separator(text, pos) == len(text):
            return ParsedOutput(None, calls)
        return ParsedOutput(_content(text), [])

    def stream(self) -> ToolCallStream:
        return _Llama3Stream()


class _Llama3Stream(ToolCallStream):
    def __init__(self) -> None:
        self._trim = Stripper()
        self._held = ""  # everything so far, until it is known to be content
        self._pos: int | None = None  # where reading resumes in _held; None while the start is undecided
        self._calls: list[ToolCall] = []
        self._text = False  # known to be content: sent as it comes

    def _to_text(self) -> str:
        self._text, held, self._held = True, self._held, ""
        return self._trim.push(held)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._text:
            return self._trim.push(delta), []
        self._held += delta
        if self._pos is None:
            start = _llama_start(self._held)
            if _PYTHON_TAG.startswith(self._held[start:]):  # nothing yet, or maybe the tag
                return "", []
            self._pos = start
        elif "}" not in delta and self._held.find("{", self._pos) >= 0:  # an object in progress cannot have ended
            return "", []
        self._pos, ok = _llama_read(self._held, self._pos, self._calls)
        return ("", []) if ok else (self._to_text(), [])

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self._text:
            return "", []
        if self._pos is not None:
            self._pos, ok = _llama_read(self._held, self._pos, self._calls)
            if ok and self._calls and _skip_separator(self._held, self._pos) == len(self._held):
                self._text = True
                return "", self._calls
        return self._to_text(), []


_TOOL_CALLS = "[TOOL_CALLS]"
# `name`, optionally `[CALL_ID]id`, optionally `[ARGS]` (dropped when special tokens are skipped), then `{`.
_MISTRAL_NAME = re.compile(r"([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?(?:\[ARGS\]\s*)?(?=\{)")


def _mistral_calls(section: str) -> list[ToolCall] | None:
    """The calls of a text starting with [TOOL_CALLS], or None unless all of it is calls."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        pos = _skip_ws(section, pos)
        if section.startswith(_TOOL_CALLS, pos):
            pos = _skip_ws(section, pos + len(_TOOL_CALLS))
        if pos == len(section):
            return None
        name = None if section[pos] in "[{" else _MISTRAL_NAME.match(section, pos)
        obj, pos = _decode(section, name.end() if name else pos)
        if pos < 0:
            return None
        items = [{"name": name[1], "arguments": obj}] if name else obj if isinstance(obj, list) else [obj]
        for item in items:
            call = _call(item, _ARG_KEYS)
            if call is None:
                return None
            calls.append(call)
        if not calls:
            return None
        if _skip_ws(section, pos) == len(section):
            return calls


class MistralToolParser(ToolParser):
    """Mistral: content, then `[TOOL_CALLS]` and either a JSON array of `{"name", "arguments"}` objects (pre-v11
    tokenizers) or `name[ARGS]{...}` calls, each optionally after its own `[TOOL_CALLS]` (v11+; `[ARGS]` may be
    missing when special tokens were skipped, and an optional `[CALL_ID]id` is ignored).

    Everything from the first `[TOOL_CALLS]` on is all calls or nothing: if any of it fails to parse, the
    whole output is content verbatim (marker included) and there are no calls. A stream holds everything
    from the marker on until the end.
    """

    name = "mistral"
    needs_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        i = text.find(_TOOL_CALLS)
        calls = None if i < 0 else _mistral_calls(text[i:])
        if calls is None:
            return ParsedOutput(_content(text), [])
        return ParsedOutput(_content(text[:i]), calls)

    def stream(self) -> ToolCallStream:
        return _MistralStream()


class _MistralStream(ToolCallStream):
    def __init__(self) -> None:
        self._trim = Stripper()
        self._held = ""  # before the marker: a tail that may be its start
        self._section: str | None = None  # from the marker on, once seen

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._section is not None:
            self._section += delta
            return "", []
        before, self._held, found = split_marker(self._held + delta, _TOOL_CALLS)
        if found:
            self._section, self._held = _TOOL_CALLS + self._held, ""
        return self._trim.push(before), []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._held = self._held, ""
        if self._section is not None:
            rest, self._section = self._section, None
            calls = _mistral_calls(rest)
            if calls is not None:
                return "", calls
        return self._trim.push(rest), []


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by its vLLM name; ValueError naming the known ones for any other."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None
