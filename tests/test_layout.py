"""The package's shape: no import cycles (imports inside functions included), the engine apart from the demo
builder and the CLI, the server apart from the torch backend, one home for the version, and no function or
file too long to read.

tui/ and convert/ are installed as mlx_glimmer.tui and mlx_glimmer.convert, and their imports of the engine
may be relative (`from ..generate import x`) or absolute (`from mlx_glimmer.generate import x`): both count."""

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


def imported(mod: str, is_package: bool, node: ast.AST, mods) -> list[str]:
    """The modules an import statement names, relative ones resolved from module `mod`; `from P import name`
    names P.name when that is a module, and P for a name that is not."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        parts = mod.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module
    subs = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in mods]
    return subs + ([name] if len(subs) < len(node.names) else [])


def dependencies(mod: str, is_package: bool, tree: ast.AST, mods) -> set[str]:
    """The modules of the tree that `mod`'s import statements (anywhere in it, functions included) run: the
    module named, and the packages on its path that are not the importer's own ancestors."""
    parts = mod.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + is_package)}
    deps = set()
    for node in ast.walk(tree):
        for t in imported(mod, is_package, node, mods):
            tp = t.split(".")
            for i in range(1, len(tp) + 1):
                p = ".".join(tp[:i])
                if p in mods and p != mod and (p not in ancestors or p == t):
                    deps.add(p)
    return deps


def import_graph() -> dict[str, set[str]]:
    """module -> its `dependencies`."""
    mods = modules()
    return {
        mod: dependencies(mod, is_package, ast.parse(path.read_text()), mods)
        for mod, (path, is_package) in mods.items()
    }


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


def test_relative_and_absolute_imports_from_tui_and_convert_both_resolve():
    mods = modules()
    for source in ("from ..generate import GenerationStats", "from mlx_glimmer.generate import GenerationStats"):
        assert imported("mlx_glimmer.tui.app", False, ast.parse(source).body[0], mods) == ["mlx_glimmer.generate"]
    for source in ("from .. import errors", "from mlx_glimmer import errors", "import mlx_glimmer.errors"):
        assert imported("mlx_glimmer.convert.cli", False, ast.parse(source).body[0], mods) == ["mlx_glimmer.errors"]
    source = "from .plan import PLAN"  # a name, not a module: the module it comes from
    assert imported("mlx_glimmer.convert.cli", False, ast.parse(source).body[0], mods) == ["mlx_glimmer.convert.plan"]
    inside = ast.parse("def check():\n    from mlx_glimmer.target import Target\n    from ..loading import load\n")
    assert dependencies("mlx_glimmer.convert.plan", False, inside, mods) == {
        "mlx_glimmer.target",
        "mlx_glimmer.loading",
    }


def test_the_arrows_from_tui_and_convert_into_the_engine_are_found():
    graph = import_graph()
    engine = {
        m
        for m in graph
        if m.startswith("mlx_glimmer.") and not m.startswith(("mlx_glimmer.tui", "mlx_glimmer.convert"))
    }
    assert any(graph[m] & engine for m in graph if m.startswith("mlx_glimmer.tui."))
    assert any("mlx_glimmer.generate" in graph[m] for m in graph if m.startswith("mlx_glimmer.tui."))
    assert any(graph[m] & engine for m in graph if m.startswith("mlx_glimmer.convert."))
    assert any("mlx_glimmer.errors" in graph[m] for m in graph if m.startswith("mlx_glimmer.convert."))


def test_no_import_cycles_counting_imports_inside_functions():
    graph = import_graph()
    assert len(graph) > 60 and "mlx_glimmer.drafters.base" in graph and "mlx_glimmer.server.app" in graph
    assert cycles(graph) == []


def test_the_engine_never_imports_the_demo_builder_or_the_cli():
    graph = import_graph()
    for module in ENGINE:
        reach = reachable(graph, module)
        assert not reach & {"mlx_glimmer.demo", "mlx_glimmer.cli", "mlx_glimmer.convert"}, module


def test_the_server_never_imports_the_torch_backend():
    """serve runs MLX pairs only: no module of the server imports torch_backend (imports inside functions too)."""
    graph = import_graph()
    server = [m for m in graph if m.startswith("mlx_glimmer.server.")]
    assert server
    assert {m: sorted(d for d in graph[m] if d.startswith("mlx_glimmer.torch_backend")) for m in server} == {
        m: [] for m in server
    }


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


# ---- sizes ---------------------------------------------------------------------------------------------

MAX_FUNCTION_LINES = 80
MAX_FILE_LINES = 600
SHORT_FILES = {ROOT / "mlx_glimmer" / "drafters" / "base.py": 400, ROOT / "tui" / "app.py": 400}  # lines, fewer


def source_files(*folders: str) -> list[Path]:
    return sorted(f for folder in folders for f in (ROOT / folder).rglob("*.py"))


def parser_classes() -> set[str]:
    """argparse.ArgumentParser and the classes of the tree derived from it."""
    names = {"ArgumentParser"}
    for f in source_files("mlx_glimmer", "tui", "convert"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", None) for b in node.bases}
                if "ArgumentParser" in bases:
                    names.add(node.name)
    return names


def builds_a_parser(function: ast.FunctionDef | ast.AsyncFunctionDef, parsers: set[str]) -> bool:
    """An argparse parser builder: it makes an ArgumentParser, itself or as a subcommand's (`add_parser`)."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in parsers or name == "add_parser":
                return True
    return False


def long_functions(files: list[Path], limit: int) -> list[str]:
    parsers, out = parser_classes(), []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit and not builds_a_parser(node, parsers):
                    out.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_size_checks_see_what_they_measure():
    tree = ast.parse(
        "import argparse\ndef build(sub):\n    p = sub.add_parser('x')\n" + "    p.add_argument('--a')\n" * 90
    )
    assert builds_a_parser(tree.body[1], {"ArgumentParser"})
    assert not builds_a_parser(ast.parse("def f():\n    return 1\n").body[0], {"ArgumentParser"})
    assert "Parser" in parser_classes()  # the CLI's own ArgumentParser subclass
    assert line_count(ROOT / "mlx_glimmer" / "_version.py") < 10


def test_no_function_is_longer_than_80_lines_except_parser_builders():
    assert long_functions(source_files("mlx_glimmer", "tui", "convert"), MAX_FUNCTION_LINES) == []


def test_no_file_is_longer_than_600_lines():
    files = source_files("mlx_glimmer", "tui")
    assert [f"{f.relative_to(ROOT)} ({line_count(f)} lines)" for f in files if line_count(f) > MAX_FILE_LINES] == []


def test_the_drafters_base_and_the_chat_app_stay_short():
    long = {
        f"{f.relative_to(ROOT)} ({line_count(f)} lines)": limit
        for f, limit in SHORT_FILES.items()
        if f.exists() and line_count(f) >= limit
    }
    assert long == {}
