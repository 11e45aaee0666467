"""Our MLX target and drafter compute what transformers computes, on the same weights."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from mlx_glimmer.drafters.dflash import load_dflash_model

RNG = np.random.default_rng(0)


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def torch_target(path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    except ValueError:
        return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["muse", "llama"])
def test_target_logits_match_transformers(name, checkpoints, muse_pair, llama_pair):
    pair = muse_pair if name == "muse" else llama_pair
    ids = RNG.integers(0, 256, size=40).tolist()  # 40 tokens: five times the Muse window
    ref = torch_target(checkpoints[name])(torch.tensor([ids])).logits[0].detach().numpy()
    target = pair.target
    ours = target.head(target.forward(mx.array(ids), target.make_cache(16), capture=False)[0])
    assert rel_err(ours, ref) < 1e-4
    # The split head reproduces mlx-lm's own __call__.
    assert rel_err(ours, target.model(mx.array([ids]))[0]) < 1e-6


def test_incremental_decode_past_the_window_matches_full_forward(muse_pair):
    target = muse_pair.target
    ids = RNG.integers(0, 256, size=48).tolist()
    full = target.head(target.forward(mx.array(ids), target.make_cache(4), capture=False)[0])
    cache = target.make_cache(4)
    rows = [target.head(target.forward(mx.array(ids[:5]), cache, capture=False)[0])]
    pos = 5
    while pos < len(ids):  # mixed chunk sizes, with rejected tokens rolled back
        n = int(RNG.integers(1, 5))
        chunk = ids[pos : pos + n]
        junk = RNG.integers(0, 256, size=3).tolist()
        out = target.head(target.forward(mx.array(chunk + junk), cache, capture=False)[0])
        for c in cache:
            c.trim(len(junk))
        rows.append(out[: len(chunk)])
        pos += len(chunk)
    assert rel_err(mx.concatenate(rows), full) < 1e-4


def test_captured_features_are_the_decoder_layer_outputs(checkpoints, muse_pair):
    ids = RNG.integers(0, 256, size=20).tolist()
    ref = torch_target(checkpoints["muse"])(torch.tensor([ids]), output_hidden_states=True).hidden_states
    target = muse_pair.target
    layer_ids = (1, 3, 5)
    target.capture(layer_ids)
    _, feats = target.forward(mx.array(ids), target.make_cache(16), capture=True)
    expected = np.concatenate([ref[i + 1][0].detach().numpy() for i in layer_ids], axis=-1)
    assert rel_err(feats, expected) < 1e-4


def test_drafter_block_matches_transformers_across_rounds_past_the_window(checkpoints):
    """Replays transformers' own DFlash candidate-generator protocol (DFlashCache, crop, positions)."""
    from transformers import MuseGlimmerAssistantModel
    from transformers.cache_utils import DFlashCache

    path = checkpoints["assistant"]
    ref = MuseGlimmerAssistantModel.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_dflash_model(path)
    cfg = ours.config
    B, H, k = cfg.block_size, cfg.hidden_size, len(cfg.target_layer_ids)
    assert cfg.sliding_window == 8

    t_cache = DFlashCache(config=ref.config)
    t_cache.activate_past_recording()
    context = ours.make_context()
    position = 0
    worst = 0.0
    for round_idx, n_new in enumerate([11, 3, 1, 16, 5, 2, 9, 4]):  # ends 51 positions in: > 6 windows
        feats = RNG.standard_normal((1, n_new, k * H)).astype(np.float32)
        noise = RNG.standard_normal((1, B, H)).astype(np.float32)
        t_cache.set_previous_accepted_tokens(n_new)
        if round_idx:
            t_cache.crop(-B)
        pos_ids = torch.arange(position, position + n_new + B)[None]
        with torch.no_grad():
            expected = (
                ref(
                    noise_embeds=torch.from_numpy(noise),
                    context_hidden_states=torch.from_numpy(feats),
                    position_ids=pos_ids,
                    cache=t_cache,
                )
                .last_hidden_state[0]
                .numpy()
            )
        ours.extend_context(mx.array(feats), context)
        position += n_new
        got = ours(mx.array(noise), position, context)[0]
        worst = max(worst, rel_err(got, expected))
    assert worst < 1e-4


