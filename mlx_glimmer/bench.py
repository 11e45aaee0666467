"""`mlx-glimmer bench`: plain vs speculative decoding, side by side in one run.

For every prompt, in turn: mlx-lm's own `stream_generate` on the same target
(the tool users compare against), our plain path, then each speculative
configuration. Interleaving keeps slow drift (thermals, other load) from
favouring one method. Rates use one definition everywhere: tokens after the
first / time from the first token to the last (prefill excluded).
Greedy throughout, so every method must produce the same tokens; the run
checks that and reports any difference. Each speculative method is a verify width
and a draft-tree setting (`--block-sizes` x `--trees`), named `spec_b{width}_t{tree}`
(`spec_bauto_tauto`, `spec_bauto_toff`, `spec_b16_toff`); a fixed width verifies chains
under tree `auto`, so it runs as `off` (one method, not two). `--with-lookup` adds `lookup`:
n-gram prompt lookup alone (what `--prompt-lookup --block-sizes auto` runs), in the same run, so
the default can be held against each proposer alone on the same prompts and the same plain
baseline. Every flag is checked (`check_bench_flags`) before MLX is imported and before the
model loads.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .blas import blas_name
from .cpu import chip_name
from .errors import GlimmerError
from .flags import add_drafter_flags, nonnegative_int, positive_int, tree_arg
from .paths import DATA_DIR
from .settings import AUTO, OFF, GenerationSettings


@dataclass
class Measurement:
    method: str
    tokens: int = 0
    decode_s: float = 0.0
    target_forwards: int = 0
    acceptance: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)  # verify width of every round
    mismatches: int = 0
    per_prompt_tokens_per_second: list[float] = field(default_factory=list)  # one per prompt and repeat
    divergences: list[dict] = field(default_factory=list)  # per mismatch: `divergence.explain_divergence`'s report
    tokens_verified: int = 0  # over rounds after prefill: drafts offered (chain or tree nodes) + the anchor
    tree_rounds: int = 0  # rounds that verified a draft tree
    accepted_depths: list[int] = field(default_factory=list)  # drafts kept, per round
    accepted_from: dict[str, int] = field(default_factory=dict)  # rounds by who proposed the accepted path

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def mean_acceptance(self) -> float:
        return sum(self.acceptance) / len(self.acceptance) if self.acceptance else 0.0

    @property
    def mean_tokens_verified(self) -> float:
        return self.tokens_verified / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        return sum(self.accepted_depths) / len(self.accepted_depths) if self.accepted_depths else 0.0

    def add(self, tokens: int, decode_s: float, forwards: int = 0, acceptance=(), widths=()) -> None:
        self.tokens += tokens
        self.decode_s += decode_s
        self.target_forwards += forwards
        self.acceptance.extend(acceptance)
        self.widths.extend(widths)
        self.per_prompt_tokens_per_second.append(tokens / decode_s if decode_s > 0 else 0.0)

    def add_rounds(self, stats) -> None:
        """The draft-tree figures of one generation's `GenerationStats`."""
        self.tokens_verified += stats.tokens_verified
        self.tree_rounds += stats.tree_rounds
        self.accepted_depths.extend(stats.accepted_depths)
        for source, n in stats.accepted_from.items():
            self.accepted_from[source] = self.accepted_from.get(source, 0) + n


def method_name(width: int | str, tree: int | str) -> str:
    return f"spec_b{width}_t{tree}"


def spec_methods(block_sizes: list[int | str], trees: list[int | str]) -> list[str]:
    """One speculative method per (width, tree); a fixed width verifies chains under tree "auto", so that pair
    runs as tree "off", and a tree of N nodes sets the width itself (N + 1, with block size "auto" only:
    `settings.FIXED_TREE_RULE`), so a fixed width with it runs as width "auto" (each listed once)."""

    def method(b, t) -> str:
        if b != AUTO and t == AUTO:
            return method_name(b, OFF)
        return method_name(AUTO if isinstance(t, int) else b, t)

    return list(dict.fromkeys(method(b, t) for b in block_sizes for t in trees))


LOOKUP_ALONE = "lookup"  # the method of `--with-lookup`: prompt lookup alone, block size auto, chains
LOOKUP_DRAFT_K = 10  # its drafts per round at most, as `--prompt-lookup` drafts by default
OTHER_DRAFTER = "other_drafter"  # the method of `--with-drafter`: the default with another drafter, same target


