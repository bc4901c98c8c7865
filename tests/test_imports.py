"""jaxpar's imports run one way: no module reaches itself through its imports, and the
pipeline package reads neither the training code nor the analysis.

The graph is read from the source with ``ast`` (nothing is imported): every ``import`` and
``from ... import`` anywhere in a module — at module level, under ``if TYPE_CHECKING``, and
inside functions (an import inside a function that only dodges a circle is still a circle).
``from jaxpar.x import y`` is an edge to ``jaxpar.x.y`` when that is a module, else to
``jaxpar.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "jaxpar"

KNOWN_CIRCLES: set[frozenset[str]] = set()


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The jaxpar modules ``path`` imports, wherever in the file the import stands."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "jaxpar")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "jaxpar":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    return {m for m in out if m in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(path, known) - {name} for name, path in mods.items()}


def strongly_connected(g: dict[str, set[str]]) -> list[frozenset[str]]:
    """Tarjan's components of more than one module: each is one or more import circles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(frozenset(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_inside_functions():
    g = graph()
    # jaxpar.commands.schedule imports the renderer inside run() (CLI start-up): still an edge.
    assert "jaxpar.pipeline.render" in g["jaxpar.commands.schedule"]
    assert "jaxpar.pipeline.schedules" in g["jaxpar.commands.schedule"]


def test_no_import_circles():
    found = set(strongly_connected(graph()))
    unexpected = sorted(sorted(c) for c in found - KNOWN_CIRCLES)
    assert not unexpected, f"import circles: {unexpected}"
    stale = sorted(sorted(c) for c in KNOWN_CIRCLES - found)
    assert not stale, f"listed as known but gone (remove from KNOWN_CIRCLES): {stale}"


def test_pipeline_imports_neither_training_nor_analysis():
    bad = {
        (src, dst)
        for src, dsts in graph().items()
        if src.startswith("jaxpar.pipeline")
        for dst in dsts
        if dst.startswith(("jaxpar.train", "jaxpar.analysis"))
    }
    assert not bad, sorted(bad)
