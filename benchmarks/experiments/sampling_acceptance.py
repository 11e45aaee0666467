"""What judging sampled drafts by the positional walk costs against rejection sampling: tokens per target forward.

    python benchmarks/experiments/sampling_acceptance.py [--temperatures 0.8,1.0] [--num-prompts 16]
        [--max-tokens 128] [--seed 7] [--rules rejection,walk,...]
        [--out benchmarks/experiments/results/sampling_acceptance.json]

The demo pair (the demo target, the shipped drafter) decodes the first `--num-prompts` held-out prompts (chat
template) at each temperature, seed `--seed`, block 16 chains and trees of 8 nodes, four ways:
  walk            the shipped rule: a draft is kept where it equals the target's own sample of its position
                  (`noise.py`), the drafter sampling its draft with the same positional noise;
  walk (own noise) the same rule, the drafter sampling with noise of its own (another seed): what sharing the
                  noise buys;
  rejection       speculative rejection sampling (Leviathan et al.) on chains, the drafter sampling with noise
                  of its own: the rule the walk replaced (a copy here: the package no longer has it);
  tree 8          the walk on trees of 8 nodes (trees always walked).
Tokens committed per target forward (counts, not time: it may run while other work loads the machine), and
for the walk, how many answers equal plain decoding's at the same seed (all of them, by construction). The
results file names the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "mlx_glimmer" / "data" / "demo_drafter"
OWN_NOISE = 0x5BD1E995  # the drafter's own noise: its seed xor this
RULES = ("rejection", "walk", "walk (own noise)", "tree 8")


class DrafterNoise:
    """The drafter with noise of its own instead of the target's, remembering its last draft's distributions."""

    def __init__(self, drafter):
        self._drafter, self.last_probs = drafter, None

    def __getattr__(self, name):
        return getattr(self._drafter, name)

    def propose(self, anchor, count, params, noise):
        from mlx_glimmer.noise import Noise

        own = noise if noise is None or params.greedy else Noise(noise.seed ^ OWN_NOISE, noise.start)
        draft, self.last_probs = self._drafter.propose(anchor, count, params, own)
        return draft, self.last_probs


def rejection_verdict(drafter: DrafterNoise):
    """A chain judge by rejection sampling (the draft's distributions from `drafter`), as `speculative._verdict`."""
    import mlx.core as mx

    from mlx_glimmer import speculative

    walk = speculative._verdict

    def judge(target, logits, draft, params, noise):
        n = draft.shape[0]
        if params.greedy or n == 0:
            return walk(target, logits, draft, params, noise)
        key = mx.random.key((noise.seed * 1_000_003 + noise.start) % (1 << 62))
        k_accept, k_token = mx.random.split(key)
        p_all = target.sampling.probabilities(logits, params)
        q_all = drafter.last_probs
        rows = mx.arange(n)
        p, q = p_all[rows, draft], q_all[rows, draft]
        keep = (mx.random.uniform(shape=(n,), key=k_accept) * q < p).astype(mx.int32)
        accepted = mx.cumprod(keep).sum()
        residual = mx.concatenate([mx.maximum(p_all[:n] - q_all, 0.0), p_all[n:]], axis=0)[accepted]
        total = residual.sum()
        residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), p_all[accepted])
        token = mx.random.categorical(mx.log(residual), key=k_token)
        return mx.stack([accepted, token.astype(mx.int32)])

    return judge


def measure(pair, prompts, max_tokens, temperature, seed, how: str) -> dict:
    import mlx_glimmer
    from mlx_glimmer import speculative

    own = DrafterNoise(pair.drafter)
    use = pair if how in ("walk", "tree 8") else replace(pair, drafter=own)
    walk = speculative._verdict
    if how == "rejection":
        speculative._verdict = rejection_verdict(own)
    committed = forwards = equal = 0
    per_prompt = []
    try:
        for text in prompts:
            msgs = [{"role": "user", "content": text}]
            kwargs = dict(max_tokens=max_tokens, temperature=temperature, seed=seed)
            shape = dict(block_size="auto", tree=8) if how == "tree 8" else dict(block_size=16, tree="off")
            r = mlx_glimmer.generate(use, msgs, **kwargs, **shape)
            if how != "rejection":
                equal += r.token_ids == mlx_glimmer.generate(pair, msgs, **kwargs, speculative=False).token_ids
            lengths = r.stats.acceptance_lengths
            committed += sum(lengths)
            forwards += r.stats.target_forwards
            per_prompt.append(round(sum(lengths) / max(r.stats.target_forwards, 1), 3))
            print(f"  T={temperature} {how}: {len(per_prompt)}/{len(prompts)} {per_prompt[-1]}", file=sys.stderr)
    finally:
        speculative._verdict = walk
    row = {"temperature": temperature, "rule": how, "tokens_per_forward": round(committed / forwards, 3)}
    if how != "rejection":
        row["equal_to_plain_at_the_seed"] = f"{equal}/{len(prompts)}"
    return {**row, "per_prompt": per_prompt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="0.8,1.0")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--rules", default=",".join(RULES), help=f"comma-separated, of: {', '.join(RULES)}")
    ap.add_argument("--drafter", default=str(SHIPPED))
    ap.add_argument("--out", default=str(ROOT / "benchmarks/experiments/results/sampling_acceptance.json"))
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    if not set(rules) <= set(RULES):
        ap.error(f"--rules: each of {', '.join(RULES)}")

    import mlx_glimmer
    from mlx_glimmer.blas import ensure_fast_blas
    from mlx_glimmer.cpu import cpu_facts
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.distill.data import load_prompts
    from mlx_glimmer.paths import DATA_DIR, cache_dir

    ensure_fast_blas(cache_dir() / "blas")
    prompts = load_prompts(DATA_DIR / "prompts_heldout.jsonl")[: args.num_prompts]
    pair = mlx_glimmer.load(target=demo_bundle() / "target", drafter=Path(args.drafter))
    rows = [
        measure(pair, prompts, args.max_tokens, float(t), args.seed, how)
        for t in args.temperatures.split(",")
        for how in rules
    ]
    result = {
        "command": " ".join(["python benchmarks/experiments/sampling_acceptance.py", *(argv or sys.argv[1:])]),
        "pair": "the demo target and the shipped drafter (mlx_glimmer/data/demo_drafter)",
        "prompts": f"the first {len(prompts)} held-out prompts, chat template, {args.max_tokens} tokens, seed {args.seed}",
        "shapes": "block 16 chains (rejection, walk, walk with the drafter's own noise); trees of 8 nodes (walk)",
        "cpu": cpu_facts(),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps([{k: v for k, v in r.items() if k != "per_prompt"} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
