"""What a speculative round adds around the target's forward: array ops by round shape, and their time.

    python benchmarks/round_ops.py                      # the demo pair (`mlx-glimmer demo` builds it once)
    python benchmarks/round_ops.py --bundle DIR         # any bundle with a drafter (trees: one that seeds them)
    python benchmarks/round_ops.py --tiny               # the tests' tiny Muse pair: a forward of almost nothing
    python benchmarks/round_ops.py --counts-only        # op counts alone (deterministic, any load)
    python benchmarks/round_ops.py --before FILE        # put an earlier run's op counts beside this run's

A round is queued by the loop's own `_launch` (speculative.py) on a prefilled context, once per shape: a plain
round under `auto` (width 1), the drafter's greedy chains of widths 4, 8 and 16, best-first trees of 4, 8, 16
and 32 nodes with and without an n-gram branch (the prompt repeats itself, so the lookup matches), the n-gram
continuation verified alone, and a sampled chain and tree; beside them plain decoding without a drafter
(`_next_token`), the baseline every round is held against.

Op counts. The primitives of a round's lazy graph are read with `mx.export_to_dot` (one node per primitive,
keyed by its id, so graphs can be subtracted): the drafter's forward, the draft's construction (tree or
chain), the target's forward and head, and what follows them (the verdict, log-probabilities). The forward
alone, a causal verify of the same width with no tree, is counted on its own; `loop_ops` is everything else
the round builds: the draft's construction, the verdict, and what a tree adds inside the forward (its
attention mask). `loop_ops_run` counts only what the round's outputs reach (what the device runs; a lazy
array nobody reads costs graph building alone). Counts do not depend on the machine's load.

Time (per round, median of `--repeats`): the round queued and evaluated part by part, so each part's time is
its own: `drafter_s` (the drafter's forward), `draft_s` (building the draft on the device), `forward_s` (the
target's forward and head, host and device), `verdict_s` (the verdict and what follows it on the device),
`host_s` (the loop's own Python building the round's graph, outside the drafter and the forward) and
`loop_s` (draft + verdict + host: what the loop adds). Beside them `bare_forward_s`, the causal forward of
the same width. On a CPU a forward hides the loop's share; on Metal, where a forward takes a few
milliseconds, `loop_s` against `bare_forward_s` is the figure to watch. Part-by-part evaluation serialises
what the loop overlaps, so the times bound a round's overhead from above. Timings need an idle machine:
the file records the load average, and marks its times indicative when something else ran.

Writes `benchmarks/results/round_ops.json` (`--out`): the processor (`cpu.cpu_facts`), MLX's device and
version, the bundle, the load, and one row per shape.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from mlx_glimmer.block_policy import Shape  # noqa: E402
from mlx_glimmer.cpu import cpu_facts  # noqa: E402
from mlx_glimmer.decode_state import DecodeState  # noqa: E402
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter  # noqa: E402
from mlx_glimmer.noise import Noise  # noqa: E402
from mlx_glimmer.settings import MAX_TREE_NODES, GenerationSettings, SamplingParams  # noqa: E402
from mlx_glimmer.speculative import _launch, _next_token, _open, _prefill_chunks, _Proposers  # noqa: E402

REMAINING = 1000  # tokens still to generate: no round is cut short
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9)
_NODE = re.compile(r'^\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}$', re.M)


def graph_nodes(*arrays) -> dict[str, str]:
    """The unevaluated primitives behind `arrays`, {node id: primitive name} (evaluated arrays are leaves)."""
    arrays = [a for a in arrays if a is not None]
    if not arrays:
        return {}
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dict(_NODE.findall(dot.getvalue()))


def tree_fields(tree) -> list:
    return [tree.tokens, tree.parents, tree.depths, tree.sources, tree.ancestors]


class RoundTarget:
    """The target as `_launch` sees it, noting what its forward took and returned. `launch` starts nothing, so
    a counted round stays one unevaluated graph; a `staged` round evaluates its draft when the forward takes it
    and the forward when the head returns, timing each."""

    def __init__(self, target, staged: bool):
        self._target, self.staged = target, staged
        self.inputs, self.logits, self.feats = [], None, None
        self.draft_s = self.forward_s = 0.0
        self._tic = 0.0

    def __getattr__(self, name):
        return getattr(self._target, name)

    def launch(self, *arrays) -> None:
        pass

    def forward(self, tokens, cache, capture, tree=None):
        self.inputs = [tokens] + (tree_fields(tree) if tree is not None else [])
        if self.staged:
            tic = time.perf_counter()
            mx.eval(self.inputs)
            self.draft_s = time.perf_counter() - tic
        self._tic = time.perf_counter()
        hidden, self.feats = self._target.forward(tokens, cache, capture, tree)
        return hidden, self.feats

    def head(self, hidden):
        self.logits = self._target.head(hidden)
        if self.staged:
            mx.eval([a for a in (self.logits, self.feats) if a is not None])
        self.forward_s = time.perf_counter() - self._tic
        return self.logits


class RoundDrafter:
    """The drafter as `_launch` sees it, noting its forward's outputs (evaluated and timed when `staged`)."""

    def __init__(self, drafter, staged: bool):
        self._drafter, self.staged = drafter, staged
        self.outputs: list = []
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def marginals(self, anchor: int, count: int):
        tic = time.perf_counter()
        marginals = self._drafter.marginals(anchor, count)
        self._note([marginals.log_probs, marginals.vocab], tic)
        return marginals

    def propose(self, anchor: int, count: int, params, noise):
        tic = time.perf_counter()
        draft, probs = self._drafter.propose(anchor, count, params, noise)
        self._note([draft, probs], tic)
        return draft, probs

    def _note(self, outputs: list, tic: float) -> None:
        self.outputs = [a for a in outputs if a is not None]
        if self.staged:
            mx.eval(self.outputs)
        self.seconds = time.perf_counter() - tic


