"""The package keeps the layering docs/architecture.md draws: a package imports only the ones
below it (function-level imports included), nothing imports in a circle at module level,
and no package imports another's private names. Read from the source (ast), nothing run."""

from __future__ import annotations

import ast
from pathlib import Path

from harness import REPO_ROOT

PACKAGE = REPO_ROOT / "python" / "tpcore"
# Lowest first. Modules directly under tpcore/ (parallel_state, comm, agreement, ...) are the
# base. Packages on one line may not import each other.
LAYERS = [
    {"tensor_parallel"},
    {"moe", "context_parallel"},
    {"models", "data"},
    {"pipeline_parallel", "distributed"},
    {"optimizer", "checkpoint"},
    {"hf"},
    {"train"},
]
RANK = {name: i + 1 for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, *, module_level: bool):
    """(imported module, imported names, line) of every `from ... import` of tpcore."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if module_level else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in nodes:
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target == "tpcore" or target.startswith("tpcore."):
            yield target, [a.name for a in node.names], node.lineno


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


def test_no_package_imports_upward_or_sideways():
    bad = []
    for name, path in _modules().items():
        mine = _package(name)
        if name == "tpcore":  # the top-level API re-exports from everywhere
            continue
        for target, _, line in _imports(name, path, module_level=False):
            theirs = _package(target)
            if theirs is None or theirs == mine:
                continue
            if mine is None or RANK[theirs] >= RANK[mine]:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {mine or 'base'} -> {theirs}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_names_imported_across_packages():
    allowed = {"_C", "_op_entry", "_fake_ops"}  # the extension and its entry points
    bad = []
    for name, path in _modules().items():
        for target, names, line in _imports(name, path, module_level=False):
            if _package(target) == _package(name) or target.rsplit(".", 1)[-1].startswith("_"):
                continue  # within a package, or from a module private to tpcore as a whole
            private = [n for n in names if n.startswith("_") and n not in allowed]
            if private:
                bad.append(f"{path.relative_to(REPO_ROOT)}:{line}: {target}.{private}")
    assert not bad, "private names imported across packages:\n" + "\n".join(bad)


def test_no_import_circles_at_module_level():
    modules = _modules()
    graph = {
        name: {
            dep
            for target, names, _ in _imports(name, path, module_level=True)
            for dep in [f"{target}.{n}" if f"{target}.{n}" in modules else target for n in names]
            if dep in modules and dep != name
        }
        for name, path in modules.items()
    }
    # A package's __init__ importing its own modules is not a circle through them.
    for name in graph:
        graph[name] = {d for d in graph[name] if not name.startswith(d + ".")}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"
