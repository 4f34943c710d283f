"""The request fields that constrain an output, as OpenAI and vLLM spell them, turned into one
StructuredOutputs for the engine: `response_format` (json_object, json_schema, vLLM's
structural_tag), vLLM's `structured_outputs` object and its older `guided_*` fields.

A request may give at most one constraint; a field or option the server cannot honour is refused
with a 400 naming it, never dropped. The grammar itself is compiled (and its errors found) by the
engine's input processor.
"""

from __future__ import annotations

import json
from typing import Any

from cpuserve.engine import InvalidRequest, StructuredOutputs
from cpuserve.schema_walk import map_schemas

# `structured_outputs` keys that each are a constraint, and the options that are honoured as-is:
# JSON is always written without free whitespace, and there is no other backend to fall back to.
CONSTRAINT_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
HONOURED_OPTIONS = {"disable_any_whitespace", "disable_fallback", "backend", "disable_additional_properties"}
BACKENDS = (None, "auto", "guidance", "llguidance")
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def request_constraint(fields: dict[str, Any]) -> StructuredOutputs | None:
    """The one constraint a request's fields ask for (None: none). `fields` holds the request's
    values by name, unknown extras included."""
    found: list[StructuredOutputs] = []
    rf = fields.get("response_format")
    if rf is not None:
        spec = _response_format(rf)
        if spec is not None:
            found.append(spec)
    so = fields.get("structured_outputs")
    if so is not None:
        found.append(_structured_outputs(so))
    for name, kind in GUIDED_FIELDS.items():
        if fields.get(name) is not None:
            found.append(_constraint(kind, fields[name], name))
    backend = fields.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise InvalidRequest("guided_decoding_backend", f"only the guidance backend is available, not {backend!r}")
    if fields.get("guided_whitespace_pattern") is not None:
        raise InvalidRequest("guided_whitespace_pattern", "is not supported: JSON is written without free whitespace")
    if len(found) > 1:
        raise InvalidRequest(
            found[1].param, f"only one output constraint per request; {found[0].param} already gives one"
        )
    return found[0] if found else None


def _response_format(rf: Any) -> StructuredOutputs | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise InvalidRequest("response_format", "must be an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _constraint("json", {"type": "object"}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise InvalidRequest("response_format", "json_schema needs a 'json_schema' object")
        schema = js.get("schema", {"type": "object"})
        if js.get("strict") is True:  # OpenAI's strict mode: an object has only the properties it lists
            schema = close_objects(schema)
        return _constraint("json", schema, "response_format")
    if kind == "structural_tag":
        return _constraint("structural_tag", {k: v for k, v in rf.items() if k != "type"}, "response_format")
    known = "text, json_object, json_schema, structural_tag"
    raise InvalidRequest("response_format", f"type {kind!r} is not one of {known}")


def _structured_outputs(so: Any) -> StructuredOutputs:
    if not isinstance(so, dict):
        raise InvalidRequest("structured_outputs", "must be an object")
    given = [k for k in CONSTRAINT_KEYS if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - set(CONSTRAINT_KEYS) - HONOURED_OPTIONS)
    if unknown:
        raise InvalidRequest("structured_outputs", f"{unknown[0]!r} is not supported")
    if so.get("backend") not in BACKENDS:
        raise InvalidRequest("structured_outputs", f"only the guidance backend is available, not {so['backend']!r}")
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs", f"give exactly one of {', '.join(CONSTRAINT_KEYS)} (got {len(given)})"
        )
    key = given[0]
    if key == "json_object":
        return _constraint("json", {"type": "object"}, "structured_outputs")
    spec = _constraint(key, so[key], "structured_outputs")
    if key == "json" and so.get("disable_additional_properties"):
        spec = _constraint("json", close_objects(json.loads(str(spec.value))), "structured_outputs")
    return spec


def close_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object schema that lists properties
    and says nothing about others (what OpenAI's strict mode means, and vLLM's
    disable_additional_properties). Not on the members of an `allOf` (each would forbid the others'
    properties: a zod intersection could match nothing), nor where `unevaluatedProperties` decides."""
    closed: set[int] = set()  # the object schemas this walk closed (map_schemas: innermost first)

    def fix(s: dict[str, Any]) -> dict[str, Any]:
        if "properties" in s and "additionalProperties" not in s and "unevaluatedProperties" not in s:
            s["additionalProperties"] = False
            closed.add(id(s))
        for member in s.get("allOf") if isinstance(s.get("allOf"), list) else ():
            if isinstance(member, dict) and id(member) in closed:
                del member["additionalProperties"]
        return s

    return map_schemas(schema, fix)


def _constraint(kind: str, value: Any, param: str) -> StructuredOutputs:
    """One constraint, its value checked for shape (the grammar engine checks the rest)."""
    if kind in ("json", "structural_tag"):
        what = "the JSON schema" if kind == "json" else "the structural tag"
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(param, f"{what} is not valid JSON: {exc}") from None
        if not isinstance(value, dict | bool) or (kind == "structural_tag" and isinstance(value, bool)):
            raise InvalidRequest(param, f"{what} must be an object")
        return StructuredOutputs(kind, StructuredOutputs.canonical_json(value), param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(param, "choice must be a non-empty list of strings")
        return StructuredOutputs("choice", tuple(value), param=param)
    if not isinstance(value, str) or not value:
        raise InvalidRequest(param, f"the {kind} must be a non-empty string")
    return StructuredOutputs(kind, value, param=param)
