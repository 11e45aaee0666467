"""`mlx-glimmer parity`: do MLX and torch decode the same pair to the same tokens?

Four greedy runs per prompt: plain and speculative on MLX, plain and
speculative on torch (same weights: torch gets MLX's dequantized values).
Every pair of runs is compared; where two runs part, the report gives the
first diverging position, both tokens, and on the common context (prompt +
the tokens both agree on) each backend's full-forward logits: the top1 - top2
margin and the gap between the two tokens.

A divergence is a floating-point tie when, on both backends' logits, the
two tokens are within the tolerance of the coarser compute dtype
(`divergence.py` explains and measures it); a gap beyond it on either
backend is a real disagreement (a bug, or weights that differ) and fails
the command.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

from ..divergence import REL_TOL, coarser, first_divergence, margins, mlx_dtype
from ..errors import GlimmerError
from ..settings import AUTO, OFF, GenerationSettings

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts_heldout.jsonl"
RUNS = ("mlx plain", "mlx spec", "torch plain", "torch spec")


@dataclass
class Divergence:
    runs: tuple[str, str]
    position: int  # index into the generated tokens
    tokens: tuple[int, int]  # what each run emitted there
    texts: tuple[str, str]
    margin: dict[str, float]  # backend -> top1 - top2 of its logits at the common context
    gap: dict[str, float]  # backend -> |logit(token a) - logit(token b)|
    tolerance: dict[str, float]
    tie: bool


@dataclass
class PromptResult:
    index: int
    prompt: str
    prompt_tokens: int
    tokens: dict[str, list[int]]  # run -> generated ids (a stop token included)
    seconds: dict[str, float]
    rounds: dict[str, int] = field(default_factory=dict)  # run -> target forwards after prefill
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not self.divergences


def read_prompts(path: Path | None, limit: int) -> list[str | list[dict]]:
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise GlimmerError(f"{path}: prompts file not found")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = line
        if isinstance(item, dict):
            item = item.get("messages") or item.get("prompt")
        if not isinstance(item, (str, list)) or not item:
            raise GlimmerError(f"{path}:{n}: expected a text line or JSON with 'prompt' or 'messages'")
        prompts.append(item)
        if len(prompts) == limit:
            break
    if not prompts:
        raise GlimmerError(f"{path}: no prompts")
    return prompts


def encode(tokenizer, prompt, chat: bool) -> list[int]:
    from ..chat_template import has_chat_template
    from ..generate import encode_prompt

    if isinstance(prompt, str) and chat and has_chat_template(tokenizer):
        prompt = [{"role": "user", "content": prompt}]
    return encode_prompt(tokenizer, prompt)


def run_tokens(
    pair, ids, speculative: bool, max_tokens: int, block_size: int | None, tree: int | str = OFF
) -> tuple[list[int], int]:
    """Greedy tokens (a stop token included) and the number of target forwards after prefill, on either backend:
    chains of `block_size` (None: the drafter's), or a draft tree of `tree` nodes every round."""
    from ..speculative import generate_steps

    settings = GenerationSettings(
        max_tokens=max_tokens, block_size=block_size or AUTO, speculative=speculative, tree=tree
    )
    steps = list(
        generate_steps(pair.target, ids, settings, drafter=pair.drafter, stop_ids=pair.tokenizer.eos_token_ids)
    )
    return [t for step in steps for t in step.tokens], len(steps) - 1


def mlx_device() -> str:
    import mlx.core as mx

    return str(mx.default_device().type).rpartition(".")[2]


def explain(
    runs: tuple[str, str], position: int, a: int, b: int, context: list[int], backends: dict, dtypes: dict, detok
) -> Divergence:
    """Both backends' logits at the common context decide whether (a, b) is a floating-point tie."""
    margin, gap, tol = {}, {}, {}
    dtype = coarser(*dtypes.values())
    for name, logits_of in backends.items():
        m = margins(logits_of(context), a, b, dtype)
        margin[name], gap[name], tol[name] = m["margin"], m["gap"], m["tolerance"]
    tie = all(gap[k] <= tol[k] for k in gap)
    return Divergence(runs, position, (a, b), (detok([a]), detok([b])), margin, gap, tol, tie)


def compare(result: PromptResult, prompt_ids: list[int], backends: dict, dtypes: dict, detok) -> None:
    for x, y in combinations([r for r in RUNS if r in result.tokens], 2):
        a, b = result.tokens[x], result.tokens[y]
        i = first_divergence(a, b)
        if i is None:
            continue
        if i >= min(len(a), len(b)):  # one run is a prefix of the other: not a numerical question
            result.divergences.append(Divergence((x, y), i, (-1, -1), ("", ""), {}, {}, {}, False))
            continue
        ta, tb = a[i], b[i]
        result.divergences.append(explain((x, y), i, ta, tb, prompt_ids + a[:i], backends, dtypes, detok))


@dataclass
class ParityReport:
    source: str
    mlx: str
    torch: str
    dtype: str
    drafter: str
    max_tokens: int
    block_size: int | None
    prompts: list[PromptResult]

    @property
    def divergences(self) -> list[Divergence]:
        return [d for p in self.prompts for d in p.divergences]

    @property
    def passed(self) -> bool:
        return all(d.tie for d in self.divergences)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        d["rel_tolerance"] = REL_TOL[self.dtype]
        return d


def run_parity(
    mlx_pair,
    torch_pair,
    prompts,
    *,
    max_tokens: int = 128,
    block_size: int | None = None,
    tree: int | str = OFF,
    chat: bool = True,
    source: str = "",
    log=None,
) -> ParityReport:
    from .device import describe

    speculative = mlx_pair.drafter is not None and torch_pair.drafter is not None
    dtypes = {"mlx": mlx_dtype(mlx_pair), "torch": str(torch_pair.dtype).removeprefix("torch.")}
    backends = {"mlx": mlx_pair.target.last_logits, "torch": torch_pair.target.last_logits}
    detok = mlx_pair.tokenizer.decode
    results = []
    for index, prompt in enumerate(prompts, 1):
        ids = encode(mlx_pair.tokenizer, prompt, chat)
        text = prompt if isinstance(prompt, str) else prompt[-1].get("content", "")
        result = PromptResult(index, text, len(ids), {}, {})
        for name in RUNS:
            backend, mode = name.split()
            if mode == "spec" and not speculative:
                continue
            tic = time.perf_counter()
            result.tokens[name], result.rounds[name] = run_tokens(
                mlx_pair if backend == "mlx" else torch_pair, ids, mode == "spec", max_tokens, block_size, tree
            )
            result.seconds[name] = time.perf_counter() - tic
        compare(result, ids, backends, dtypes, detok)
        results.append(result)
        if log is not None:
            log(format_prompt(result))
    shape = f"tree of {tree}" if tree != OFF else f"block {block_size or mlx_pair.drafter.block_size}"
    drafter = f"{mlx_pair.drafter.kind} ({shape})" if speculative else "none"
    return ParityReport(
        source=source,
        mlx=f"mlx {mlx_device()}, {dtypes['mlx']}",
        torch=f"torch {describe(torch_pair.device)}, {dtypes['torch']} (weights from {torch_pair.source})",
        dtype=coarser(*dtypes.values()),
        drafter=drafter,
        max_tokens=max_tokens,
        block_size=block_size,
        prompts=results,
    )


def _short(text: str, n: int = 48) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


def format_divergence(d: Divergence) -> str:
    head = f"    {d.runs[0]} vs {d.runs[1]}: first divergence at generated token {d.position}: "
    if not d.margin:
        return head + "one run ended there and the other went on: DISAGREE"
    a, b = d.tokens
    parts = [f"{a} {d.texts[0]!r} vs {b} {d.texts[1]!r}"]
    for k in d.margin:
        parts.append(f"{k}: top1-top2 {d.margin[k]:.3g}, |gap| {d.gap[k]:.3g} (tol {d.tolerance[k]:.3g})")
    return head + "; ".join(parts) + (": floating-point tie" if d.tie else ": DISAGREE")


def format_prompt(r: PromptResult) -> str:
    n = max((len(t) for t in r.tokens.values()), default=0)
    spec = [f"{k.split()[0]} {r.rounds[k]}" for k in ("mlx spec", "torch spec") if k in r.rounds]
    rounds = f"; speculative rounds: {', '.join(spec)}" if spec else ""
    head = f"prompt {r.index} {_short(r.prompt)!r} ({r.prompt_tokens} prompt tokens, {n} generated{rounds})"
    if r.identical:
        return f"{head}: all {len(r.tokens)} runs identical"
    return "\n".join([f"{head}:"] + [format_divergence(d) for d in r.divergences])


def format_report(rep: ParityReport) -> str:
    pairs = sum(len(r.tokens) * (len(r.tokens) - 1) // 2 for r in rep.prompts)
    ties = sum(d.tie for d in rep.divergences)
    bad = len(rep.divergences) - ties
    lines = [
        f"parity: {rep.source}",
        f"  {rep.mlx} | {rep.torch} | drafter {rep.drafter}",
        f"  {len(rep.prompts)} prompts, greedy, {rep.max_tokens} tokens max; "
        f"tie tolerance {REL_TOL[rep.dtype]:g} x max|logit| ({rep.dtype})",
        *[format_prompt(r) for r in rep.prompts],
        f"summary: {pairs} run pairs compared: {pairs - len(rep.divergences)} identical, {ties} floating-point ties, "
        f"{bad} disagreements -> {'PASS' if rep.passed else 'FAIL'}",
    ]
    return "\n".join(lines)
