"""A random Muse Glimmer target small enough to build in seconds and big enough to time the server with.

    python benchmarks/tiny_muse.py DIR [--hidden 512] [--layers 8] [--window 16]

Written by transformers (`MuseGlimmerForConditionalGeneration.save_pretrained`, float32, the VLM layout with
a one-layer vision tower, as Meta's checkpoints are laid out), with a byte-level tokenizer (every byte one
token) and a minimal chat template, so `mlx-glimmer serve DIR` opens it as it opens a real one. At hidden 512
and 8 layers (~25M parameters in the text tower) one decoding step costs more than the server's own work per
token, so serving speeds are the model's; its sliding window is small, so a short chat runs past it. It has
no drafter: a random one would accept nothing, so a lone request decodes plainly, the fastest it can here.
`benchmarks/serve_load.py --tiny-muse DIR` builds it (once) and serves it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

SPECIALS = ["<|begin|>", "<|end|>", "<|eom|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 272  # 256 bytes + the specials, padded
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}<|eom|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def byte_characters() -> dict[int, str]:
    """GPT-2's byte-to-character table (what `pre_tokenizers.ByteLevel` writes bytes as)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(rest)}}


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges (token id = byte value), the specials after the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in byte_characters().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def build(path: Path, *, hidden: int = 512, layers: int = 8, window: int = 16, seed: int = 0) -> Path:
    """Write the target into `path`: weights ~N(0, 1.2 / sqrt(hidden)), so the logits vary (greedy outputs
    rarely sit at a floating-point tie); the output rows of the special tokens are zero, so a byte always
    scores higher and no reply stops before its `max_tokens`."""
    import torch
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    heads = max(hidden // 64, 1)
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        sliding_window=window,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        output_multiplier=1.0,
    )
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=32, projector_hidden_size=32)
    model = MuseGlimmerForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and ("language_model" in name or name.startswith("lm_head")):
                param.normal_(0.0, 1.2 / math.sqrt(hidden))
        model.lm_head.weight[len(byte_characters()) :] = 0
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return path


def ensure_built(path: Path, **sizes) -> Path:
    """`path`, built first unless it already holds a model."""
    return path if (path / "config.json").is_file() else build(path, **sizes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    build(args.dir, hidden=args.hidden, layers=args.layers, window=args.window, seed=args.seed)
    print(args.dir)


if __name__ == "__main__":
    main()