@dataclass(frozen=True)
class Case:
    """One round shape to measure; `shape` None: plain decoding without a drafter (`_next_token`)."""

    name: str
    shape: Shape | None
    params: SamplingParams = GREEDY
    lookup: bool = False  # the n-gram index is there (a tree then gets its branch)


CASES = [
    Case("plain decoding (no drafter)", None),
    Case("plain round under auto", Shape(1)),
    Case("greedy chain 4", Shape(4)),
    Case("greedy chain 8", Shape(8)),
    Case("greedy chain 16", Shape(16)),
    *(Case(f"tree {n}", Shape(n + 1, tree=True)) for n in (4, 8, 16, 32)),
    *(Case(f"tree {n} + n-gram branch", Shape(n + 1, tree=True), lookup=True) for n in (4, 8, 16, 32)),
    Case("lookup chain 16", Shape(16, lookup=True), lookup=True),
    Case("plain decoding, sampled (no drafter)", None, SAMPLED),
    Case("sampled chain 8", Shape(8), SAMPLED),
    Case("sampled tree 16 + n-gram branch", Shape(17, tree=True), SAMPLED, lookup=True),
]


@dataclass
class Bench:
    """A prefilled context to queue rounds on: after each round the cache is rolled back to it, and the drafter,
    which observes nothing, stays as it was."""

    target: object
    drafter: object
    state: DecodeState
    lookup: PromptLookupDrafter
    anchor: int
    key: Noise  # the sampling noise of every round's first new token
    proposers: dict = field(default_factory=dict)  # by whether the n-gram index is there: one per generation

    def __post_init__(self):
        depth = self.drafter.block_size - 1
        self.proposers = {lookup: _Proposers(self.drafter, self.lookup if lookup else None, depth) for lookup in (0, 1)}

    @property
    def capture(self) -> bool:
        return bool(self.drafter.target_layer_ids)

    def queue(self, case: Case, staged: bool):
        """Queue `case`'s round through the loop's own code; (its outputs, the target's and drafter's notes,
        host seconds of the whole call)."""
        target, cache = RoundTarget(self.target, staged), self.state.cache
        drafter = RoundDrafter(self.drafter, staged)
        anchor_ids = self.target.tokens([self.anchor])
        tic = time.perf_counter()
        if case.shape is None:
            picked, _ = _next_token(target, cache, anchor_ids, case.params, self.key)
            return [picked], None, target, drafter, time.perf_counter() - tic, 1
        proposers = self.proposers[case.lookup]
        proposers.drafter = drafter
        rnd = _launch(
            target, proposers, cache, self.capture, case.params, self.key, self.anchor, anchor_ids, case.shape,
            self.drafter.block_size, REMAINING,
        )  # fmt: skip
        outputs = [rnd.verdict, rnd.draft.tokens, rnd.logprobs, rnd.feats]
        return outputs, rnd, target, drafter, time.perf_counter() - tic, rnd.width

    def undo(self, outputs: list, width: int) -> None:
        """Finish a round's work and take its forward back out of the cache."""
        self.target.sync(*outputs, cache=self.state.cache)
        self.target.trim(self.state.cache, width)

    def bare_forward(self, width: int, capture: bool, count: bool) -> tuple[int, float]:
        """A causal forward and head of `width` tokens, no tree: (its primitives, seconds host and device)."""
        tic = time.perf_counter()
        hidden, feats = self.target.forward(self.target.tokens([self.anchor] * width), self.state.cache, capture)
        logits = self.target.head(hidden)
        ops = len(graph_nodes(logits, feats)) if count else 0
        if not count:
            mx.eval([a for a in (logits, feats) if a is not None])
        seconds = time.perf_counter() - tic
        self.undo([logits, feats], width)
        return ops, seconds

    def count(self, case: Case) -> dict:
        warm, rnd, *_, width = self.queue(case, staged=False)  # what a round builds once a generation is built
        self.undo(warm, width)
        reused = rnd.draft if rnd is not None else None
        outputs, rnd, target, drafter, _, width = self.queue(case, staged=False)
        drafted = graph_nodes(*drafter.outputs)
        fields = tree_fields(rnd.draft) if rnd is not None and rnd.draft is not reused else []
        draft = graph_nodes(*fields, *target.inputs)  # with the drafter's forward under it
        through_forward = graph_nodes(target.logits, target.feats)
        run = graph_nodes(*outputs)
        built = {**run, **draft}
        forward = through_forward.keys() - draft.keys()
        self.undo(outputs, width)
        bare, _ = self.bare_forward(width, self.capture and case.shape is not None, count=True)
        own = built.keys() - drafted.keys() - forward  # the draft's construction and the verdict
        extra = len(forward) - bare  # what the round adds inside the forward (a tree's mask)
        row = {
            "drafter_ops": len(drafted),
            "forward_ops": len(forward),
            "bare_forward_ops": bare,
            "draft_ops": len(draft.keys() - drafted.keys()),
            "verdict_ops": len(built.keys() - through_forward.keys() - draft.keys()),
            "loop_ops": len(own) + extra,
            "loop_ops_run": len(run.keys() - drafted.keys() - forward) + extra,
            "loop_ops_by_primitive": dict(Counter(built[k] for k in own).most_common()),
            "lookup_nodes": rnd.lookup_offered if rnd is not None else 0,
        }
        return row

    def time(self, case: Case, repeats: int) -> dict:
        parts = {k: [] for k in ("drafter_s", "draft_s", "forward_s", "verdict_s", "host_s", "loop_s")}
        bare = []
        for i in range(repeats + 1):  # the first: warm-up (kernels compiled)
            outputs, rnd, target, drafter, launch_s, width = self.queue(case, staged=True)
            tic = time.perf_counter()
            mx.eval([a for a in outputs if a is not None])
            verdict_s = time.perf_counter() - tic
            self.undo(outputs, width)
            capture = self.capture and case.shape is not None
            _, bare_s = self.bare_forward(width, capture, count=False)
            if i == 0:
                continue
            host_s = max(launch_s - drafter.seconds - target.draft_s - target.forward_s, 0.0)
            for name, value in (
                ("drafter_s", drafter.seconds),
                ("draft_s", target.draft_s),
                ("forward_s", target.forward_s),
                ("verdict_s", verdict_s),
                ("host_s", host_s),
                ("loop_s", host_s + target.draft_s + verdict_s),
            ):
                parts[name].append(value)
            bare.append(bare_s)
        row = {name: statistics.median(values) for name, values in parts.items()}
        row["bare_forward_s"] = statistics.median(bare)
        row["loop_over_forward"] = row["loop_s"] / row["bare_forward_s"]
        return row


