"""Replay `auto`'s choices on recorded greedy answers: the default against prompt lookup alone, without timing noise.

    python benchmarks/experiments/lookup_policy_replay.py [BUNDLE] [--prompts benchmarks/prompts_copy_heavy.jsonl]
        [--num-prompts 24] [--select 17-24] [--seeds 12] [--lookup-growth 4,off]
        [--answers ANSWERS.json] [--out benchmarks/experiments/results/lookup_policy_replay.json]

Decodes each prompt (chat template) greedily with plain decoding once (or reads the answers `--answers` saved), then
replays the width policy round by round on each answer, in prompt order as `bench` runs them (after a 16-token
warm-up on the first prompt, each generation starting from the last one's policy):

- the default (`block_policy.width_policy` with tree budgets): a lookup chain keeps exactly the drafts the answer
  goes on with (the lookup of draft trees, over the prompt and the answer so far); a drafter chain or tree keeps
  each draft with a fixed probability (`--drafter-acceptance`, `--tree-acceptance`), drawn per seed;
- prompt lookup alone (`--prompt-lookup`, 10 drafts at most, chains only), exact as above.

A round takes the verify cost of its width from `verify_cost_by_width.json` (after 300 tokens of context), plus a
fixed drafting time for drafter rounds. Speed is committed tokens over summed round times, per prompt; the figure
is the default's over lookup alone's, averaged over seeds. In a real run the same choices move by 5-15% a prompt
with the machine's load and with which early bets paid; here only the drafter's draws vary. `--lookup-growth`
replays the policy with `block_policy.LOOKUP_GROWTH` set to each value ("off": no bound on lookup chains). Choose
on the `--select` prompts, report on all.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from mlx_glimmer import block_policy
from mlx_glimmer.block_policy import TREE_WIDTHS, Shape, width_policy
from mlx_glimmer.distill.data import load_prompts
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.verify_cost import MEASURED_WIDTHS, VerifyCost

COSTS = Path("benchmarks/experiments/results/verify_cost_by_width.json")
WARM_UP = 16  # tokens of the first prompt's answer `bench` decodes before timing
DRAFTER_SECONDS, TREE_SECONDS, LOOKUP_SECONDS = 0.006, 0.012, 0.001  # drafting and host time per round, as traced
LOOKUP_ALONE_DRAFTS = 10


def answers_of(bundle: str | None, prompts: list[str], max_tokens: int) -> list[dict]:
    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.generate import collect, encode_prompt, stream_generate
    from mlx_glimmer.loading import load
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    pair = load(bundle or str(cache_dir() / "demo"), use_drafter=False)
    out = []
    for n, text in enumerate(prompts, 1):
        prompt = encode_prompt(pair.tokenizer, [{"role": "user", "content": text}])
        answer = collect(stream_generate(pair, prompt, max_tokens=max_tokens, speculative=False))
        out.append({"prompt": list(map(int, prompt)), "answer": list(map(int, answer.token_ids))})
        print(f"[replay] answer {n}/{len(prompts)}: {len(answer.token_ids)} tokens", flush=True)
    return out


def cost_table(ms_by_width: dict[int, float], max_width: int) -> VerifyCost:
    """A table measured at the widths `auto` measures, from the per-width timings."""
    cost = VerifyCost(max_width)
    for row in cost.seconds:
        row[:] = [
            ms_by_width[w] / 1000 if w in MEASURED_WIDTHS or w == max_width else None for w in range(1, max_width + 1)
        ]
    return cost


def kept(drafts: list[int], seq: list[int], at: int) -> int:
    n = 0
    while n < len(drafts) and at + 1 + n < len(seq) and drafts[n] == seq[at + 1 + n]:
        n += 1
    return n


def warmed(answers: list[dict]) -> list[dict]:
    first = answers[0]
    return [{"prompt": first["prompt"], "answer": first["answer"][:WARM_UP]}] + answers


def replay_default(answers: list[dict], ms: dict[int, float], rng: random.Random, accept: float, tree_accept: float):
    """Tokens per second of the default on each answer (the warm-up's left out)."""
    policy, speeds = None, []
    for item in warmed(answers):
        seq, at = item["prompt"] + item["answer"], len(item["prompt"])
        policy = width_policy(16, cost_table(ms, 32), policy, TREE_WIDTHS)
        lookup = PromptLookupDrafter(draft_k=policy.lookup.size, min_ngram=1)
        lookup.observe(seq[:at], None)
        seconds = 0.0
        while at < len(seq) - 1:
            left = len(seq) - 1 - at
            match = lookup.indexed_match(seq[at], min(policy.lookup.size, left))
            shape = policy.choose(at, len(match.tokens), match.ngram)
            width = min(shape.width, left + 1)
            if shape.lookup:
                accepted = kept(match.tokens[: width - 1], seq, at)
                took = ms[width] / 1000 + LOOKUP_SECONDS
                policy.observe_round(
                    shape, accepted, at, took, lookup_offered=width - 1, lookup_kept=accepted, lookup_ngram=match.ngram
                )
            elif width == 1:
                accepted, took = 0, ms[1] / 1000
                policy.observe_round(shape, 0, at, took)
            else:
                rate = tree_accept if shape.tree else accept
                accepted = 0
                while accepted < min(width - 1, left - 1) and rng.random() < rate:
                    accepted += 1
                took = ms[shape.width if shape.tree else width] / 1000 + (
                    TREE_SECONDS if shape.tree else DRAFTER_SECONDS
                )
                policy.observe_round(shape, accepted, at, took)
            lookup.observe(seq[at : at + accepted + 1], None)
            seconds += took
            at += accepted + 1
        speeds.append((len(item["answer"]) - 1) / seconds)
    return speeds[1:]


def replay_lookup_alone(answers: list[dict], ms: dict[int, float]):
    """Tokens per second of prompt lookup alone (chains of its own drafts, `auto`) on each answer."""
    policy, speeds = None, []
    for item in warmed(answers):
        seq, at = item["prompt"] + item["answer"], len(item["prompt"])
        policy = width_policy(LOOKUP_ALONE_DRAFTS + 1, cost_table(ms, LOOKUP_ALONE_DRAFTS + 1), policy)
        lookup = PromptLookupDrafter(draft_k=LOOKUP_ALONE_DRAFTS)
        lookup.observe(seq[:at], None)
        seconds = 0.0
        while at < len(seq) - 1:
            left = len(seq) - 1 - at
            shape = policy.choose(at)
            width = min(shape.width, left + 1)
            accepted, took = 0, ms[1] / 1000
            if width > 1:
                drafts = lookup.indexed_lookup(seq[at], width - 1)
                accepted, took = kept(drafts, seq, at), ms[len(drafts) + 1] / 1000 + LOOKUP_SECONDS
            policy.observe_round(Shape(width), accepted, at, took)
            lookup.observe(seq[at : at + accepted + 1], None)
            seconds += took
            at += accepted + 1
        speeds.append((len(item["answer"]) - 1) / seconds)
    return speeds[1:]


def prompt_range(text: str) -> set[int]:
    first, _, last = text.partition("-")
    return set(range(int(first), int(last or first) + 1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--prompts", default="benchmarks/prompts_copy_heavy.jsonl")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--select", default="17-24", help="the prompts (1-based range) to choose a setting on")
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--drafter-acceptance", type=float, default=0.45)
    ap.add_argument("--tree-acceptance", type=float, default=0.6)
    ap.add_argument("--lookup-growth", default=f"{block_policy.LOOKUP_GROWTH},off")
    ap.add_argument("--answers", default=None, help="a JSON of greedy answers: read if it exists, else written")
    ap.add_argument("--out", default="benchmarks/experiments/results/lookup_policy_replay.json")
    args = ap.parse_args()
    prompts = load_prompts(Path(args.prompts))[: args.num_prompts]
    saved = Path(args.answers) if args.answers else None
    if saved is not None and saved.is_file():
        answers = json.loads(saved.read_text())
    else:
        answers = answers_of(args.bundle, prompts, args.max_tokens)
        if saved is not None:
            saved.write_text(json.dumps(answers))
    ms = {int(w): v for w, v in json.loads(COSTS.read_text())["contexts"]["300"]["ms_by_width"].items()}
    alone = replay_lookup_alone(answers, ms)
    chosen = prompt_range(args.select)
    report = {"command": " ".join(["python benchmarks/experiments/lookup_policy_replay.py", *sys.argv[1:]]),
              "prompts": args.prompts, "num_prompts": len(answers), "seeds": args.seeds, "select": args.select,
              "drafter_acceptance": args.drafter_acceptance, "tree_acceptance": args.tree_acceptance,
              "lookup_alone_tokens_per_second": alone, "variants": {}}  # fmt: skip
    default_growth = block_policy.LOOKUP_GROWTH
    for growth in args.lookup_growth.split(","):
        block_policy.LOOKUP_GROWTH = 10**9 if growth == "off" else int(growth)
        runs = [replay_default(answers, ms, random.Random(s), args.drafter_acceptance, args.tree_acceptance)
                for s in range(args.seeds)]  # fmt: skip
        shares = [statistics.mean(run[i] for run in runs) / alone[i] for i in range(len(answers))]
        picked = [s for i, s in enumerate(shares, 1) if i in chosen]
        rest = [s for i, s in enumerate(shares, 1) if i not in chosen]
        summary = {
            "default_over_lookup_alone": shares,
            "selection": {"geometric_mean": statistics.geometric_mean(picked), "worst": min(picked)},
            "others": {
                "geometric_mean": statistics.geometric_mean(rest),
                "worst": min(rest),
                "more_than_5_percent_behind": sum(s < 0.95 for s in rest),
            },
        }
        report["variants"][f"lookup_growth_{growth}"] = summary
        print(
            f"lookup growth {growth:>4}: selection geo {summary['selection']['geometric_mean']:.3f} worst "
            f"{summary['selection']['worst']:.3f} | others geo {summary['others']['geometric_mean']:.3f} worst "
            f"{summary['others']['worst']:.3f}, {summary['others']['more_than_5_percent_behind']} more than 5% behind"
        )
    block_policy.LOOKUP_GROWTH = default_growth
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
