"""The package's import graph, read from the source with `ast`, has no circle.

Every import statement counts: at module level or inside a function, relative or absolute, and also those under
`if TYPE_CHECKING:` (the stricter choice: a type-only circle is still two modules that each need the other to be
understood). `from hf_specdec.a import b` is an edge to the module `hf_specdec.a.b` when that is a module, else
to `hf_specdec.a`. Importing a submodule also runs its parent packages' `__init__.py`; that implicit edge is not
counted (every module would otherwise sit in a circle with `hf_specdec/__init__.py`, which imports lazily by
name). Imports by string (`importlib.import_module`) are not edges: they are how the package's lazy entry points
and the proposer registry stay below what they name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hf_specdec

PACKAGE = Path(hf_specdec.__file__).parent


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file of the package (packages by their `__init__.py`)."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its source."""

    def known(dotted: str) -> str | None:  # the longest prefix that is one of the package's modules
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    edges = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            edges.update(known(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                edges.add(submodule if submodule in modules else known(base))
    edges.discard(None)
    edges.discard(name)
    return edges


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def test_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_graph_reads_every_kind_of_import():
    graph = import_graph()
    assert "hf_specdec.compat" in graph["hf_specdec.cache"]  # from hf_specdec import compat
    assert "hf_specdec.static_cache" in graph["hf_specdec.proposers.base"]  # under TYPE_CHECKING
    assert "hf_specdec.seq2seq" in graph["hf_specdec.plan"]  # inside a function


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, (
        f"import circles in hf_specdec: {found}. A module may import only modules below it: move what both need "
        "into the lower one, or pass it in (a protocol, an argument), or import it by name (as the proposer "
        "registry does)."
    )
