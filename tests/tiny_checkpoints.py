"""Build tiny random checkpoints with transformers, the way Meta's are laid out.

Everything here is test scaffolding: small Muse Glimmer / llama targets, their
assistant (DFlash) drafters and a byte-level tokenizer, written with
`save_pretrained` so our loader reads exactly what transformers writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

BYTE_TOKENS = 256
SPECIALS = ["<|begin|>", "<|end|>", "<|eom|>", "<|mask|>", "<|user|>", "<|assistant|>"]
VOCAB_SIZE = 272  # bytes + specials, padded
BOS_ID, EOS_ID, EOM_ID, MASK_ID = 256, 257, 258, 259

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}<|eom|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with no merges: every byte is one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # Order the 256 byte characters by their byte value so ids are stable.
    mapping = _bytes_to_unicode()
    vocab = {mapping[b]: b for b in range(256)}
    assert set(vocab) == set(byte_chars)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        mask_token="<|mask|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def randomise_norms(model: torch.nn.Module, seed: int) -> None:
    """Give every norm weight a random value so a wrong norm convention shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and param.ndim == 1:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))


def build_muse_target(
    path: Path,
    *,
    layers: int = 8,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    sliding_window: int = 8,
    seed: int = 0,
    max_shard_size: str | None = None,
    vocab_size: int = VOCAB_SIZE,
    weight_std: float = 0.15,
    qk_scale_factor: float | None = None,
    post_norm_scale: float | None = None,
    head_from_embeddings: bool = False,
) -> Path:
    """A tiny random Muse Glimmer (VLM layout, vision tower included).

    Random tiny transformers are chaotic: a 0.4% weight perturbation (bf16)
    flips ~20% of greedy argmaxes. For quantization-quality checks,
    `post_norm_scale` (the centered post-norms' 1 + w, ~[s, s + 0.1]),
    `head_from_embeddings` (lm_head rows = embedding rows, as in tied models)
    and a softer `qk_scale_factor` give peaked, stable predictions.
    """
    from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        sliding_window=sliding_window,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID if vocab_size > BOS_ID else None,
        eos_token_id=EOS_ID if vocab_size > EOS_ID else None,
        pad_token_id=EOS_ID if vocab_size > EOS_ID else None,
        output_multiplier=1.0,
    )
    if qk_scale_factor is not None:
        text["qk_scale_factor"] = qk_scale_factor
    vision = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    config = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=32, projector_hidden_size=32)
    model = MuseGlimmerForConditionalGeneration(config).float().eval()
    # The default init is small (std 0.02); a larger scale gives peaked, varied logits.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and "language_model" in name or name.startswith("lm_head"):
                param.normal_(0.0, weight_std)
    randomise_norms(model, seed + 1)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        if post_norm_scale is not None:
            for name, param in params.items():
                if "language_model" in name and (
                    "post_attention_layernorm" in name or "post_feedforward_layernorm" in name
                ):
                    param.copy_(post_norm_scale - 1 + 0.1 * torch.rand(param.shape, generator=gen))
        if head_from_embeddings:
            params["lm_head.weight"].copy_(params["model.language_model.embed_tokens.weight"])
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    write_tokenizer(path)
    return path


def build_llama_target(path: Path, *, layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).float().eval()
    save_randomised(model, path, seed)
    write_tokenizer(path)
    return path


def save_randomised(model, path: Path, seed: int) -> None:
    """Random matrices (std 0.15) and random norms (so parity tests can fail), saved as safetensors."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.15)
    randomise_norms(model, seed + 1)
    model.save_pretrained(path, safe_serialization=True)


def build_assistant(
    path: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    target_layer_ids: list[int] | None = None,
    sliding_window: int = 8,
    block_size: int = 16,
    seed: int = 1,
    mask_token_id: int = MASK_ID,
    **overrides,
) -> Path:
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    config = MuseGlimmerAssistantConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=sliding_window,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids or [1, 3, 5],
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        **overrides,
    )
    model = MuseGlimmerAssistantModel(config).float().eval()
    save_randomised(model, path, seed)
    # Meta's published config carries neither of these.
    cfg_path = Path(path) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("vocab_size", None)
    cfg.pop("num_target_layers", None)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return path


def with_draft_vocab(drafter: Path, path: Path, vocab) -> Path:
    """A copy of `drafter` at `path` that drafts from the token ids `vocab` only, as `distill` exports one."""
    shutil.copytree(drafter, path)
    vocab = np.asarray(vocab, dtype=np.int32)
    save_file({**load_file(path / "model.safetensors"), "draft_vocab": vocab}, path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "draft_vocab_size": len(vocab)}))
    return path