def test_drafter_parity_fails_when_the_window_rule_is_off_by_one(checkpoints):
    """The window test above can fail: a reach of window - 1 gives different blocks."""
    from transformers import MuseGlimmerAssistantModel

    path = checkpoints["assistant"]
    ref = MuseGlimmerAssistantModel.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_dflash_model(path)
    for layer in ours.layers:
        layer.self_attn.context_reach -= 1
    cfg = ours.config
    n, B, H, k = 30, cfg.block_size, cfg.hidden_size, len(cfg.target_layer_ids)
    feats = RNG.standard_normal((1, n, k * H)).astype(np.float32)
    noise = RNG.standard_normal((1, B, H)).astype(np.float32)
    from transformers.cache_utils import DFlashCache

    t_cache = DFlashCache(config=ref.config)
    t_cache.set_previous_accepted_tokens(n)
    with torch.no_grad():
        expected = (
            ref(
                noise_embeds=torch.from_numpy(noise),
                context_hidden_states=torch.from_numpy(feats),
                position_ids=torch.arange(n + B)[None],
                cache=t_cache,
            )
            .last_hidden_state[0]
            .numpy()
        )
    context = ours.make_context()
    ours.extend_context(mx.array(feats), context)
    assert rel_err(ours(mx.array(noise), n, context)[0], expected) > 1e-3


def replay_rounds(ref, ours, rounds, seed=0):
    """Feed the same random context/noise to transformers (DFlash cache protocol) and to us; worst rel. error."""
    from transformers.cache_utils import DFlashCache

    rng = np.random.default_rng(seed)
    cfg = ours.config
    B, H, k = cfg.block_size, cfg.hidden_size, len(cfg.target_layer_ids)
    t_cache = DFlashCache(config=ref.config)
    t_cache.activate_past_recording()
    context = ours.make_context()
    position, worst = 0, 0.0
    for round_idx, n_new in enumerate(rounds):
        feats = rng.standard_normal((1, n_new, k * H)).astype(np.float32)
        noise = rng.standard_normal((1, B, H)).astype(np.float32)
        t_cache.set_previous_accepted_tokens(n_new)
        if round_idx:
            t_cache.crop(-B)
        with torch.no_grad():
            expected = (
                ref(
                    noise_embeds=torch.from_numpy(noise),
                    context_hidden_states=torch.from_numpy(feats),
                    position_ids=torch.arange(position, position + n_new + B)[None],
                    cache=t_cache,
                )
                .last_hidden_state[0]
                .numpy()
            )
        ours.extend_context(mx.array(feats), context)
        position += n_new
        worst = max(worst, rel_err(ours(mx.array(noise), position, context)[0], expected))
    return worst


def test_zlab_dflash_checkpoint_loads_with_the_same_math(tmp_path):
    """z-lab's DFlashDraftModel layout (fc / hidden_norm, dflash_config) is the same drafter."""
    import json

    import tiny_checkpoints as tc
    from safetensors.numpy import load_file, save_file
    from transformers import MuseGlimmerAssistantModel

    hf = tc.build_assistant(tmp_path / "hf", layer_types=["full_attention", "full_attention"], block_size=8)
    ref = MuseGlimmerAssistantModel.from_pretrained(hf, dtype=torch.float32).eval()
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    weights = load_file(hf / "model.safetensors")
    renamed = {
        k.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm."): v
        for k, v in weights.items()
    }
    save_file(renamed, zlab / "model.safetensors")
    cfg = json.loads((hf / "config.json").read_text())
    dflash = {key: cfg.pop(key) for key in ("block_size", "mask_token_id", "target_layer_ids")}
    cfg.update(architectures=["DFlashDraftModel"], model_type="qwen3", dflash_config=dflash, sliding_window=None)
    (zlab / "config.json").write_text(json.dumps(cfg))
    ours = load_dflash_model(zlab)
    assert ours.config.source_format == "dflash" and ours.config.block_size == 8
    assert replay_rounds(ref, ours, [5, 3, 7, 1, 9]) < 1e-4
