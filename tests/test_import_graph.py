"""The package's import graph has no cycle, counting imports inside functions (read with ast, so
nothing is executed): layers go kernels <- ffi <- ops <- models <- train <- entry points, and a lazy
import that closes a loop is a cycle all the same."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = {"surogate_jax": ROOT / "surogate_jax", "surogate_jax.models": ROOT / "models"}
EXTENSIONS = {"surogate_jax._ffi"}  # compiled: a leaf


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for pkg, base in PACKAGES.items():
        for f in sorted(base.rglob("*.py")):
            parts = [p for p in f.relative_to(base).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = (f, f.name == "__init__.py")
    return out


def imported(name: str, is_pkg: bool, node: ast.AST, known: set[str]) -> set[str]:
    """The package modules an import statement loads (`from . import x` loads x, not the package)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    if node.level:
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    subs = {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known}
    deps = subs if len(subs) == len(node.names) else subs | {target}
    return {d for d in deps if d in known}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods) | EXTENSIONS
    g = {m: set() for m in known}
    for name, (f, is_pkg) in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                g[name] |= imported(name, is_pkg, node, known) - {name}
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return out


def test_the_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_imports_are_edges():
    tree = ast.parse("def f():\n    from .b import x\n")
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
    assert imported("p.a", False, node, {"p.a", "p.b"}) == {"p.b"}


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n   " + "; ".join(f"{m} -> {sorted(graph()[m] & set(c))}" for m in c) for c in found)


def test_no_cycles_between_subpackages():
    """ops, precision, optim, data, models, ... taken whole (module-level files stay themselves)."""
    pkgs = {m for m, (_, is_pkg) in modules().items() if is_pkg and m != "surogate_jax"}

    def unit(m: str) -> str:
        return next((p for p in pkgs if m == p or m.startswith(p + ".")), m)

    g: dict[str, set[str]] = {}
    for m, deps in graph().items():
        if unit(m) == "surogate_jax":
            continue  # the package's own __init__ re-exports the public API from everywhere
        g.setdefault(unit(m), set()).update(unit(d) for d in deps if unit(d) not in (unit(m), "surogate_jax"))
    for deps in list(g.values()):
        for d in deps:
            g.setdefault(d, set())
    assert not cycles(g), cycles(g)