def repeating_prompt(tokenizer) -> tuple[list[int], int]:
    """A prompt that repeats its first half, cut so the anchor's n-gram continues it: (prompt, anchor)."""
    text = (
        "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his father "
        "had taught him, and lit the great lamp so that the fishing boats could find their way home through the "
        "fog that rolled in from the cold northern sea. "
    )
    ids = list(tokenizer.encode(text))
    cut = len(ids) // 2
    return ids + ids[:cut], ids[cut]


def open_bench(pair) -> Bench:
    target, drafter = pair.target, pair.drafter
    prompt, anchor = repeating_prompt(pair.tokenizer)
    settings = GenerationSettings(tree=MAX_TREE_NODES)
    state = DecodeState()
    _open(target, prompt, settings, drafter, state, None)
    for hidden in _prefill_chunks(target, state, prompt, drafter, 512):
        pass
    target.sync(hidden, *drafter.settle(), cache=state.cache)
    lookup = PromptLookupDrafter(draft_k=MAX_TREE_NODES, min_ngram=1)
    lookup.observe(prompt, None)
    return Bench(target, drafter, state, lookup, anchor, Noise(0, len(prompt) + 1))


def load_pair(args):
    import mlx_glimmer

    if args.tiny:
        sys.path.insert(0, str(ROOT / "benchmarks" / "experiments"))
        import loop_overhead

        where = Path(tempfile.gettempdir()) / "round-ops-tiny"
        target, drafter = loop_overhead.tiny_pair(where)
        return mlx_glimmer.load(target=target, drafter=drafter), "the tests' tiny Muse pair"
    if args.bundle is None:
        from mlx_glimmer.demo import demo_bundle

        return mlx_glimmer.load(str(demo_bundle())), "the demo pair (mlx-glimmer demo)"
    return mlx_glimmer.load(args.bundle), args.bundle


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", help="a bundle with a drafter (default: the demo pair)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny Muse pair instead (built with transformers)")
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds per shape (median)")
    ap.add_argument("--counts-only", action="store_true", help="op counts alone, no timing")
    ap.add_argument("--before", help="an earlier results file of this script: its op counts go beside this run's")
    ap.add_argument("--note", default="", help="what else ran, or anything else to keep with the results")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "round_ops.json"))
    args = ap.parse_args(argv)
    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    before = {}
    if args.before:
        try:
            before = {r["name"]: r for r in json.loads(Path(args.before).read_text())["rows"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --before {args.before}: not a results file of this script ({e})", file=sys.stderr)
            return 2
    load_at_start = os.getloadavg()
    pair, source = load_pair(args)
    if pair.drafter is None:
        print(f"error: {source}: no drafter (round shapes other than plain need one)", file=sys.stderr)
        return 2
    cases = [c for c in CASES if pair.drafter.has_marginals or c.shape is None or not c.shape.tree]
    bench = open_bench(pair)
    rows = []
    for case in cases:
        row = {"name": case.name, "width": case.shape.width if case.shape else 1, "sampled": not case.params.greedy}
        row.update(bench.count(case))
        if case.name in before:
            row["loop_ops_before"] = before[case.name]["loop_ops"]
            row["loop_ops_run_before"] = before[case.name]["loop_ops_run"]
        if not args.counts_only:
            row.update(bench.time(case, args.repeats))
        rows.append(row)
        print(f"[round_ops] {case.name}: {row['loop_ops']} loop ops", file=sys.stderr, flush=True)
    load_at_end = os.getloadavg()
    busy = max(load_at_start[0], load_at_end[0]) >= 0.5 * (os.cpu_count() or 1) or bool(args.note)
    report = {
        "command": " ".join(["python", "benchmarks/round_ops.py", *(argv if argv is not None else sys.argv[1:])]),
        "cpu": cpu_facts(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "metal": mx.metal.is_available(),
        "pair": source,
        "drafter": {
            "kind": pair.drafter.kind,
            "block_size": pair.drafter.block_size,
            "trees": pair.drafter.has_marginals,
        },
        "load_average": {"start": list(load_at_start), "end": list(load_at_end)},
        "note": args.note,
        "timing": None if args.counts_only else ("indicative: other jobs ran" if busy else "idle machine"),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows))
    print(f"report: {out}")
    return 0


def table(rows: list[dict]) -> str:
    timed = "loop_s" in rows[0]
    head = "| round | width | loop ops (run) | before | forward ops | drafter ops |"
    head += " loop ms | forward ms | loop / forward |" if timed else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        before = f"{r['loop_ops_before']} ({r['loop_ops_run_before']})" if "loop_ops_before" in r else ""
        line = (
            f"| {r['name']} | {r['width']} | {r['loop_ops']} ({r['loop_ops_run']}) | {before} | "
            f"{r['bare_forward_ops']} | {r['drafter_ops']} |"
        )
        if timed:
            line += f" {r['loop_s'] * 1e3:.2f} | {r['bare_forward_s'] * 1e3:.2f} | {r['loop_over_forward']:.2f} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
