"""Tools on chat completions: what a request's `tools` and `tool_choice` ask of the engine, and how
the generated text becomes `tool_calls`.

- `none`: tools go to the chat template, the output is plain content.
- a named function: the output is held by a grammar to that function's parameter schema, and is
  the call's arguments; streamed, the call's id and name come first, then argument fragments.
- `required`: the output is held to a JSON array of `{"name", "parameters"}` objects, one of the
  tools each (at most one when `parallel_tool_calls` is false); the calls come out whole.
- `auto` (the default when tools are given): the model writes calls its own way and the server's
  `--tool-call-parser` reads them; refused unless the server runs with `--enable-auto-tool-choice`,
  as vLLM refuses it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from cpuserve.engine import InvalidRequest, StructuredOutputs
from cpuserve.server.structured import close_objects
from cpuserve.server.tool_parsers import ParsedOutput, ToolCall, ToolCallStream, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How one chat request's tools shape it."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]] | None = None  # what the chat template receives
    constraint: StructuredOutputs | None = None
    function: str | None = None  # the named function
    parallel: bool = True
    parser: ToolParser | None = None  # auto: the server's tool-call parser

    @property
    def reads_calls(self) -> bool:
        return self.mode in ("named", "required") or (self.mode == "auto" and self.parser is not None)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser: ToolParser | None,
    auto_enabled: bool,
) -> ToolPlan:
    """Check `tools` and `tool_choice` (400 naming the problem) and say what they ask for."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice", "is only allowed when tools are given")
        return ToolPlan("none")
    functions = _functions(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto"
    if tool_choice == "none":
        return ToolPlan("none", tools=tools)
    if tool_choice == "auto":
        strict = next((t["function"]["name"] for t in tools if t["function"].get("strict") is True), None)
        if strict is not None:
            raise InvalidRequest(
                "tools",
                f'function {strict!r} is strict, which tool_choice "auto" cannot honour (the model writes calls '
                'freely); use tool_choice "required" or a named function, which hold the arguments to the schema',
            )
        if not auto_enabled or parser is None:
            raise InvalidRequest(
                "tool_choice",
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and --tool-call-parser',
            )
        return ToolPlan("auto", tools=tools, parallel=parallel, parser=parser)
    # The calls held to each function's schema, its objects closed where they say nothing of other
    # properties: arguments with only the parameters the function declares (vLLM's default xgrammar
    # backend reads every schema so; JSON Schema alone would let the model add keys of its own).
    if tool_choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": close_objects(schema)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            array["maxItems"] = 1
        spec = StructuredOutputs("json", StructuredOutputs.canonical_json(array), param="tool_choice")
        return ToolPlan("required", tools=tools, constraint=spec, parallel=parallel)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in functions:
            raise InvalidRequest("tool_choice", f"names function {name!r}, which is not among the tools")
        schema = close_objects(functions[name])
        spec = StructuredOutputs("json", StructuredOutputs.canonical_json(schema), param="tool_choice")
        return ToolPlan("named", tools=tools, constraint=spec, function=name, parallel=parallel)
    raise InvalidRequest("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": {...}}')


def _functions(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """Function name -> its parameters schema; 400 for a malformed or repeated tool."""
    functions: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest("tools", f"tool {i} must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tools", f"tool {i} has no function name")
        if name in functions:
            raise InvalidRequest("tools", f"function {name!r} is given twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest("tools", f"the parameters of function {name!r} must be a JSON schema object")
        functions[name] = params
    return functions


def read_calls(plan: ToolPlan, text: str) -> ParsedOutput:
    """The content and the calls in a whole generated text (what a non-streamed choice returns)."""
    if plan.mode == "named":
        return _named(plan, text)
    if plan.mode == "required":
        return _required(text)
    if plan.mode == "auto" and plan.parser is not None:
        parsed = plan.parser.parse(text)
        return parsed if plan.parallel else ParsedOutput(parsed.content, parsed.tool_calls[:1])
    return ParsedOutput(text, [])


def _named(plan: ToolPlan, text: str) -> ParsedOutput:
    """The grammar made the text the function's arguments: the call, whole or cut short by
    max_tokens (finish_reason "length" says which), as the stream sends it and as vLLM returns it."""
    return ParsedOutput(None, [ToolCall(str(plan.function), text)])


def _required(text: str) -> ParsedOutput:
    """The grammar made the text a list of {name, parameters}; anything else is no call."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return ParsedOutput(text, [])
    well_formed = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(c.get("parameters"), dict) for c in calls
    )
    if not well_formed or not calls:
        return ParsedOutput(text, [])
    return ParsedOutput(None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls])


def call_json(call: ToolCall, index: int, cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "index": index, "function": {"name": call.name, "arguments": call.arguments}}


@dataclass
class ToolDeltaStream:
    """One streamed choice's content and tool-call deltas, the way OpenAI's stream sends them:
    each call's index, id, type and name first, then its arguments (in fragments as they are
    generated for a named function; whole otherwise)."""

    plan: ToolPlan
    calls: int = 0
    _text: list[str] = field(default_factory=list)
    _parser: ToolCallStream | None = None
    _id: str = field(default_factory=call_id)

    def __post_init__(self) -> None:
        if self.plan.mode == "auto" and self.plan.parser is not None:
            self._parser = self.plan.parser.stream()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        """Deltas (message fragments) for this much more generated text."""
        if not delta:
            return []
        if self.plan.mode == "named":
            out = []
            if self.calls == 0:
                head = {"index": 0, "id": self._id, "type": "function", "function": {"name": self.plan.function}}
                head["function"]["arguments"] = ""
                out.append({"tool_calls": [head]})
                self.calls = 1
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if self.plan.mode == "required":
            self._text.append(delta)
            return []
        if self._parser is not None:
            return self._shape(*self._parser.feed(delta))
        return [{"content": delta}]

    def finish(self) -> list[dict[str, Any]]:
        """What was held back, once generation ended."""
        if self.plan.mode == "required":
            parsed = _required("".join(self._text))
            return self._shape(parsed.content or "", parsed.tool_calls)
        if self._parser is not None:
            return self._shape(*self._parser.finish())
        return []

    def _shape(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            if not self.plan.parallel and self.calls >= 1:
                break
            head = {"index": self.calls, "id": call_id(), "type": "function", "function": {"name": call.name}}
            head["function"]["arguments"] = ""
            out.append({"tool_calls": [head]})
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": call.arguments}}]})
            self.calls += 1
        return out
