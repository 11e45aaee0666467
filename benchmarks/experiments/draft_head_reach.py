"""Whether a drafter reaches past its draft vocabulary: its greedy drafts through its own head against the
target's full head.

    .venv/bin/python benchmarks/experiments/draft_head_reach.py [--drafter DIR] [--prompts 75]
        [--out benchmarks/experiments/results/draft_head_reach.json]

A drafter trained with `--draft-vocab N` scores its hidden states against N rows of the target's head; the other
rows it never saw in training. The target's whole head can score the same hidden states at inference (a larger
product per draft position), so the tokens outside the draft vocabulary, one held-out position in eleven for
the shipped drafter, could be drafted without retraining if the hidden states reach them. Teacher-forced on the
demo target's greedy answers to the held-out prompts (the runtime drafter on the true prefix, as
`drafter_diagnosis.py` part (d) runs it): at every anchor, one drafter forward, its block's greedy tokens through
each head; per position the share right, the share of the full head's picks outside the draft vocabulary, and
the tokens a chain of 8 or 16 would commit (1 + the run of right drafts), averaged over anchors.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # drafter_diagnosis and tree_scoring, beside this script
SHOWN = 4  # positions listed in the results


def main(argv=None) -> int:
    from mlx_glimmer.demo import SHIPPED_DRAFTER

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=str(SHIPPED_DRAFTER), help="drafter directory (default: the shipped one)")
    ap.add_argument("--prompts", type=int, default=75, help="held-out prompts, the first N (default 75)")
    ap.add_argument("--cache", default=str(ROOT / "runs" / "drafter_diagnosis"), help="held-out answers' cache")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "experiments" / "results" / "draft_head_reach.json"))
    args = ap.parse_args(argv)

    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.paths import cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    import mlx.core as mx
    from drafter_diagnosis import each_anchor, heldout_answers, shown
    from tree_scoring import chain_committed

    import mlx_glimmer
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.paths import DATA_DIR

    pair = mlx_glimmer.load(demo_bundle(), drafter=Path(args.drafter).resolve())
    drafter, target = pair.drafter, pair.target
    if drafter.draft_vocab is None:
        raise SystemExit(f"error: {args.drafter} drafts over the full vocabulary: nothing to compare")
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.prompts]
    answers, _ = heldout_answers(pair, prompts, 128, Path(args.cache))
    vocab = np.array(drafter.draft_vocab)
    inside = np.zeros(target.vocab_size, dtype=bool)
    inside[vocab] = True
    D = drafter.block_size - 1
    own, full, truth = [], [], []
    for _, a, padded in each_anchor(pair, answers, "heads"):
        hidden = drafter.block_hidden(int(padded[a]), D)[1:]
        own.append(vocab[np.array(mx.argmax(drafter.draft_logits(hidden), axis=-1))])
        full.append(np.array(mx.argmax(target.head(hidden), axis=-1)))
        pos = a + np.arange(1, D + 1)
        truth.append(np.where(pos < len(padded) - D - 1, padded[pos], -1))
    truth = np.stack(truth)
    present = truth >= 0

    def measured(picks: np.ndarray) -> dict:
        right = (picks == truth) & present
        return {
            "accuracy": [round(float(right[:, k].sum() / present[:, k].sum()), 4) for k in range(SHOWN)],
            "outside_draft_vocab": [round(float((~inside[picks[:, k]]).mean()), 4) for k in range(SHOWN)],
            "chain8_tokens_per_forward": round(float(chain_committed(picks[:, :, None], truth, 7).mean()), 4),
            "chain16_tokens_per_forward": round(float(chain_committed(picks[:, :, None], truth, D).mean()), 4),
        }

    results = {
        "command": " ".join(["python", Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "drafter": shown(Path(args.drafter).resolve()),
        "draft_vocab": int(len(vocab)),
        "heldout_answers": len(answers),
        "anchors": int(len(truth)),
        "truth_outside_draft_vocab": [
            round(float((present[:, k] & ~inside[np.maximum(truth[:, k], 0)]).sum() / present[:, k].sum()), 4)
            for k in range(SHOWN)
        ],
        "draft_head": measured(np.stack(own)),
        "full_head": measured(np.stack(full)),
    }
    print(json.dumps(results, indent=2))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
