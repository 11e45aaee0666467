"""A target whose replies are scripted, and `mlx-glimmer serve` on it (run as a script by the server tests).

`ScriptedTarget` is the real target (its forward fills the real KV cache, its
features feed the real drafter) with one change: at every position after the
last generation marker, the logits put all their weight on the next token of
a script, chosen by what the conversation holds. So a random tiny checkpoint
answers with a tool call, or with reasoning then an answer, deterministically,
while everything else (template, prefix cache, speculative loop, server) is
the code under test.

    python tests/scripted_serve.py SCRIPTS.json -- serve TARGET --drafter DRAFTER ...

SCRIPTS.json: {"marker": "<|assistant|>", "scripts": [[trigger, reply], ...]}: the first script whose
trigger text appears in the conversation before the marker is the reply ("" always matches); the reply
ends with the tokenizer's end-of-sequence token.
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np

from mlx_glimmer.target import Target

FORCE = 30.0


def find(seq: list[int], sub: list[int], end: int) -> bool:
    if not sub:
        return True
    n = len(sub)
    return any(seq[i : i + n] == sub for i in range(0, end - n + 1))


class ScriptedTarget(Target):
    """The scripted token after each position travels with the hidden states (one extra column, -1 for none), so
    the head forces it whatever order the loop calls forward and head in; the drafter's own hidden states have no
    such column and get the real head. A draft tree's nodes each follow their own root path."""

    def __init__(self, base: Target, marker: int, scripts: list[tuple[list[int], list[int]]], eos: int):
        super().__init__(base.model, base.config)
        self.real_head = self.head
        self.head = self.scripted_head
        self.marker, self.scripts, self.eos = marker, scripts, eos
        self.dtype = None

    def reply(self, hist: list[int], m: int) -> list[int] | None:
        """The script for the generation marker at `m`: the first whose trigger the conversation holds."""
        return next((reply for trigger, reply in self.scripts if find(hist, trigger, m)), None)

    def scripted_after(self, hist: list[int], end: int, m: int | None, replies: dict, shared: int) -> int:
        """The scripted token after `hist[: end + 1]`, whose last generation marker is at `m` (-1: none, the
        real logits apply). `replies` memoizes the script of each marker, by position below `shared` (where all
        the histories of one call agree), else by what the history holds from `shared` to the marker."""
        if m is None:
            return -1
        key = m if m < shared else tuple(hist[shared : m + 1])
        if key not in replies:
            replies[key] = self.reply(hist, m)
        reply, k = replies[key], end - m
        return -1 if reply is None else reply[k] if k < len(reply) else self.eos

    def forward(self, tokens, cache, capture, tree=None):
        first = cache[0]
        offset = first.offset
        ids = [int(t) for t in np.array(tokens)]
        hist = getattr(first, "_scripted_hist", [])[:offset] + ids
        hidden, feats = super().forward(tokens, cache, capture, tree)
        first._scripted_hist = hist  # copied with the cache when the prefix cache forks a conversation
        m = next((i for i in range(offset - 1, -1, -1) if hist[i] == self.marker), None)
        replies, scripted = {}, []
        if tree is None:  # a chain: the scripted token after each position of this call
            for p in range(offset, len(hist)):
                if hist[p] == self.marker:
                    m = p
                scripted.append(self.scripted_after(hist, p, m, replies, offset))
        else:  # a draft tree ([anchor, nodes]): each node's history is the cache's, then its root path
            for row in np.array(tree.ancestors):
                path = [ids[j] for j in np.flatnonzero(row)]
                node = hist[:offset] + path
                last = next((offset + j for j in range(len(path) - 1, -1, -1) if path[j] == self.marker), m)
                scripted.append(self.scripted_after(node, len(node) - 1, last, replies, offset + 1))
        self.dtype = hidden.dtype
        column = mx.array(scripted, dtype=mx.float32)[:, None]
        return mx.concatenate([hidden.astype(mx.float32), column], axis=-1), feats

    def keep(self, cache, positions, width):
        """A verify's kept positions (a tree's accepted path) become the history's newest entries, as in the
        cache."""
        first = cache[0]
        base, hist = first.offset - width, first._scripted_hist
        first._scripted_hist = hist[:base] + [hist[base + p] for p in positions]
        super().keep(cache, positions, width)

    def scripted_head(self, h):
        if h.shape[-1] != self.hidden_size + 1:
            return self.real_head(h)  # the drafter's hidden states
        code = h[..., -1]
        logits = self.real_head(h[..., :-1].astype(self.dtype))
        vocab = mx.arange(logits.shape[-1])
        forced = mx.where(vocab == code[..., None].astype(mx.int32), FORCE, -FORCE).astype(logits.dtype)
        return mx.where((code >= 0)[..., None], forced, logits)


def install(spec: dict) -> None:
    """Make `mlx_glimmer.loading` open every target as a ScriptedTarget following `spec`."""
    from mlx_glimmer import loading

    real = loading.load_target

    def load_target(path, group=None):
        target, tokenizer = real(path, group)

        def ids(text):
            return list(tokenizer.encode(text, add_special_tokens=False))

        (marker,) = ids(spec["marker"])
        eos = min(tokenizer.eos_token_ids)
        scripts = [(ids(trigger), ids(reply) + [eos]) for trigger, reply in spec["scripts"]]
        return ScriptedTarget(target, marker, scripts, eos), tokenizer

    loading.load_target = load_target


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        install(json.load(f))
    from mlx_glimmer import cli

    argv = sys.argv[2:]
    sys.exit(cli.main(argv[1:] if argv[:1] == ["--"] else argv))
