"""The package's layering, checked from the source: no import cycle between cpuserve's modules
(counting imports inside functions too: a lazy import hides a cycle, it does not remove it), and
no getenv in the native kernels (the variant is chosen in Python, once)."""

from __future__ import annotations

import ast
from pathlib import Path

import cpuserve

ROOT = Path(cpuserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    parts = package.split(".")
                    base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name and not name.startswith(t + "."):  # a package's own __init__ is not a cycle
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_between_cpuserve_modules():
    assert find_cycle(import_graph()) is None


def test_the_offline_tools_sit_above_the_runtime():
    graph = import_graph()
    runtime = [m for m in graph if m.startswith(("cpuserve.quant", "cpuserve.engine", "cpuserve.kernels"))]
    for m in runtime:
        assert not any(t.startswith("cpuserve.offline") for t in graph[m]), (m, graph[m])


def test_the_native_kernels_read_no_environment():
    """The variant is chosen once in Python and passed down: no getenv anywhere in the C++ sources."""
    sources = [p for p in (ROOT / "kernels" / "csrc").rglob("*") if p.suffix in (".h", ".cpp")]
    assert sources
    assert [p.name for p in sources if "getenv" in p.read_text()] == []
