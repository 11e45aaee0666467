"""What `auto` expected of each shape and what its rounds gave, round by round.

    python benchmarks/experiments/policy_trace.py [BUNDLE] [--prompts FILE] [--first 0] [--count 16]
        [--max-tokens 128] [--out benchmarks/experiments/results/policy_trace.json]

Decodes held-out prompts (or those of `--prompts`, a JSONL file as `bench --prompts` reads; chat template, greedy)
under the default settings (`auto` widths, trees on) and records, for every round the policy chose, the expected
committed tokens (E) and predicted seconds (verify + drafting) of the shapes it weighed (plain, the chains, each
tree budget, the lookup's chains), the shape chosen, and then what the round kept and took (the results file keeps,
per round, the chosen shape's figures and those of a tree of 8 and a chain of 8). The summary compares, per shape
chosen, the mean E expected with the mean committed, and the seconds predicted with the seconds taken: where the
model's estimate of a shape is off, and by how much.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mlx_glimmer.blas import ensure_fast_blas
from mlx_glimmer.block_policy import Shape, WidthPolicy
from mlx_glimmer.cpu import chip_name
from mlx_glimmer.demo import demo_bundle
from mlx_glimmer.distill.data import load_prompts
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.generate import collect, encode_prompt, stream_generate
from mlx_glimmer.loading import load
from mlx_glimmer.paths import DATA_DIR, cache_dir


def name(shape: Shape) -> str:
    return f"tree{shape.width}" if shape.tree else f"lookup{shape.width}" if shape.lookup else f"chain{shape.width}"


def expectations(policy: WidthPolicy, context: int, found: int, ngram: int) -> dict[str, dict]:
    """E and predicted seconds of the plain step, every chain, every tree budget and the lookup's chains at hand:
    the policy's own rates and seconds (E = rate x seconds)."""
    costs = policy.cost.estimates(context)
    shapes = [Shape(w) for w in range(1, policy.max_width + 1)] + [Shape(b, tree=True) for b in policy.trees]
    shapes += [s for s in policy.shapes(found) if s.lookup]
    out = {}
    for shape, rate in policy.rates(context, found, ngram, shapes).items():
        seconds = policy.seconds(shape, context, costs)
        out[name(shape)] = {"E": rate * seconds, "seconds": seconds}
    return out


def traced(rounds: list[dict]):
    choose, observe = WidthPolicy.choose, WidthPolicy.observe_round

    def choose_traced(self, context, found=0, ngram=0):
        shape = choose(self, context, found, ngram)
        rounds.append({"context": context, "chosen": name(shape), "weighed": expectations(self, context, found, ngram)})
        return shape

    def observe_traced(self, shape, accepted, context, seconds, timed=True, **kw):
        if rounds and "accepted" not in rounds[-1] and rounds[-1]["chosen"] == name(shape):
            rounds[-1].update(accepted=accepted, seconds=seconds, timed=timed, chain_depth=kw.get("chain_depth", 0),
                              chain_kept=kw.get("chain_kept", 0))  # fmt: skip
        return observe(self, shape, accepted, context, seconds, timed, **kw)

    WidthPolicy.choose, WidthPolicy.observe_round = choose_traced, observe_traced


def summary(rounds: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in rounds:
        if "accepted" in r:
            by.setdefault(r["chosen"], []).append(r)
    out = {}
    for shape, rs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        timed = [r for r in rs if r["timed"]]
        out[shape] = {
            "rounds": len(rs),
            "E_expected": statistics.fmean(r["weighed"][shape]["E"] for r in rs) if shape in rs[0]["weighed"] else None,
            "committed": statistics.fmean(r["accepted"] + 1 for r in rs),
            "seconds_predicted": statistics.fmean(r["weighed"][shape]["seconds"] for r in timed) if timed else None,
            "seconds_taken": statistics.fmean(r["seconds"] for r in timed) if timed else None,
            # what the other shapes were expected to give on these same rounds
            "E_tree8_expected_here": statistics.fmean(r["weighed"]["tree8"]["E"] for r in rs)
            if "tree8" in rs[0]["weighed"] else None,
            "seconds_tree8_predicted_here": statistics.fmean(r["weighed"]["tree8"]["seconds"] for r in rs)
            if "tree8" in rs[0]["weighed"] else None,
        }  # fmt: skip
    return out


def compact(r: dict) -> dict:
    """A round as the results file keeps it: the weighed shapes cut to the chosen one, tree8 and chain8."""
    keep = {r["chosen"], "tree8", "chain8"} & set(r["weighed"])
    return {**r, "weighed": {k: r["weighed"][k] for k in sorted(keep)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--prompts", default=str(DATA_DIR / "prompts_heldout.jsonl"), help="a JSONL prompt file")
    ap.add_argument("--first", type=int, default=0, help="the first prompt")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="benchmarks/experiments/results/policy_trace.json")
    args = ap.parse_args()
    try:
        texts = load_prompts(Path(args.prompts))[args.first : args.first + args.count]
    except GlimmerError as e:
        raise SystemExit(f"error: --prompts {e}") from None
    ensure_fast_blas(cache_dir() / "blas")
    pair = load(args.bundle or str(demo_bundle()))
    rounds: list[dict] = []
    traced(rounds)
    per_prompt = []
    for i, text in enumerate(texts):
        prompt = encode_prompt(pair.tokenizer, [{"role": "user", "content": text}])
        start = len(rounds)
        result = collect(stream_generate(pair, prompt, max_tokens=args.max_tokens))
        per_prompt.append(
            {"prompt": args.first + i, "tokens": len(result.token_ids), "rounds": [compact(r) for r in rounds[start:]]}
        )
        print(
            f"prompt {args.first + i}: {len(result.token_ids)} tokens, {len(rounds) - start} chosen rounds", flush=True
        )
    report = {
        "cpu": chip_name(),
        "max_tokens": args.max_tokens,
        "prompt_file": Path(args.prompts).name,
        "prompts": [args.first, args.first + args.count],
        "summary": summary(rounds),
        "per_prompt": per_prompt,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
