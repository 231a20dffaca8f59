"""The package's import graph, read from the source with ``ast``: its floors, its circles, its stages.

    python tools/import_graph.py            # floors and circles of lossmask, module by module
    python tools/import_graph.py --stages   # the same, with modules grouped by stage (subpackage)

Every import counts, those inside functions too: a lazy import is still a dependency, it only runs
later. Imports under ``if TYPE_CHECKING:`` do not count (they never run). ``kernels/`` ships as
``lossmask.engine.kernels`` (setup.py) and is read as that.

A module's floor is 0 when it imports nothing of the package, else one more than the highest floor
it imports; the modules of a circle share one floor. ``tests/test_layout.py`` holds the package to
its stages with the same graph.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# package name -> folder, as setup.py maps them
SOURCES = {"lossmask": ROOT / "src" / "lossmask", "lossmask.engine.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    found: dict[str, Path] = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            found.setdefault(name, path)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names this module imports (absolute), skipping ``if TYPE_CHECKING:`` blocks."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from a import b`: the module a.b where b is a module (`from . import batches`), else a itself;
            # `graph` trims each name to its longest prefix that is a module
            found.update(f"{stem}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (itself left out)."""
    mods = modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = set()
        for target in _imports(tree, name, path.name == "__init__.py"):
            # the longest prefix that is a module of the package: `lossmask.engine.labels.make_labels` -> its module
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return sorted(found)


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor; the modules of one circle are one node."""
    node = {m: m for m in edges}
    for circle in circles(edges):
        for m in circle:
            node[m] = circle[0]
    merged: dict[str, set[str]] = {}
    for m, targets in edges.items():
        merged.setdefault(node[m], set()).update(node[t] for t in targets if node[t] != node[m])
    memo: dict[str, int] = {}

    def floor(n: str) -> int:
        if n not in memo:
            memo[n] = 1 + max((floor(t) for t in merged[n]), default=-1)
        return memo[n]

    return {m: floor(node[m]) for m in edges}


def stage_of(module: str) -> str:
    """``lossmask.engine.labels`` -> ``engine``; a top-level module is its own stage."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lossmask"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", action="store_true", help="group modules by stage")
    args = parser.parse_args(argv)
    edges = graph()
    level = floors(edges)
    found = circles(edges)
    top = max(level.values(), default=-1)
    print(f"{len(edges)} modules on {top + 1} import floors, {len(found)} circle(s)")
    for circle in found:
        print("  circle: " + " <-> ".join(m.removeprefix("lossmask.") for m in circle))
    for f in range(top, -1, -1):
        names = sorted(m for m in edges if level[m] == f)
        if args.stages:
            by_stage: dict[str, list[str]] = {}
            for m in names:
                by_stage.setdefault(stage_of(m), []).append(m.split(".")[-1] if "." in m else m)
            shown = "; ".join(f"{s}: {', '.join(ms)}" for s, ms in sorted(by_stage.items()))
        else:
            shown = ", ".join(m.removeprefix("lossmask.") for m in names)
        print(f"  floor {f:2d}: {shown}")
    if args.stages:
        print("stages and the stages they import:")
        reach: dict[str, set[str]] = {}
        for m, targets in edges.items():
            reach.setdefault(stage_of(m), set()).update(stage_of(t) for t in targets if stage_of(t) != stage_of(m))
        for stage in sorted(reach, key=lambda s: (-len(reach[s]), s)):
            print(f"  {stage}: {', '.join(sorted(reach[stage])) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
