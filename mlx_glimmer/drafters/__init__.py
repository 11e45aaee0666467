"""Drafters: what proposes the tokens the target verifies.

    base.py          the contract every drafter inherits (`Drafter`), as the loop calls it
Block drafters (one forward per block):
    config.py        the settings they read (`DrafterConfig`)
    layers.py        the Qwen3-style decoder layer they build on
    context.py       the context K/V of committed positions, and the block forward over it
    block.py         a block drafter model bound to its target (`BlockDrafter`)
    loading.py       the one config reader and the one weight loader
    dflash.py        DFlash: Meta's `muse_glimmer_assistant`, z-lab `DFlashDraftModel`
    dflash2.py       DFlash2: + grouped dynamic conv and a candidate selector
    dspark.py        DSpark heads: + Markov bias and a confidence head
    registry.py      the families by name, and which one a config.json describes
Others:
    draft_model.py   classic drafting with a small autoregressive model
    prompt_lookup.py n-gram lookup in prompt + output (no model)
"""
