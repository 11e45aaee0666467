"""The settings every block drafter reads: transformers' `muse_glimmer_assistant` fields and z-lab's
`dflash_config` block. Each family subclasses `DrafterConfig` (`from_raw`, `check`, `adopt_weights`,
`to_dict`); `SourceConfig` is the base of families written back in their own format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar


@dataclass
class DrafterConfig:
    """`muse_glimmer_assistant` settings; defaults are transformers' own. Also reads z-lab DFlash configs."""

    model_type: str = "muse_glimmer_assistant"
    hidden_size: int = 6656
    intermediate_size: int = 19968
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 131072
    sliding_window: int | None = 2048
    layer_types: list[str] = field(default_factory=list)
    block_size: int = 16
    mask_token_id: int = 201818
    target_layer_ids: list[int] = field(default_factory=lambda: [1, 13, 25, 37, 49])
    vocab_size: int | None = None
    num_target_layers: int | None = None
    # Drafters trained by `mlx-glimmer distill` propose from a reduced vocabulary
    # (the ids are stored as the `draft_vocab` tensor); verification is full-vocabulary.
    draft_vocab_size: int | None = None
    # Largest distance q - k at which a block query still sees a context key on
    # a sliding layer. transformers' create_bidirectional_sliding_window_mask
    # allows |q - k| <= sliding_window; z-lab's loop uses q - k < sliding_window.
    context_reach: int | None = None
    source_format: str = "muse_glimmer_assistant"

    # Families whose modules are vocabulary-sized (codebooks, Markov heads) take the target's vocabulary
    # size when their config.json does not name one.
    NEEDS_VOCAB: ClassVar[bool] = False

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["sliding_attention"] * self.num_hidden_layers
        if self.context_reach is None and self.sliding_window is not None:
            self.context_reach = self.sliding_window

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        cfg = dict(raw)
        fmt = "muse_glimmer_assistant"
        dflash = cfg.pop("dflash_config", None)
        if dflash is not None or "DFlashDraftModel" in (cfg.get("architectures") or []):
            fmt = "dflash"
            for key in ("block_size", "mask_token_id", "target_layer_ids"):
                if dflash and key in dflash:
                    cfg[key] = dflash[key]
            cfg.setdefault("layer_types", ["full_attention"] * int(cfg.get("num_hidden_layers", 5)))
            if cfg.get("sliding_window") is not None:
                cfg.setdefault("context_reach", int(cfg["sliding_window"]) - 1)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if "rope_theta" not in cfg and "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            cfg["rope_scaling"] = rope
        else:
            cfg["rope_scaling"] = None
        fields = set(cls.__dataclass_fields__)
        out = cls(**{k: v for k, v in cfg.items() if k in fields})
        out.source_format = fmt
        return out

    @classmethod
    def from_raw(cls, raw: dict[str, Any], where: Path | None = None) -> DrafterConfig:
        """The config of a checkpoint's config.json (`where` names it in errors)."""
        return cls.from_dict(raw)

    def check(self, where: Path) -> None:
        """Family-specific settings a model cannot be built without (`validate_pair` checks the fit)."""

    def adopt_weights(self, names) -> None:
        """Settle the optional parts the checkpoint's tensor `names` show it carries."""

    def to_dict(self) -> dict[str, Any]:
        """The config as a transformers `muse_glimmer_assistant` config.json (a z-lab reach included)."""
        d = {
            "architectures": ["MuseGlimmerAssistantModel"],
            "model_type": "muse_glimmer_assistant",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})},
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "layer_types": self.layer_types,
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
            "hidden_act": "silu",
        }
        if self.vocab_size is not None:
            d["vocab_size"] = self.vocab_size
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.draft_vocab_size is not None:
            d["draft_vocab_size"] = self.draft_vocab_size
        if self.sliding_window is not None and self.context_reach != self.sliding_window:
            d["context_reach"] = self.context_reach
        return d


@dataclass
class SourceConfig(DrafterConfig):
    """A family config written back as its source config.json was read (`raw`), with what the bound target
    told us filled in: its format is the family's own, not the `muse_glimmer_assistant` one."""

    raw: dict = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.raw)
        d["vocab_size"] = self.vocab_size
        d["num_target_layers"] = self.num_target_layers
        return d