def method_settings(method: str, max_tokens: int) -> GenerationSettings:
    """The settings a method name stands for: `plain`, `lookup` (its own pair: `lookup_pair`), `other_drafter`
    (the defaults, its own pair), or `spec_b{width}_t{tree}`."""
    if method == "plain":
        return GenerationSettings(max_tokens=max_tokens, speculative=False)
    if method == LOOKUP_ALONE:
        return GenerationSettings(max_tokens=max_tokens, block_size=AUTO, tree=OFF)
    if method == OTHER_DRAFTER:
        return GenerationSettings(max_tokens=max_tokens)
    width, tree = method.removeprefix("spec_b").split("_t")
    return GenerationSettings(
        max_tokens=max_tokens,
        block_size=width if width == AUTO else int(width),
        tree=tree if tree in (AUTO, OFF) else int(tree),
    )


def lookup_pair(pair):
    """The same target drafting by n-gram lookup alone, as `--prompt-lookup` loads it."""
    from .drafters.prompt_lookup import PromptLookupDrafter

    return replace(pair, drafter=PromptLookupDrafter(draft_k=LOOKUP_DRAFT_K), drafter_path=None)


def median_speedup(method: list[float], plain: list[float]) -> float:
    """Median over prompts of method tok/s / plain tok/s on the same prompt (both per-prompt lists, in prompt order)."""
    ratios = [m / p for m, p in zip(method, plain) if p > 0]
    return statistics.median(ratios) if ratios else 0.0


def device_name() -> str:
    import mlx.core as mx

    return f"{chip_name()} ({mx.default_device()})"


_PATH_START = r"(?<![^\s='\"])"  # a path begins the text, a word, or a value after = or a quote
_PATH_END = rf"(?=[{re.escape(os.sep)}\s'\"]|$)"


