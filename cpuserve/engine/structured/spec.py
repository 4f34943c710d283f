"""What a request constrains its output to: one JSON schema, regex, choice list, grammar or set of
structural tags. A plain frozen record (hashable: it is the compiled-grammar cache's key), made by
the server from `response_format`, `structured_outputs` or `guided_*`, compiled by the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint. `json` is a schema as canonical JSON text (`{"type": "object"}` for any JSON
    object); `choice` the allowed strings; `grammar` EBNF/GBNF or Lark text; `structural_tag`
    vLLM's structural-tag object as canonical JSON text. `after`: the constraint starts only once
    the output's text contains this marker (a reasoning end marker, however the model spelled it
    in tokens) and holds from the next token on.
    `param` names the request field it came from, for errors (not part of the cache key)."""

    kind: str
    value: str | tuple[str, ...]
    after: str = ""
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r} (known: {', '.join(KINDS)})")

    @staticmethod
    def canonical_json(value: Any) -> str:
        """Compact JSON text, so equal schemas share one compiled grammar. Key order is kept: a
        schema's property order is the order the output writes them in."""
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
