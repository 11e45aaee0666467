"""Draft tree against draft chain at the same verify width: tokens committed per target forward, greedy.

    python benchmarks/tree_vs_chain.py [BUNDLE] [--prompts FILE] [--num-prompts N] [--max-tokens 128]
                                       [--width 8] [--json-out FILE] [--note TEXT]

For every prompt (default: the 75 held-out prompts, chat template applied as `mlx-glimmer bench` does), three
greedy runs in turn:
    plain   the target alone (speculative=False): the reference every output is checked against
    chain   a chain of W verified tokens every round (block_size=W, tree="off")
    tree    a tree of W verified tokens every round: W - 1 nodes under the anchor (tree=W-1), as deep as the
            drafter's block allows
Tokens per target forward = tokens committed by the target forwards after the prefill / those forwards
(sum of GenerationStats.acceptance_lengths / target_forwards; the prefill's first token is not counted, a stop
token is: as demo_acceptance.py counts it). Both speculative runs verify W tokens per forward, so their ratio
is what the tree buys per verify at equal width. Each output is compared with plain token for token.
Decode tok/s is recorded too, but on a shared machine compare tokens per forward, not speed.
Writes a JSON report (per prompt and totals, the command line, the environment, `--note`); prints a
progress line per prompt to stderr and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

METHODS = ("plain", "chain", "tree")


def width_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 2 <= value <= 64:
        raise argparse.ArgumentTypeError("must be a whole number in [2, 64] (the anchor and at least one draft)")
    return value


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be a whole number >= 1")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Draft tree against draft chain at the same verify width W, greedy: tokens committed per target "
        "forward, every output checked equal to plain decoding token for token.",
    )
    ap.add_argument("bundle", nargs="?", help="bundle directory (default: the demo pair, built on first use)")
    ap.add_argument(
        "--prompts", default=None, help="JSONL prompts (default: mlx_glimmer/data/prompts_heldout.jsonl, 75 prompts)"
    )
    ap.add_argument("--num-prompts", type=positive, default=None, help="the first N prompts of the file (default all)")
    ap.add_argument("--max-tokens", type=positive, default=128, help="tokens per answer (default 128)")
    ap.add_argument(
        "--width", type=width_arg, default=8, help="verified tokens per round, anchor included, for both (default 8)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="warm-up prompts, 16 tokens each method (default 1; 0 none)")
    ap.add_argument("--raw", action="store_true", help="prompts as plain text, no chat template")
    ap.add_argument(
        "--json-out",
        default="benchmarks/results/tree_vs_chain_demo.json",
        help="where the JSON report goes (default benchmarks/results/tree_vs_chain_demo.json)",
    )
    ap.add_argument("--note", default="", help="what else ran on the machine meanwhile (stored in the report)")
    return ap.parse_args(argv)


def method_settings(args) -> dict:
    from mlx_glimmer.settings import GenerationSettings

    base = GenerationSettings(max_tokens=args.max_tokens)
    return {
        "plain": base.updated(speculative=False),
        "chain": base.updated(block_size=args.width, tree="off"),
        "tree": base.updated(tree=args.width - 1),
    }


def run_one(pair, ids: list[int], settings) -> dict:
    from mlx_glimmer.generate import collect, stream_generate

    t0 = time.perf_counter()
    result = collect(stream_generate(pair, ids, settings))
    wall = time.perf_counter() - t0
    s = result.stats
    committed = sum(s.acceptance_lengths)
    return {
        "token_ids": result.token_ids,
        "text": result.text,
        "generated_tokens": s.generated_tokens,
        "target_forwards": s.target_forwards,
        "committed_after_prefill": committed,
        "tokens_per_forward": committed / s.target_forwards if s.target_forwards else 0.0,
        "decode_tokens_per_second": s.decode_tokens_per_second,
        "wall_s": wall,
        # every scalar figure the loop reports (new ones included as they appear), and the widths verified
        "stats": {k: v for k, v in s.to_dict().items() if not isinstance(v, list)},
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(rows: list[dict]) -> dict:
    totals = {}
    for m in METHODS:
        runs = [r["methods"][m] for r in rows]
        committed = sum(x["committed_after_prefill"] for x in runs)
        forwards = sum(x["target_forwards"] for x in runs)
        per = [x["tokens_per_forward"] for x in runs]
        equal = sum(x["equals_plain"] for x in runs)
        totals[m] = {
            "generated_tokens": sum(x["generated_tokens"] for x in runs),
            "committed_after_prefill": committed,
            "target_forwards": forwards,
            "tokens_per_forward": committed / forwards if forwards else 0.0,
            "per_prompt_median": statistics.median(per),
            "per_prompt_min": min(per),
            "per_prompt_max": max(per),
            "equal_to_plain": f"{equal}/{len(runs)}",
            "equal_to_plain_count": equal,
            "decode_tokens_per_second_median": statistics.median(x["decode_tokens_per_second"] for x in runs),
        }
    chain, tree = totals["chain"]["tokens_per_forward"], totals["tree"]["tokens_per_forward"]
    ratios = [r["tree_over_chain"] for r in rows if r["tree_over_chain"] is not None]
    return {
        "methods": totals,
        "tree_over_chain_tokens_per_forward": tree / chain if chain else None,
        "tree_over_chain_per_prompt_median": statistics.median(ratios) if ratios else None,
        "tree_over_chain_per_prompt_min": min(ratios) if ratios else None,
        "all_equal_to_plain": all(totals[m]["equal_to_plain_count"] == len(rows) for m in ("chain", "tree")),
    }


def format_table(report: dict) -> str:
    t = report["totals"]
    w = report["width"]
    label = {"plain": "plain", "chain": f"chain, width {w}", "tree": f"tree, {w - 1} nodes + anchor"}
    lines = [
        "| method | tokens/forward | per prompt median (min-max) | equal to plain | decode tok/s (median) |",
        "|---|---|---|---|---|",
    ]
    for m in METHODS:
        r = t["methods"][m]
        lines.append(
            f"| {label[m]} | {r['tokens_per_forward']:.3f} | {r['per_prompt_median']:.2f} "
            f"({r['per_prompt_min']:.2f}-{r['per_prompt_max']:.2f}) | {r['equal_to_plain']} | "
            f"{r['decode_tokens_per_second_median']:.1f} |"
        )
    ratio = t["tree_over_chain_tokens_per_forward"]
    med = t["tree_over_chain_per_prompt_median"]
    lines.append(
        f"\ntree / chain tokens per forward: {ratio:.3f}x overall, per prompt median {med:.3f}x"
        if ratio is not None and med is not None
        else "\ntree / chain tokens per forward: n/a (no chain forwards)"
    )
    lines.append(
        "outputs identical to plain" if t["all_equal_to_plain"] else "OUTPUT MISMATCHES AGAINST PLAIN (see rows)"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import DATA_DIR, cache_dir

    ensure_fast_blas(cache_dir() / "blas")  # as the `mlx-glimmer` command does: re-executes with OpenBLAS on Linux

    prompts_path = Path(args.prompts) if args.prompts else DATA_DIR / "prompts_heldout.jsonl"
    if not prompts_path.is_file():
        print(f"tree_vs_chain: --prompts {prompts_path}: prompt file not found", file=sys.stderr)
        return 2
    if Path(args.json_out).is_dir():
        print(f"tree_vs_chain: --json-out {args.json_out}: is a directory", file=sys.stderr)
        return 2

    import mlx_glimmer
    from mlx_glimmer.bench import environment, portable_path
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.generate import encode_prompt

    settings = method_settings(args)  # checked before the model loads
    texts = load_prompts(prompts_path)[: args.num_prompts]
    if not texts:
        print(f"tree_vs_chain: --prompts {prompts_path}: no prompts in the file", file=sys.stderr)
        return 2
    kinds = [json.loads(line).get("kind") if line.strip().startswith("{") else None for line in _lines(prompts_path)]
    pair = mlx_glimmer.load(args.bundle or demo_bundle())
    if pair.drafter is None:
        print("tree_vs_chain: this bundle has no drafter: nothing speculative to measure", file=sys.stderr)
        return 2
    encoded = [encode_prompt(pair.tokenizer, t if args.raw else [{"role": "user", "content": t}]) for t in texts]

    warm = {m: s.updated(max_tokens=16) for m, s in settings.items()}
    for ids in encoded[: max(args.warmup, 0)]:
        for m in METHODS:
            run_one(pair, ids, warm[m])

    rows = []
    for n, (text, ids) in enumerate(zip(texts, encoded)):
        runs = {m: run_one(pair, ids, settings[m]) for m in METHODS}
        plain = runs["plain"]["token_ids"]
        for m in METHODS:
            r = runs[m]
            r["equals_plain"] = r["token_ids"] == plain
            r["first_difference"] = None if r["equals_plain"] else first_difference(plain, r["token_ids"])
            if m != "plain":
                del r["token_ids"]  # equal: plain's ids say it; different: first_difference and the text say where
        chain_tpf, tree_tpf = runs["chain"]["tokens_per_forward"], runs["tree"]["tokens_per_forward"]
        rows.append(
            {
                "index": n + 1,
                "kind": kinds[n] if n < len(kinds) else None,
                "prompt": text,
                "prompt_tokens": len(ids),
                "tree_over_chain": tree_tpf / chain_tpf if chain_tpf else None,
                "methods": runs,
            }
        )
        same = "".join("=" if runs[m]["equals_plain"] else "!" for m in ("chain", "tree"))
        print(
            f"[tree_vs_chain] {n + 1}/{len(encoded)}: tokens/forward chain {chain_tpf:.2f} tree {tree_tpf:.2f} "
            f"({rows[-1]['tree_over_chain'] or 0:.2f}x), equal to plain (chain, tree) {same}, "
            f"tok/s plain {runs['plain']['decode_tokens_per_second']:.1f} "
            f"chain {runs['chain']['decode_tokens_per_second']:.1f} tree {runs['tree']['decode_tokens_per_second']:.1f}",
            file=sys.stderr,
            flush=True,
        )

    report = {
        "what": "draft tree against draft chain at the same verify width, greedy; tokens per target forward",
        "definition": "tokens_per_forward = sum(acceptance_lengths) / target_forwards (after the prefill)",
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "note": args.note,
        "environment": environment(pair),
        "prompts_file": portable_path(prompts_path),
        "prompts": len(rows),
        "max_tokens": args.max_tokens,
        "chat_template": not args.raw,
        "width": args.width,
        "settings": {m: s.flat() for m, s in settings.items()},
        "totals": summarise(rows),
        "rows": rows,
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0  # as bench: a mismatch is in the table and the report, and a script running several steps goes on


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
