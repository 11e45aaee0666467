"""Drawn bad flag values for generate, bench, distill, demo and chat always end as the
contract says (docs/design.md, "Design decisions"): exit 2, exactly one `error:` line that names the flag, no traceback,
and nothing written or loaded.

Each example is one command with one bad value among good ones; the rest of its command line names a
bundle (or an --out) that does not exist, so a value wrongly let through would still stop at once, but with
an error line about the path, not the flag: the property catches it. Calls go through `cli.main(argv)`
in this process (no model, no BLAS re-exec); test_bad_input.py checks real processes and what they import.
"""

from __future__ import annotations

import contextlib
import io
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_glimmer.cli import main
from mlx_glimmer.settings import MAX_DRAFT_K, SEED_LIMIT

PROPERTY = settings(
    max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
NOWHERE = "/nonexistent/mlx-glimmer-bundle"


def refuse(argv: list[str], flag: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    text = err.getvalue()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert code == 2, (argv, text)
    assert "Traceback" not in text, text
    assert len(lines) == 1 and lines[0].startswith("error: "), (argv, text)
    assert flag in lines[0], (argv, flag, lines[0])


# ---- bad values ------------------------------------------------------------------------------------------


def as_text(values):
    return values.map(lambda v: repr(v) if isinstance(v, float) and not math.isfinite(v) else str(v))


junk = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), min_size=0, max_size=8)
not_a_number = junk.filter(lambda t: not _parses(t, float))
not_an_int = junk.filter(lambda t: not _parses(t, int))


def _parses(text: str, kind) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


below_one = st.one_of(as_text(st.integers(max_value=0)), not_an_int)
negative = st.one_of(as_text(st.integers(max_value=-1)), not_an_int)
bad_seed = st.one_of(as_text(st.integers(max_value=-1)), as_text(st.integers(min_value=SEED_LIMIT)), not_an_int)
bad_temperature = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "NaN"]), as_text(st.floats(max_value=-1e-9, allow_nan=False)), not_a_number
)
bad_top_p = st.one_of(
    st.sampled_from(["nan", "inf", "0", "-0.0"]),
    as_text(st.floats(min_value=1.0, exclude_min=True, allow_nan=False)),
    as_text(st.floats(max_value=0.0, allow_nan=False)),
    not_a_number,
)
bad_top_k = st.one_of(as_text(st.integers(max_value=-1)), st.sampled_from(["2.5", "nan", "1e3"]), not_an_int)
bad_block = st.one_of(as_text(st.integers(max_value=0)), not_an_int.filter(lambda t: t != "auto"))
bad_draft_k = st.one_of(as_text(st.integers(max_value=0)), as_text(st.integers(min_value=MAX_DRAFT_K + 1)), not_an_int)
bad_lr = st.one_of(
    st.sampled_from(["nan", "inf", "-inf", "0"]), as_text(st.floats(max_value=0.0, allow_nan=False)), not_a_number
)
bad_temperatures = st.one_of(
    st.lists(st.sampled_from(["0", "0.5", "nan", "inf", "-1", "x", ""]), min_size=1, max_size=4)
    .map(",".join)
    .filter(lambda t: not all(_parses(x, float) and math.isfinite(float(x)) and float(x) >= 0 for x in t.split(","))),
)
bad_block_sizes = (
    st.lists(st.sampled_from(["auto", "4", "0", "-3", "x", "", "2.5"]), min_size=1, max_size=4)
    .map(",".join)
    .filter(lambda t: not all(x == "auto" or (x.isdigit() and int(x) >= 1) for x in t.split(",")))
)
missing_file = junk.map(lambda t: f"{NOWHERE}/{t}.jsonl")
missing_init = junk.map(lambda t: f"{NOWHERE}/{t}")

SAMPLING = {
    "--max-tokens": below_one,
    "--temp": bad_temperature,
    "--top-p": bad_top_p,
    "--top-k": bad_top_k,
    "--seed": bad_seed,
    "--block-size": bad_block,
}
# command -> (the rest of a command line, {flag: bad values})
COMMANDS = {
    "generate": (["generate", NOWHERE, "--prompt", "Hi"], {**SAMPLING, "--draft-k": bad_draft_k}),
    "chat": (["chat", NOWHERE], SAMPLING),
    "bench": (
        ["bench", NOWHERE],
        {
            "--max-tokens": below_one,
            "--num-prompts": below_one,
            "--repeats": below_one,
            "--warmup": negative,
            "--draft-k": bad_draft_k,
            "--block-sizes": bad_block_sizes,
            "--prompts": missing_file,
        },
    ),
    "distill": (
        ["distill", NOWHERE, "--out", NOWHERE + "/run"],
        {
            "--steps": below_one,
            "--anchors": below_one,
            "--sequences-per-step": below_one,
            "--eval-every": below_one,
            "--answer-tokens": below_one,
            "--batch-size": below_one,
            "--layers": below_one,
            "--context-layers": below_one,
            "--eval-prompts": below_one,
            "--eval-tokens": below_one,
            "--eval-tree": st.one_of(negative, as_text(st.integers(min_value=64))),
            "--max-prompts": below_one,
            "--draft-vocab": below_one,
            "--gen-threads": below_one,
            "--mask-token": negative,
            "--self-instruct": negative,
            "--follow-ups": negative,
            "--seed": bad_seed,
            "--lr": bad_lr,
            "--temperatures": bad_temperatures,
            "--init": missing_init,
            "--prompts": missing_file,
            "--heldout": missing_file,
        },
    ),
    "demo": (
        ["demo", "--out", NOWHERE + "/demo"],
        {
            "--bits": st.one_of(as_text(st.integers().filter(lambda b: b not in (4, 8, 16))), not_an_int),
            "--dtype": junk.filter(lambda t: t not in ("bfloat16", "float16", "float32")),
        },
    ),
}


@st.composite
def bad_command_line(draw, command: str):
    base, flags = COMMANDS[command]
    flag = draw(st.sampled_from(sorted(flags)))
    return [*base, f"{flag}={draw(flags[flag])}"], flag


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_flag_value_is_one_error_line_naming_it(command):
    @PROPERTY
    @given(bad_command_line(command))
    def check(case):
        argv, flag = case
        refuse(argv, flag)

    check()


unknown_flag = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=12).map(lambda t: "--zz" + t)


@PROPERTY
@given(st.sampled_from(sorted(COMMANDS)), unknown_flag)
def test_an_unknown_flag_is_one_error_line_naming_it(command, flag):
    refuse([*COMMANDS[command][0], flag], flag)


@PROPERTY
@given(st.sampled_from(sorted(COMMANDS)), st.data())
def test_two_bad_flags_still_give_one_line(command, data):
    base, flags = COMMANDS[command]
    first, second = data.draw(
        st.lists(st.sampled_from(sorted(flags)), min_size=2, max_size=2, unique=True)
        if len(flags) > 1
        else st.just([sorted(flags)[0]] * 2)
    )
    argv = [*base, f"{first}={data.draw(flags[first])}", f"{second}={data.draw(flags[second])}"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 2
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and (first in lines[0] or second in lines[0]), lines
