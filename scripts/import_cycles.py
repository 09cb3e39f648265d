"""Prints the import cycles among a package's modules (static, from the source; nothing imported).

Usage: ``python scripts/import_cycles.py [osworld_jax/env] [--fail]``

An edge A -> B is an ``import B`` / ``from B import x`` / ``from pkg import B`` in A's source that
names a module of the scanned package. Imports under ``if TYPE_CHECKING:`` are ignored (they never
run). Imports inside a function or class body are "deferred": they are often written to break a
circle at import time, so the table shows the cycles twice, once over module-level edges only and
once over all edges. In a module that calls ``importlib.import_module``, a string constant that
is exactly a module name of the package counts as a deferred edge too (a lazy import table). A
package's ``__init__`` is a node like any other module; the implicit
"importing a.b first runs a/__init__" is not an edge. A cycle is a strongly connected component of
more than one module (its size is how many modules go round it).

``--fail`` exits 1 when any cycle exists (over all edges).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """``osworld_jax/env/local/backend.py`` -> ``osworld_jax.env.local.backend``."""
    top = root
    while (top.parent / "__init__.py").exists():
        top = top.parent
    parts = list(path.relative_to(top.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, here: str, is_pkg: bool) -> Iterator[tuple[str, bool]]:
    """Yields (imported dotted name, deferred) for every import that can run."""

    def walk(node: ast.AST, deferred: bool) -> Iterator[tuple[str, bool]]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from walk(child, deferred)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, deferred
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".") if is_pkg else here.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, *([base] if base else [])])
            for alias in node.names:
                # ``from pkg import name``: the submodule pkg.name if there is one, else pkg.
                yield f"{base}\0{alias.name}", deferred
        inner = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            yield from walk(child, deferred or inner)

    yield from walk(tree, False)


def graph(pkg_dir: Path) -> dict[str, dict[str, bool]]:
    """module -> {imported module: deferred (True only if every such import is deferred)}."""
    files = sorted(pkg_dir.rglob("*.py"))
    names = {module_name(f, pkg_dir): f for f in files}
    edges: dict[str, dict[str, bool]] = {m: {} for m in names}
    for mod, f in names.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        found = list(_imports(tree, mod, f.name == "__init__.py"))
        if "import_module" in f.read_text(encoding="utf-8"):
            # importlib.import_module("pkg.mod"): a module name spelled as a string constant.
            found += [
                (node.value, True)
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and node.value in names
            ]
        for target, deferred in found:
            if "\0" in target:
                base, name = target.split("\0")
                target = f"{base}.{name}" if f"{base}.{name}" in names else base
            if target in names and target != mod:
                edges[mod][target] = edges[mod].get(target, True) and deferred
    return edges


def cycles(edges: dict[str, dict[str, bool]], *, deferred: bool) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    adj = {m: [t for t, d in ts.items() if deferred or not d] for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in adj[v]:
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
                out.append(sorted(comp))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return sorted(out, key=lambda c: (-len(c), c))


def main(argv: list[str] | None = None) -> int:
    """Prints the cycle table; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="osworld_jax/env")
    parser.add_argument("--fail", action="store_true", help="exit 1 if any cycle exists")
    args = parser.parse_args(argv)
    pkg = Path(args.package).resolve()
    edges = graph(pkg)
    n_deferred = sum(d for ts in edges.values() for d in ts.values())
    print(
        f"{pkg.name}: {len(edges)} modules, {sum(map(len, edges.values()))} import edges "
        f"({n_deferred} deferred: inside a function or class)"
    )
    found = []
    for label, with_deferred in (("module-level imports", False), ("all imports", True)):
        comps = cycles(edges, deferred=with_deferred)
        found = comps
        print(f"cycles over {label}: {len(comps)}")
        for comp in comps:
            print(f"  {len(comp)} modules: {', '.join(comp)}")
    return 1 if args.fail and found else 0


if __name__ == "__main__":
    sys.exit(main())