def portable_path(text) -> str:
    """A path, or a command line naming paths, as a results file records it: relative under the working folder,
    `~/...` under the home folder, so it names no one's machine."""
    text, cwd = str(text), Path.cwd()
    if cwd != Path(cwd.anchor):
        text = re.sub(_PATH_START + re.escape(f"{cwd}{os.sep}"), "", text)
    return re.sub(_PATH_START + re.escape(str(Path.home())) + _PATH_END, "~", text)


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none, as on Windows)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def environment(pair) -> dict:
    import mlx.core as mx
    import mlx_lm

    env = {
        "device": device_name(),
        "blas": blas_name(),  # matrix products on the CPU: verify costs change tenfold with it
        "os": platform.platform(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "target": portable_path(pair.target_path),
        "target_quantization": pair.quantization,
        "drafter": portable_path(pair.drafter_path) if pair.drafter_path else None,
        "drafter_kind": pair.drafter.kind if pair.drafter is not None else None,
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def time_mlx_lm(pair, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """mlx-lm's stream_generate, greedy; (tokens, seconds from first token to last)."""
    from mlx_lm import stream_generate as lm_stream

    tokens, first_at, last_at = [], None, None
    for r in lm_stream(pair.target.model, pair.tokenizer, ids, max_tokens=max_tokens):
        now = time.perf_counter()
        if r.finish_reason == "stop" and r.token in pair.tokenizer.eos_token_ids:
            break
        tokens.append(r.token)
        first_at = first_at or now
        last_at = now
    return tokens, (last_at - first_at) if tokens else 0.0


def time_ours(pair, ids, settings: GenerationSettings):
    from .generate import collect, stream_generate

    result = collect(stream_generate(pair, ids, settings))
    stats = result.stats
    decode_s = (stats.generated_tokens - 1) / stats.decode_tokens_per_second if stats.decode_tokens_per_second else 0.0
    return result.token_ids, decode_s, stats


def run_bench(
    pair,
    prompts: list,
    *,
    max_tokens: int,
    block_sizes: list[int | str],
    trees: list[int | str] = (AUTO, OFF),
    repeats: int = 1,
    warmup: int = 1,
    baseline: bool = True,
    with_lookup: bool = False,
    other_pair=None,
    log=None,
) -> dict:
    from .generate import encode_prompt, verify_costs, width_histogram

    log = log or sys.stderr
    if pair.drafter is None and block_sizes:
        raise GlimmerError(
            "this bundle has no drafter: nothing speculative to measure (pass --drafter or --prompt-lookup)"
        )
    encoded = [encode_prompt(pair.tokenizer, p) for p in prompts]
    spec = spec_methods(block_sizes, trees)
    added = {LOOKUP_ALONE: lookup_pair(pair)} if with_lookup else {}  # methods with a pair of their own
    added |= {OTHER_DRAFTER: other_pair} if other_pair is not None else {}
    methods = (["mlx_lm"] if baseline else []) + ["plain"] + spec + list(added)
    pairs = {m: pair for m in methods} | added
    results = {m: Measurement(m) for m in methods}
    first_width = [m for m in spec if m.startswith(method_name(block_sizes[0], ""))] if spec else []
    for ids in encoded[:warmup]:
        for m in first_width + list(added):  # the first width with each tree setting, and the added methods
            time_ours(pairs[m], ids, method_settings(m, 16))
        time_ours(pair, ids, method_settings("plain", 16))
    for rep in range(repeats):
        for n, ids in enumerate(encoded):
            reference = None
            for m in methods:
                if m == "mlx_lm":
                    toks, dt = time_mlx_lm(pair, ids, max_tokens)
                    results[m].add(max(len(toks) - 1, 0), dt)
                else:
                    toks, dt, stats = time_ours(pairs[m], ids, method_settings(m, max_tokens))
                    results[m].add(
                        max(len(toks) - 1, 0), dt, stats.target_forwards, stats.acceptance_lengths, stats.verify_widths
                    )
                    results[m].add_rounds(stats)
                if reference is None:
                    reference = toks
                elif toks != reference[: len(toks)] and reference != toks[: len(reference)]:
                    results[m].mismatches += 1
                    results[m].divergences.append(divergence_report(pair, ids, reference, toks, m, n + 1))
            so_far = ", ".join(f"{m} {r.tokens_per_second:.1f}" for m, r in results.items())
            print(
                f"[bench] repeat {rep + 1}/{repeats} prompt {n + 1}/{len(encoded)}: tok/s so far {so_far}",
                file=log,
                flush=True,
            )
    plain = results["plain"].per_prompt_tokens_per_second
    other = {OTHER_DRAFTER: portable_path(other_pair.drafter_path)} if other_pair is not None else {}
    return {
        "environment": environment(pair) | other,
        "max_tokens": max_tokens,
        "prompts": len(encoded),
        "repeats": repeats,
        "trees": list(trees),
        # seconds per context band and width (null: never measured there), after the run's rounds refined them
        "verify_cost": {str(w): cost.to_dict() for w, cost in sorted(verify_costs(pair).items())},
        "results": {
            m: {
                **asdict(r),
                "tokens_per_second": r.tokens_per_second,
                "mean_acceptance": r.mean_acceptance,
                "mean_tokens_verified": r.mean_tokens_verified,
                "mean_accepted_depth": r.mean_accepted_depth,
                "median_speedup_over_plain": median_speedup(r.per_prompt_tokens_per_second, plain),
                "verify_width_histogram": width_histogram(r.widths),
            }
            for m, r in results.items()
        },
    }


def format_table(report: dict) -> str:
    """A row per method (plain, then each speculative one with its speed-up over plain), then mlx-lm's speed
    and whether every output was the same."""
    res = report["results"]
    plain = res["plain"]["tokens_per_second"]
    env = report["environment"]
    lines = [
        f"device {env['device']}, drafter {env['drafter_kind']}",
        "| method | tok/s | speed-up | median speed-up | mean acceptance | verified/round | depth | trees | "
        "target forwards/token |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, r in res.items():
        if m == "mlx_lm":
            continue
        per_token = r["target_forwards"] / max(r["tokens"], 1)
        speedup = r["tokens_per_second"] / plain if plain else 0.0
        median = 1.0 if m == "plain" else r["median_speedup_over_plain"]
        rounds = len(r["acceptance"])
        lines.append(
            f"| {m} | {r['tokens_per_second']:.1f} | {speedup:.2f}x | {median:.2f}x | {r['mean_acceptance']:.2f} | "
            f"{r['mean_tokens_verified']:.1f} | {r['mean_accepted_depth']:.2f} | {r['tree_rounds']}/{rounds} | "
            f"{per_token:.3f} |"
        )
    for m, r in res.items():
        if m.startswith(method_name(AUTO, "")) or m in (LOOKUP_ALONE, OTHER_DRAFTER):
            lines.append(f"\n{m} verify widths (width: rounds): {r['verify_width_histogram']}")
        if r.get("accepted_from"):
            sources = ", ".join(f"{k} {n}" for k, n in sorted(r["accepted_from"].items()))
            lines.append(f"{m} accepted paths from: {sources}")
    if "mlx_lm" in res:
        base = res["mlx_lm"]["tokens_per_second"]
        lines.append(
            f"\nmlx_lm.stream_generate {base:.1f} tok/s; our plain path {plain:.1f} tok/s ({plain / base:.3f}x of mlx-lm)"
        )
    bad = {m: r["mismatches"] for m, r in res.items() if r["mismatches"]}
    lines.append("outputs identical across methods" if not bad else f"OUTPUT MISMATCHES: {bad}")
    if bad:
        from .divergence import format_divergence

        lines += [
            format_divergence(m, d["prompt"], d)
            for m, r in res.items()
            for d in r.get("divergences", ())
            if d.get("tokens")
        ]
    return "\n".join(lines)


def divergence_report(
    pair, prompt: list[int], reference: list[int], tokens: list[int], method: str, index: int
) -> dict:
    """A mismatch against the first method's tokens: where, and both kernels' logit margins there (a 1-row step,
    and a verify as wide as `method`'s: its width, the drafter's block for auto, N + 1 rows for a tree of N), so a
    near-tie reads as a tie."""
    from .divergence import explain_divergence, mlx_dtype

    settings = method_settings(method, 1)
    width = settings.block_size if not settings.auto else (pair.drafter.block_size if pair.drafter else 16)
    if isinstance(settings.tree, int):  # a tree of N nodes verifies N + 1 rows
        width = settings.tree + 1
    d = explain_divergence(
        pair.target, mlx_dtype(pair), prompt, reference, tokens, max(width, 2), pair.tokenizer.decode
    )
    return {"prompt": index, **(d or {"position": None, "tokens": None, "note": "one output is a prefix of the other"})}


def add_bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="measure plain vs speculative tokens/s side by side",
        description="Plain vs speculative decoding on the same target, interleaved per prompt, greedy. Prints "
        "a row per method (plain, then each speculative width and tree setting: `method | tok/s | speed-up | median "
        "speed-up | mean acceptance | verified/round | depth | trees | target forwards/token`) and writes JSON.",
    )
    p.add_argument("bundle", nargs="?", help="bundle or model directory (default: the embedded demo pair)")
    p.add_argument(
        "--prompts", default=str(DATA_DIR / "prompts_heldout.jsonl"), help="JSONL prompts (default: held-out set)"
    )
    p.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="how many prompts, from the top of the file (default 3; 8 with --full)",
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None, help="tokens per answer (default 64; 128 with --full)"
    )
    p.add_argument("--full", action="store_true", help="the full set: 8 prompts x 128 tokens")
    p.add_argument(
        "--block-sizes",
        default=None,
        help="comma-separated verify widths (whole numbers >= 1, capped at the drafter's block size) and/or "
        "'auto' (default: auto and the drafter's block size)",
    )
    p.add_argument(
        "--trees",
        default="auto,off",
        help="comma-separated draft-tree settings, each 'auto', 'off' or a number of nodes (1 to 63); every "
        "verify width runs once per setting, except that a fixed width runs 'auto' as 'off' (it verifies chains) "
        "and a number of nodes with width auto only (the tree sets the width) (default: auto,off)",
    )
    p.add_argument(
        "--sweep-block-size",
        action="store_true",
        help="every fixed width from 2 to the drafter's block size, and auto, side by side",
    )
    p.add_argument("--repeats", type=positive_int, default=1, help="passes over the prompts (default 1)")
    p.add_argument("--warmup", type=nonnegative_int, default=1, help="warm-up prompts (default 1; 0 = none)")
    p.add_argument("--no-baseline", action="store_true", help="skip mlx_lm.stream_generate")
    p.add_argument(
        "--with-lookup",
        action="store_true",
        help="also run n-gram prompt lookup alone (as --prompt-lookup --block-sizes auto) as method 'lookup', "
        "interleaved with the others",
    )
    p.add_argument(
        "--with-drafter",
        default=None,
        metavar="DIR",
        help="also run the default settings with the drafter in DIR on the same target as method "
        "'other_drafter', interleaved per prompt with the others: two drafters compared under the same load",
    )
    p.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    p.add_argument("--json-out", default=None, help="write the JSON report here")
    p.add_argument(
        "--note",
        default=None,
        help="what else ran on the machine, or anything a reader of the JSON should know (stored as 'note'; the "
        "load averages before and after the run are stored beside it)",
    )
    add_drafter_flags(p)


def block_sizes(args) -> list[int | str] | None:
    """`--block-sizes` as a list ('auto' and whole numbers >= 1), or None when not given."""
    if not args.block_sizes:
        return None
    try:
        sizes = [x if x == AUTO else int(x) for x in args.block_sizes.split(",")]
    except ValueError:
        sizes = None
    if sizes is None or any(x != AUTO and x < 1 for x in sizes):
        raise GlimmerError(
            f"bench: --block-sizes: {args.block_sizes!r} is not a comma-separated list of whole numbers >= 1 and 'auto'"
        )
    return list(dict.fromkeys(sizes))


def tree_settings(args) -> list[int | str]:
    """`--trees` as a list ('auto', 'off' and whole numbers of nodes)."""
    try:
        trees = [tree_arg(x) for x in args.trees.split(",")]
    except argparse.ArgumentTypeError as e:
        raise GlimmerError(f"bench: --trees: {args.trees!r}: each {e}") from None
    return list(dict.fromkeys(trees))


def check_bench_flags(args) -> None:
    """Every `bench` flag, before anything heavy is imported (the numbers are checked by their argparse types)."""
    from .files import check_model_dir, check_pair_dirs
    from .flags import check_drafter_flags

    check_drafter_flags(args, "bench")
    block_sizes(args)
    tree_settings(args)
    if args.sweep_block_size and args.block_sizes:
        raise GlimmerError("bench: --sweep-block-size and --block-sizes exclude each other")
    if args.with_lookup and args.prompt_lookup:
        raise GlimmerError(
            "bench: --with-lookup adds prompt lookup beside the drafter; with --prompt-lookup it is there"
        )
    if args.with_drafter is not None:
        check_model_dir(Path(args.with_drafter), "drafter")
    if not Path(args.prompts).is_file():
        raise GlimmerError(f"bench: --prompts {args.prompts}: prompt file not found")
    if args.json_out and Path(args.json_out).is_dir():
        raise GlimmerError(f"bench: --json-out {args.json_out}: is a directory")
    if args.bundle is not None:
        check_pair_dirs(args.bundle, args.drafter, use_drafter=not args.prompt_lookup)
    elif args.drafter is not None and not args.prompt_lookup:
        check_model_dir(Path(args.drafter), "drafter")


def cmd_bench(args, open_pair) -> int:
    from .distill.data import load_prompts
    from .generate import widest_width
    from .loading import with_drafter

    check_bench_flags(args)
    num_prompts = args.num_prompts or (8 if args.full else 3)
    max_tokens = args.max_tokens or (128 if args.full else 64)
    texts = load_prompts(Path(args.prompts))[:num_prompts]
    if not texts:
        raise GlimmerError(f"bench: --prompts {args.prompts}: no prompts in the file")
    prompts = texts if args.raw else [[{"role": "user", "content": t}] for t in texts]
    load_before = load_average()
    pair = open_pair(args.bundle, args.drafter, draft_k=args.draft_k, prompt_lookup=args.prompt_lookup)
    widest = widest_width(pair.drafter) if pair.drafter is not None else 1
    if args.sweep_block_size:
        sizes = [AUTO, *range(2, widest + 1)]
    else:
        sizes = block_sizes(args) or ([AUTO, pair.drafter.block_size] if pair.drafter is not None else [])
        # a fixed width wider than the drafter can fill runs as its block size (as in generate)
        sizes = list(dict.fromkeys(x if x == AUTO else min(x, widest) for x in sizes))
    report = run_bench(
        pair,
        prompts,
        max_tokens=max_tokens,
        block_sizes=sizes,
        trees=tree_settings(args),
        repeats=args.repeats,
        warmup=args.warmup,
        baseline=not args.no_baseline,
        with_lookup=args.with_lookup,
        other_pair=with_drafter(pair, args.with_drafter) if args.with_drafter is not None else None,
    )
    report["command"] = portable_path(shlex.join(["mlx-glimmer", *sys.argv[1:]]))
    report["note"] = args.note
    # runnable threads over 1/5/15 minutes, the run's own included: well above the core count, something else shared
    # the CPU with the run
    report["load_average"] = {"before": load_before, "after": load_average(), "cores": os.cpu_count()}
    print(format_table(report))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(report, indent=2))
    return 0
