"""How far the n-gram lookup's continuation agrees with plain greedy output, by the length of the n-gram it matched.

    python benchmarks/experiments/lookup_by_ngram.py [BUNDLE] [--max-tokens 128]
        [--out benchmarks/experiments/results/lookup_by_ngram.json]

Decodes the first 8 held-out prompts and the first 16 copy-heavy prompts (chat template) greedily with plain
decoding, then, at every answer position, asks the lookup that draft trees use (n-grams of 1 to 4 tokens over the
prompt and the answer so far; `--min-ngram 2` as trees' branch uses it) for up to 15 tokens after the anchor, as `auto` would, and counts how many of them
the answer goes on with. Per match length: positions with a match, the mean tokens kept, the share kept whole,
and the per-position conditional acceptance a_i (what `block_policy.AcceptanceModel` estimates). Why `auto` learns
the lookup's acceptance per match length (`block_policy.LookupAcceptance`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_glimmer.blas import ensure_fast_blas
from mlx_glimmer.distill.data import load_prompts
from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter
from mlx_glimmer.generate import collect, encode_prompt, stream_generate
from mlx_glimmer.loading import load
from mlx_glimmer.paths import DATA_DIR, cache_dir

SETS = (
    ("held-out", DATA_DIR / "prompts_heldout.jsonl", 8),
    ("copy-heavy", Path("benchmarks/prompts_copy_heavy.jsonl"), 16),
)
DRAFTS = 15


def agreement(prompt: list[int], answer: list[int], min_ngram: int) -> dict[int, list[int]]:
    """Per match length, the tokens kept at each answer position where the lookup found something."""
    lookup = PromptLookupDrafter(draft_k=DRAFTS, min_ngram=min_ngram)
    seq = prompt + answer
    lookup.observe(seq[: len(prompt) - 1], None)
    kept: dict[int, list[int]] = {}
    for i in range(len(prompt) - 1, len(seq) - 1):  # the anchor is seq[i]; the history is what precedes it
        match = lookup.indexed_match(seq[i], DRAFTS)
        if match.tokens:
            n = 0
            while n < len(match.tokens) and i + 1 + n < len(seq) and match.tokens[n] == seq[i + 1 + n]:
                n += 1
            kept.setdefault(match.ngram, []).append(n)
        lookup.observe([seq[i]], None)
    return kept


def summary(kept: list[int]) -> dict:
    rates = []
    for i in range(DRAFTS):
        judged = sum(k >= i for k in kept)
        rates.append(sum(k > i for k in kept) / judged if judged else None)
    return {
        "positions": len(kept),
        "mean_kept": sum(kept) / len(kept),
        "kept_whole_15": sum(k == DRAFTS for k in kept) / len(kept),
        "conditional_acceptance": rates[:8],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--min-ngram", type=int, default=1, help="the shortest match (default 1: single tokens too)")
    ap.add_argument("--out", default="benchmarks/experiments/results/lookup_by_ngram.json")
    args = ap.parse_args()
    ensure_fast_blas(cache_dir() / "blas")
    pair = load(args.bundle or str(cache_dir() / "demo"), use_drafter=False)
    report = {"max_tokens": args.max_tokens, "drafts": DRAFTS, "min_ngram": args.min_ngram, "sets": {}}
    for name, path, count in SETS:
        by_ngram: dict[int, list[int]] = {}
        for text in load_prompts(path)[:count]:
            prompt = encode_prompt(pair.tokenizer, [{"role": "user", "content": text}])
            answer = collect(stream_generate(pair, prompt, max_tokens=args.max_tokens, speculative=False))
            for n, kept in agreement(list(prompt), list(answer.token_ids), args.min_ngram).items():
                by_ngram.setdefault(n, []).extend(kept)
        report["sets"][name] = {"prompts": count, "by_ngram": {str(n): summary(k) for n, k in sorted(by_ngram.items())}}
        for n, row in report["sets"][name]["by_ngram"].items():
            print(f"{name}: {n}-gram matches at {row['positions']} positions, mean kept {row['mean_kept']:.2f}, "
                  f"kept whole {100 * row['kept_whole_15']:.0f}%", flush=True)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
