"""Run under `mlx.launch -n N`: greedy generation on a target split across the N processes, several ways.

    mlx.launch -n 2 --backend ring -- python tests/split_generate.py MUSE ASSISTANT LLAMA LLAMA_ASSISTANT TOKENS

Rank 0 prints one JSON object: for the Muse target, the token ids of plain decoding, of speculative decoding
with the pair's drafter (block 4, and `auto`) and of an oracle drafter (block 8, and `auto`) that knows the plain answer and lies at
chosen positions (long accepted runs, rejections at known places); every rank's bytes of decoder-layer
weights; for the Llama target (split by mlx-lm's own `shard()`), plain and block 4. The other ranks print
nothing.
"""

import dataclasses
import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.ranks import is_lead, world

PROMPT = [256] + list(b"Once upon a time")  # BOS + 16 bytes: twice the tiny targets' window of 8


def wrong_positions(tokens: int) -> set[int]:
    """Where the oracle lies: every few tokens, so rounds both run long and end early."""
    return {i for i in range(tokens) if i % 11 == 5 or i % 17 == 0}


def runs(pair, tokens: int) -> dict:
    def ids(p, **kwargs):
        return mlx_glimmer.generate(p, PROMPT, max_tokens=tokens, temperature=0, **kwargs).token_ids

    plain = ids(pair, speculative=False)
    oracle = OracleDrafter(len(PROMPT), plain, wrong_positions(tokens), pair.target.vocab_size)
    oracle_pair = dataclasses.replace(pair, drafter=oracle)
    with_oracle = mlx_glimmer.generate(oracle_pair, PROMPT, max_tokens=tokens, temperature=0, block_size=8)
    oracle_auto = mlx_glimmer.generate(oracle_pair, PROMPT, max_tokens=tokens, temperature=0, block_size="auto")
    return {
        "plain": plain,
        "spec_block4": ids(pair, block_size=4),
        "spec_auto": ids(pair, block_size="auto"),
        "oracle_block8": with_oracle.token_ids,
        "oracle_acceptance": with_oracle.stats.acceptance_lengths,
        "oracle_auto": oracle_auto.token_ids,
        "oracle_auto_widths": oracle_auto.stats.verify_widths,
    }


def layer_bytes(pair) -> int:
    """Bytes of the target's decoder-layer weights held by this process."""
    return sum(v.nbytes for _, v in tree_flatten(pair.target.model.model.parameters()["layers"]))


def main() -> None:
    muse, assistant, llama, llama_assistant, tokens = sys.argv[1:6]
    tokens = int(tokens)
    pair = mlx_glimmer.load(target=Path(muse), drafter=Path(assistant))
    out = {"world": world().size(), "target": type(pair.target).__name__, "muse": runs(pair, tokens)}
    every_rank = mx.distributed.all_gather(mx.array([layer_bytes(pair)]), group=world())
    out["layer_bytes"] = every_rank.tolist()
    llama_pair = mlx_glimmer.load(target=Path(llama), drafter=Path(llama_assistant))
    out["llama"] = {
        "plain": mlx_glimmer.generate(
            llama_pair, PROMPT, max_tokens=tokens, temperature=0, speculative=False
        ).token_ids,
        "spec_block4": mlx_glimmer.generate(
            llama_pair, PROMPT, max_tokens=tokens, temperature=0, block_size=4
        ).token_ids,
    }
    if is_lead():
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
