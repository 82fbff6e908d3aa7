"""npuserve's module import graph, read from the source with `ast` (nothing is imported).

Every ``import`` and ``from ... import`` counts wherever it stands (module level, inside a
function, under ``if TYPE_CHECKING:``); relative imports are resolved. An import whose target is
outside the packages read is left out. `Import.type_only` marks those under ``if TYPE_CHECKING:``,
which never run.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE_FOLDERS = ("proto", "scheduler", "executor", "gateway", "kernels", "deploy")


@dataclass(frozen=True, slots=True)
class Import:
    """``source`` imports ``target`` (both module names) at ``line`` of ``source``'s file."""

    source: str
    target: str
    line: int
    type_only: bool

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.target}" + (
            " (TYPE_CHECKING)" if self.type_only else ""
        )


@dataclass(frozen=True, slots=True)
class ImportGraph:
    """Every module read, and every import among them."""

    modules: frozenset[str]
    imports: tuple[Import, ...]

    def runtime_edges(self) -> dict[str, set[str]]:
        """module -> the modules importing it runs: its imports outside ``if TYPE_CHECKING:``,
        and the packages above each (importing ``a.b.c`` runs ``a.b``'s ``__init__`` first)."""
        edges: dict[str, set[str]] = {module: set() for module in self.modules}
        for imp in self.imports:
            if imp.type_only:
                continue
            target = imp.target
            while target:
                if target in self.modules and target != imp.source:
                    edges[imp.source].add(target)
                target = target.rpartition(".")[0]
        return edges


def installed_packages() -> dict[str, Path]:
    """{"npuserve.scheduler": the folder it is installed from, ...}, found without importing it."""
    packages = {}
    for folder in PACKAGE_FOLDERS:
        name = f"npuserve.{folder}"
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, name
        packages[name] = Path(next(iter(spec.submodule_search_locations)))
    return packages


def read_import_graph(packages: Mapping[str, Path]) -> ImportGraph:
    """The graph of every ``.py`` file under each package's folder."""
    files = dict(_module_files(packages))
    imports = [imp for module, path in files.items() for imp in _imports(module, path, set(files))]
    return ImportGraph(frozenset(files), tuple(imports))


def _module_files(packages: Mapping[str, Path]) -> Iterator[tuple[str, Path]]:
    for package, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join((package, *parts)), path


def _imports(module: str, path: Path, modules: set[str]) -> Iterator[Import]:
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node, type_only in _import_nodes(tree.body, type_only=False):
        for target in dict.fromkeys(_targets(node, module, is_package, modules)):
            if target in modules or any(m.startswith(f"{target}.") for m in modules):
                yield Import(module, target, node.lineno, type_only)


def _import_nodes(
    nodes: Iterable[ast.AST], type_only: bool
) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``nodes``, and whether an ``if TYPE_CHECKING:`` holds it."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, True)
            yield from _import_nodes(node.orelse, type_only)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node), type_only)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]
) -> list[str]:
    """The modules ``node`` imports: ``from a import b`` imports the module ``a.b`` where there
    is one, else (``b`` a name in ``a``) the module ``a``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without
    recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def cycle_through(
    edges: Mapping[str, Iterable[str]], start: str, end: str, within: Iterable[str]
) -> list[str]:
    """A shortest path ``end`` -> ... -> ``start`` inside ``within``, closed by the edge
    ``start`` -> ``end``: the cycle [start, end, ..., start]."""
    members = set(within)
    came_from: dict[str, str] = {}
    frontier = [end]
    seen = {end}
    while frontier and start not in seen:
        next_frontier = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child in members and child not in seen:
                    seen.add(child)
                    came_from[child] = node
                    next_frontier.append(child)
        frontier = next_frontier
    assert start in seen, f"{start} is not reachable from {end}"
    path = [start]
    while path[-1] != end:
        path.append(came_from[path[-1]])
    return [start, *reversed(path)]
