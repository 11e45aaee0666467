"""The docs say only what is there: every `mlx-glimmer COMMAND --flag` they name is a flag of that command (read
from the parsers the command line builds), and every repository path they name, in backticks or as a link,
exists (a link's #anchor included)."""

from __future__ import annotations

import argparse
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "benchmarks" / "README.md",
    ROOT / "benchmarks" / "experiments" / "README.md",
]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*?)`")  # may wrap onto the next line, as paragraphs do
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"(?:^|[\s/])mlx-glimmer[ \t]+([^\n]*)")
FLAG = re.compile(r"^\[?(--[a-z][a-z0-9-]*)")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b")
PATH_TOKEN = re.compile(r"[\w.{},*~$-]+(?:/[\w.{},*~$-]*)+")


def doc_ids() -> list[str]:
    return [str(d.relative_to(ROOT)) for d in DOCS]


def code_of(text: str) -> list[str]:
    """Fenced blocks and inline code spans, in order; a fenced line ending in a backslash goes on."""
    blocks = [b.replace("\\\n", " ") for b in FENCE.findall(text)]
    return blocks + SPAN.findall(FENCE.sub("", text))


@cache
def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command line's parser and its subcommands' parsers, as `mlx-glimmer` builds them."""
    from mlx_glimmer.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(sub.choices)


def commands_named(code: str) -> list[tuple[str | None, list[str]]]:
    """(subcommand or None, the flags given) for each `mlx-glimmer ...` command line in a piece of code, and for
    a span that starts with a subcommand's name and goes on with a flag (`bench --full`)."""
    out = []
    lines = [m.group(1) for m in COMMAND.finditer(code)]
    words = code.split()
    if len(words) >= 2 and words[0] in parsers()[1] and words[1].startswith("--"):
        lines.append(code)
    for line in lines:
        line = re.split(r"&&|;|\s#|\$\(", line)[0]
        tokens = line.split()
        command = tokens[0] if tokens and re.fullmatch(r"[a-z][a-z-]*", tokens[0]) else None
        flags = [m.group(1) for t in tokens for m in [FLAG.match(t)] if m]
        out.append((command, flags))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_flag_the_docs_name_exists(doc):
    top, subcommands = parsers()
    wrong = []
    for code in code_of(doc.read_text()):
        for command, flags in commands_named(code):
            if command is not None and command not in subcommands:
                wrong.append(f"mlx-glimmer {command}: no such command")
                continue
            parser = subcommands[command] if command else top
            wrong += [
                f"mlx-glimmer {command or ''} {f}".replace("  ", " ")
                for f in flags
                if f not in parser._option_string_actions
            ]
    assert wrong == []


@cache
def tracked_top_level() -> frozenset[str]:
    """The repository's own top-level files and folders (what git tracks: not runs/, .venv/, caches)."""
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(line.split("/", 1)[0] for line in names.splitlines())


def expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand_braces(path[: m.start()] + alt + path[m.end() :])]


def exists(base: Path, path: str) -> bool:
    """`path` under `base`; a glob, or UPPERCASE placeholders (`NAME.py`, `ARM-3840k_...`), must match a file."""
    for candidate in expand_braces(path):
        if (base / candidate).exists():
            continue
        pattern = PLACEHOLDER.sub("*", candidate)
        if not any(c in pattern for c in "*?[") or not list(base.glob(pattern.rstrip("/"))):
            return False
    return True


def paths_named(doc: Path, code: str) -> list[str]:
    """Repository paths in a piece of code: from the repository root (its first part is a top-level file or
    folder of the repository) or from the doc's own folder (the first part is there)."""
    out = []
    for token in PATH_TOKEN.findall(code):
        token = token.rstrip(".,:;")
        first = token.split("/", 1)[0]
        if first in ("", "~", ".", "..") or first.startswith("$"):
            continue
        if first in tracked_top_level() or (doc.parent != ROOT and (doc.parent / first).exists()):
            out.append(token)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = FENCE.sub("", doc.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_path_the_docs_name_exists(doc):
    text = doc.read_text()
    missing = []
    for code in code_of(text):
        for path in paths_named(doc, code):
            base = ROOT if path.split("/", 1)[0] in tracked_top_level() else doc.parent
            if not exists(base, path):
                missing.append(path)
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            missing.append(target)
    assert missing == []


def test_the_checks_see_what_they_check(tmp_path):
    assert commands_named("mlx-glimmer serve BUNDLE [--port 8080] --seed 3 && ls --all") == [
        ("serve", ["--port", "--seed"])
    ]
    assert commands_named(".venv/bin/mlx-glimmer --version") == [(None, ["--version"])]
    assert commands_named("bench --full") == [("bench", ["--full"])]
    assert commands_named("format mlx-glimmer/1") == [] and commands_named("~/.cache/mlx-glimmer/demo") == []
    assert "--seed" not in parsers()[1]["serve"]._option_string_actions  # so the first one is caught
    assert expand_braces("results/x.{json,png}") == ["results/x.json", "results/x.png"]
    assert exists(ROOT, "benchmarks/experiments/NAME.py") and not exists(ROOT, "benchmarks/nothing_here.py")
    assert paths_named(ROOT / "README.md", "see tests/test_docs.py and runs/demo2 or RUN/drafter") == [
        "tests/test_docs.py"
    ]
    assert slug("## Archived results (`results/archive/`)".lstrip("# ")) == "archived-results-resultsarchive"


README = ROOT / "README.md"


def performance_rows() -> list[dict[str, str]]:
    """The README's performance table: a row as {column heading: cell}."""
    section = README.read_text().split("## Performance", 1)[1].split("\n## ", 1)[0]
    lines = [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines() if line[:1] == "|"]
    header, rows = lines[0], lines[2:]
    return [dict(zip(header, row)) for row in rows]


def test_every_performance_row_names_the_cpu_its_results_files_record():
    rows = performance_rows()
    assert rows and all(set(r) == {"what", "result", "CPU", "results file"} for r in rows)
    for row in rows:
        files = re.findall(r"`([^`\s]+\.json)`", row["results file"])
        assert files, row
        for name in files:
            recorded = (ROOT / name).read_text().replace("(R)", "")  # "Intel(R) Xeon(R) Processor"
            assert row["CPU"] in recorded, (row["CPU"], name)


def test_the_readme_is_a_product_page_whose_test_command_is_the_one_ci_runs():
    assert len(README.read_bytes()) <= 12 * 1024  # detail belongs in docs/ and benchmarks/README.md
    first_block = FENCE.search(README.read_text()).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "mlx-glimmer chat" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()
