"""Torch backend (CUDA, MPS or CPU): the same pair, loop and stats as MLX, on transformers' model classes.

    from mlx_glimmer.torch_backend import load_torch, generate
    pair = load_torch("BUNDLE")          # device auto: cuda, then mps, then cpu
    result = generate(pair, "Hello", max_tokens=64)   # result.stats is mlx_glimmer's GenerationStats

Speculative decoding on torch: our loop, not transformers' assisted generation
--------------------------------------------------------------------------------
transformers 5.x runs a DFlash drafter through `model.generate(...,
assistant_model=drafter, speculation_type="dflash")` (its
`DFlashTokenCandidateGenerator`). For greedy decoding on a Muse pair it gives
the target's plain greedy tokens, like ours. We still do not use it, because
it cannot do what the MLX backend does with the same pair:

- no reduced draft vocabulary: it drafts from `lm_head` over the full
  vocabulary, so a distilled drafter's `draft_vocab` is ignored;
- a different draft distribution: its draft logits are the raw `lm_head`
  output, without Muse's output multiplier and tanh soft-cap, and only then
  go through the sampling filters. With temperature / top-k / top-p the
  drafter therefore samples from another distribution than the target-shaped
  one the MLX drafter uses; the output is still distributed as the target's
  (rejection sampling is exact for any draft distribution), but acceptance is
  not comparable with MLX, and its RNG use differs anyway;
- always a full `block_size` block, no `--block-size`, no per-round
  acceptance lengths or target-forward counts for `GenerationStats`.

So torch runs `mlx_glimmer.speculative.generate_steps` itself: the loop is
written once, and `TorchTarget` / `TorchDFlashDrafter` supply its torch side
(forward with feature capture, head, cache, sampling and acceptance in
`sampling.py` with identical filters). KV rollback uses transformers' own
`DynamicCache.crop`; it holds past the sliding window because the cache
records past states (`activate_past_recording`) until the next forward, so a
sliding layer always holds its window before the rejected tokens (tested over
220 tokens with window 8). Greedy runs emit the same tokens and the same
acceptance lengths as MLX on the same weights, up to floating-point ties (see
`parity.py`).
"""

_API = {
    "TorchPair": ".loading",
    "load_torch": ".loading",
    "generate": "..generate",  # the one API: any pair
    "stream_generate": "..generate",
}

__all__ = list(_API)


def __getattr__(name):
    # Lazy: importing the CLI must not import torch.
    if name in _API:
        from importlib import import_module

        return getattr(import_module(_API[name], __name__), name)
    raise AttributeError(name)
