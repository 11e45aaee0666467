"""Drafters: what proposes the tokens the target verifies.

Block drafters (one forward per block; `base.py` holds what they share):
    dflash.py        DFlash: Meta's `muse_glimmer_assistant`, z-lab `DFlashDraftModel`
    dflash2.py       DFlash2: + grouped dynamic conv and a candidate selector
    dspark.py        DSpark heads: + Markov bias and a confidence head
    registry.py      the families by name, and which one a config.json describes
Others:
    draft_model.py   classic drafting with a small autoregressive model
    prompt_lookup.py n-gram lookup in prompt + output (no model)
"""

from .registry import DRAFT_MODEL, FAMILIES, Family, drafter_kind, family_of

__all__ = ["DRAFT_MODEL", "FAMILIES", "Family", "drafter_kind", "family_of"]
