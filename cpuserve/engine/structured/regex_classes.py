"""A regex constraint's (and a JSON schema's `pattern`s') shorthand classes (\\d, \\w, \\s) read as
ASCII, as vLLM's default backend (xgrammar) and most clients' expectations read them.

llguidance takes them as Unicode classes: `\\d{3}` then admits any of Unicode's digits, and a small
model asked for a phone number wrote mathematical digits (U+1FBF8) that no client would accept.
The rewrite is textual and keeps everything else as written: `\\d` becomes `[0-9]` (`0-9` inside a
bracket class), `\\w` `[0-9A-Za-z_]`, `\\s` `[ \\t\\n\\r\\f\\v]`, and the negated forms outside a class
their complements. A negated shorthand inside a class (`[\\Da]`) has no ASCII spelling there and is
left to llguidance.
"""

from __future__ import annotations

from typing import Any

from cpuserve.schema_walk import map_schemas

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(pattern: str) -> str:
    """`pattern` with its \\d, \\w, \\s (and \\D, \\W, \\S outside brackets) as ASCII classes."""
    out: list[str] = []
    in_class, class_start, i = False, 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e in _ASCII:
                out.append(_ASCII[e] if in_class else f"[{_ASCII[e]}]")
                if in_class and pattern.startswith("-", i + 2) and not pattern.startswith("-]", i + 2):
                    out.append("\\-")  # `[\w-.]`: a literal dash, not a range from the class's last character
                    i += 1
            elif e.lower() in _ASCII and not in_class:
                out.append(f"[^{_ASCII[e.lower()]}]")
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class, class_start = True, len(out) + 1
            if pattern.startswith("^", i + 1):  # a negated class: its first ']' is still a literal
                out.append("[^")
                i, class_start = i + 2, len(out)
                continue
        elif c == "]" and in_class and len(out) > class_start:  # not the class's first character
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def ascii_schema_patterns(schema: object) -> object:
    """A JSON schema with every `pattern` (and `patternProperties` key) read as ascii_classes reads a
    regex constraint, as xgrammar reads them; instances (`const`, `default`, ...) left as written."""
    return map_schemas(schema, _ascii_patterns)


def _ascii_patterns(schema: dict[str, Any]) -> dict[str, Any]:
    if isinstance(schema.get("pattern"), str):
        schema["pattern"] = ascii_classes(schema["pattern"])
    if isinstance(schema.get("patternProperties"), dict):
        schema["patternProperties"] = {ascii_classes(k): v for k, v in schema["patternProperties"].items()}
    return schema
