"""The package's import graph, read from the source: no cycles, and the layers stay apart.

An edge ``a -> b`` means module ``a`` imports module ``b``, anywhere in its file: at the
top, inside a function (a lazy import), or under ``if TYPE_CHECKING`` (a type-only import
still ties the two modules together, so it counts). Imports by name count too: a string
constant that is the dotted name of a package module (``importlib.import_module``, the CLI's
subcommand table, a ``python -m`` target) and a package's lazy ``_WHERE`` attribute map
(its ``__getattr__`` imports the submodule). What does not count is Python importing a
package's ``__init__`` before any of its submodules: that edge is implied by every
submodule and would make every package that imports its own submodules a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "dynpipe"


def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _lazy_map(tree: ast.Module) -> dict[str, str]:
    """A package's ``_WHERE = {"name": "submodule", ...}``, if it has one."""
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_WHERE" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            return {
                k.value: v.value
                for k, v in zip(node.value.keys, node.value.values, strict=True)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)
            }
    return {}


def _graph() -> dict[str, set[str]]:
    modules = _module_names()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    lazy = {name: _lazy_map(tree) for name, tree in trees.items()}

    def targets(base: str, names: list[str]) -> set[str]:
        out = set()
        for name in names:
            if f"{base}.{name}" in modules:
                out.add(f"{base}.{name}")
                continue
            out.add(base)
            if name in lazy.get(base, {}):
                out.add(f"{base}.{lazy[base][name]}")
        return out

    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                if base in modules:
                    edges |= targets(base, [a.name for a in node.names])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                edges |= {node.value} & modules.keys()
        edges |= {f"{name}.{sub}" for sub in lazy[name].values()}
        graph[name] = {e for e in edges if e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component that has one (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _edges_between(graph: dict[str, set[str]], src: str, dst: str) -> list[str]:
    def inside(mod: str, pkg: str) -> bool:
        return mod == pkg or mod.startswith(pkg + ".")

    return sorted(
        f"{a} -> {b}" for a, bs in graph.items() for b in bs if inside(a, src) and inside(b, dst)
    )


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def test_the_graph_sees_every_kind_of_import(graph) -> None:
    # Guards the rules below against a parser that finds nothing.
    assert "dynpipe.runtime.engine" in graph["dynpipe.runtime.train"]  # top-level
    assert "dynpipe.runtime.scenario" in graph["dynpipe.runtime.train"]  # inside a function
    assert "dynpipe.models.base" in graph["dynpipe.planner.costs"]  # TYPE_CHECKING
    assert "dynpipe.runtime.cli" in graph["dynpipe.cli"]  # by name
    assert "dynpipe.predictor.io" in graph["dynpipe.predictor"]  # lazy attribute
    assert "dynpipe.predictor.io" in graph["dynpipe.analysis.accuracy"]  # via the package


def test_no_import_cycles(graph) -> None:
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_type_only_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_and_profiler_meet_only_in_devices(graph) -> None:
    assert _edges_between(graph, "dynpipe.runtime", "dynpipe.profiler") == []
    assert _edges_between(graph, "dynpipe.profiler", "dynpipe.runtime") == []
    # Both use the device layer, which depends on neither.
    assert _edges_between(graph, "dynpipe.runtime", "dynpipe.devices")
    assert _edges_between(graph, "dynpipe.profiler", "dynpipe.devices")
    for upper in ("dynpipe.runtime", "dynpipe.profiler", "dynpipe.planner", "dynpipe.analysis"):
        assert _edges_between(graph, "dynpipe.devices", upper) == [], upper


def test_analysis_reads_logs_and_launches_nothing(graph) -> None:
    # From the runtime, the figures need the run-log records and nothing that runs training.
    runtime = _edges_between(graph, "dynpipe.analysis", "dynpipe.runtime")
    assert runtime and all(e.endswith(" -> dynpipe.runtime.records") for e in runtime), runtime
    assert _edges_between(graph, "dynpipe.analysis", "dynpipe.cli") == []
