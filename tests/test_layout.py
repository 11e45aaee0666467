"""The package's shape: no import cycles (imports inside functions included), the engine apart from the demo
builder and the CLI, one home for the version."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Source directory of each package (pyproject's package-dir).
PACKAGES = {
    "mlx_glimmer": ROOT / "mlx_glimmer",
    "mlx_glimmer.convert": ROOT / "convert",
    "mlx_glimmer.tui": ROOT / "tui",
}
# Modules of the engine: what `mlx_glimmer.load` / `generate` run on, on either backend.
ENGINE = (
    "mlx_glimmer",
    "mlx_glimmer.generate",
    "mlx_glimmer.loading",
    "mlx_glimmer.speculative",
    "mlx_glimmer.target",
    "mlx_glimmer.settings",
    "mlx_glimmer.block_policy",
    "mlx_glimmer.drafters",
    "mlx_glimmer.torch_backend.loading",
)


def modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for package, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            parts = list(f.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join([package, *(parts[:-1] if is_package else parts)])] = (f, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the modules its import statements (anywhere in it) run: the module named, and the packages on
    its path that are not the importer's own ancestors; `from P import name` counts P only for a non-module name."""
    mods = modules()
    graph = {}
    for mod, (path, is_package) in mods.items():
        parts = mod.split(".")
        ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + is_package)}
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = parts if is_package else parts[:-1]
                if node.level:
                    base = base[: len(base) - (node.level - 1)]
                    name = ".".join(base + ([node.module] if node.module else []))
                else:
                    name = node.module
                subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in mods]
                targets = subs + ([name] if len(subs) < len(node.names) else [])
            else:
                continue
            for t in targets:
                tp = t.split(".")
                for i in range(1, len(tp) + 1):
                    p = ".".join(tp[:i])
                    if p in mods and p != mod and (p not in ancestors or p == t):
                        deps.add(p)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def reachable(graph, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_no_import_cycles_counting_imports_inside_functions():
    graph = import_graph()
    assert len(graph) > 60 and "mlx_glimmer.drafters.base" in graph and "mlx_glimmer.server.app" in graph
    assert cycles(graph) == []


def test_the_engine_never_imports_the_demo_builder_or_the_cli():
    graph = import_graph()
    for module in ENGINE:
        reach = reachable(graph, module)
        assert not reach & {"mlx_glimmer.demo", "mlx_glimmer.cli", "mlx_glimmer.convert"}, module


def test_nothing_imports_the_package_root():
    """Inside the package, names come from the module that defines them (the root only re-exports)."""
    graph = import_graph()
    assert [m for m, deps in graph.items() if "mlx_glimmer" in deps] == []


def test_the_version_has_one_home():
    """pyproject reads it from _version.py, which imports nothing; the installed metadata agrees."""
    from importlib.metadata import version

    import mlx_glimmer
    from mlx_glimmer import _version

    assert ast.parse((ROOT / "mlx_glimmer" / "_version.py").read_text()).body[-1].targets[0].id == "__version__"
    assert "mlx_glimmer._version.__version__" in (ROOT / "pyproject.toml").read_text()
    assert mlx_glimmer.__version__ == _version.__version__ == version("mlx-glimmer")
