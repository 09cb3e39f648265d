"""Prints the import cycles among modules (static, from the source; nothing imported).

Usage: ``python scripts/import_cycles.py [DIR ...] [--typing] [--forbid FROM=TO ...] [--fail]``
(default: ``osworld_jax benchmarks``).

Each DIR is a package (``osworld_jax``, ``osworld_jax/env``) or a folder of scripts that import
each other by bare name (``benchmarks``: ``from train_step import CONFIGS``, the script's folder
being ``sys.path[0]``). A module's name is its path from the first folder above it without an
``__init__.py``: ``osworld_jax/env/local/backend.py`` -> ``osworld_jax.env.local.backend``,
``benchmarks/train_step.py`` -> ``train_step``. All DIRs form one graph.

An edge A -> B is an ``import B`` / ``from B import x`` / ``from pkg import B`` in A's source that
names a scanned module. Imports under ``if TYPE_CHECKING:`` are ignored (they never run) unless
``--typing`` counts them (as deferred edges: a reader still goes round such a circle). Imports
inside a function or class body are "deferred": they are often written to break a circle at
import time, so the table shows the cycles twice, once over module-level edges only and once
over all edges. In a module that calls ``importlib.import_module``, a string constant that is
exactly a scanned module name counts as a deferred edge too (a lazy import table). A package's
``__init__`` is a node like any other module; the implicit "importing a.b first runs
a/__init__" is not an edge. A cycle is a strongly connected component of more than one module
(its size is how many modules go round it).

``--forbid FROM=TO`` lists every edge (deferred and, with ``--typing``, type-only ones included)
from a module named FROM or under it to one named TO or under it: a rule that imports between
two rooms run one way (``--forbid osworld_jax.rollout=osworld_jax.server``).

``--fail`` exits 1 when any cycle exists (over all edges) or a forbidden edge is found.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def module_name(path: Path, root: Path | None = None) -> str:
    """``osworld_jax/env/local/backend.py`` -> ``osworld_jax.env.local.backend``.

    The name is taken from the first folder above ``path`` that has no ``__init__.py`` (the
    ``sys.path`` entry it is imported from); ``root`` is accepted for older callers and unused.
    """
    top = path.parent
    while (top / "__init__.py").exists():
        top = top.parent
    parts = list(path.relative_to(top).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(
    tree: ast.Module, here: str, is_pkg: bool, typing: bool = False
) -> Iterator[tuple[str, bool]]:
    """Yields (imported dotted name, deferred) for every import that can run.

    With ``typing``, the imports under ``if TYPE_CHECKING:`` too, as deferred ones.
    """

    def walk(node: ast.AST, deferred: bool) -> Iterator[tuple[str, bool]]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            if typing:
                for child in node.body:
                    yield from walk(child, True)
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


def graph(*dirs: Path, typing: bool = False) -> dict[str, dict[str, bool]]:
    """module -> {imported module: deferred (True only if every such import is deferred)}.

    Over the modules of every folder in ``dirs`` (packages or script folders, see the module
    docstring); ``typing`` counts ``TYPE_CHECKING`` imports as deferred edges.
    """
    files = sorted({f.resolve() for d in dirs for f in Path(d).rglob("*.py")})
    names = {module_name(f): f for f in files}
    if len(names) != len(files):
        seen: dict[str, Path] = {}
        for f in files:
            if (other := seen.setdefault(module_name(f), f)) != f:
                raise SystemExit(f"import_cycles: {other} and {f} are both {module_name(f)}")
    edges: dict[str, dict[str, bool]] = {m: {} for m in names}
    for mod, f in names.items():
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        found = list(_imports(tree, mod, f.name == "__init__.py", typing))
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


def _under(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def forbidden(edges: dict[str, dict[str, bool]], src: str, dst: str) -> list[tuple[str, str]]:
    """Every edge from ``src`` or a module under it to ``dst`` or a module under it."""
    return sorted((a, b) for a, ts in edges.items() if _under(a, src) for b in ts if _under(b, dst))


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
    parser.add_argument("dirs", nargs="*", default=["osworld_jax", "benchmarks"])
    parser.add_argument("--typing", action="store_true", help="count TYPE_CHECKING imports")
    parser.add_argument(
        "--forbid", action="append", default=[], metavar="FROM=TO", help="a forbidden edge"
    )
    parser.add_argument("--fail", action="store_true", help="exit 1 if any cycle exists")
    args = parser.parse_args(argv)
    rules = []
    for rule in args.forbid:
        src, sep, dst = rule.partition("=")
        if not (sep and src and dst):
            parser.error(f"--forbid {rule!r}: expected FROM=TO (module names)")
        rules.append((src, dst))
    dirs = [Path(d).resolve() for d in args.dirs]
    for d in dirs:
        if not d.is_dir():
            parser.error(f"{d}: not a folder")
    edges = graph(*dirs, typing=args.typing)
    n_deferred = sum(d for ts in edges.values() for d in ts.values())
    print(
        f"{', '.join(d.name for d in dirs)}: {len(edges)} modules, "
        f"{sum(map(len, edges.values()))} import edges "
        f"({n_deferred} deferred: inside a function or class"
        f"{' or under TYPE_CHECKING' if args.typing else ''})"
    )
    found = []
    for label, with_deferred in (("module-level imports", False), ("all imports", True)):
        comps = cycles(edges, deferred=with_deferred)
        found = comps
        print(f"cycles over {label}: {len(comps)}")
        for comp in comps:
            print(f"  {len(comp)} modules: {', '.join(comp)}")
    bad = []
    for src, dst in rules:
        hits = forbidden(edges, src, dst)
        bad += hits
        print(f"imports from {src} into {dst}: {len(hits)}")
        for a, b in hits:
            print(f"  {a} -> {b}")
    return 1 if args.fail and (found or bad) else 0


if __name__ == "__main__":
    sys.exit(main())
