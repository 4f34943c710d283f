"""One walk over a JSON schema's subschemas, for the rewrites the server and the compiler make
(server/structured.py close_objects: strict mode's closed objects; regex_classes.ascii_schema_patterns:
`pattern`s read as ASCII). Instances (`const`, `enum`, `default`, `examples`) are values a document
may hold, not schemas, and the names of named subschemas (`properties`, `$defs`, ...) are not
keywords: neither is rewritten."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

VALUES = ("const", "enum", "default", "examples")
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_schemas(schema: Any, fix: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of `schema` with every object (sub)schema passed through `fix`, innermost first."""
    if isinstance(schema, list):
        return [map_schemas(s, fix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in VALUES:
            out[key] = value
        elif key in NAMED_SCHEMAS and isinstance(value, dict):
            out[key] = {name: map_schemas(sub, fix) for name, sub in value.items()}
        else:
            out[key] = map_schemas(value, fix)
    return fix(out)
