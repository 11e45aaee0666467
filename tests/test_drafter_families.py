"""DFlash2 and DSpark drafters: parity with their reference packages, losslessness, bad pairs, convert.

The tiny checkpoints are written by the references themselves (z-lab `dflash`
0.1.0, `dspark-mlx` 0.1.0; see family_checkpoints.py, which installs them
without dependencies into .cache/refpkgs on first use).
"""

import json

import family_checkpoints as fc
import mlx.core as mx
import numpy as np
import pytest
import tiny_checkpoints as tc
import torch

from mlx_glimmer.drafters.dflash2 import compute_logits, load_dflash2_model
from mlx_glimmer.drafters.dspark import DSparkDrafter, load_dspark_model
from mlx_glimmer.noise import Noise
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps

pytestmark = pytest.mark.network  # the reference packages come from PyPI on first use (then .cache/refpkgs)

ROUNDS = [11, 3, 1, 16, 5, 2, 9, 4]  # 51 context positions: over 6 windows of 8


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "dflash2": fc.build_dflash2(root / "dflash2"),
        "dspark": fc.build_dspark(root / "dspark"),
        # Always stops early somewhere on random weights: exercises the confidence cut.
        "dspark_gated": fc.build_dspark(root / "dspark_gated", seed=5, confidence_threshold=0.6),
    }


@pytest.fixture(scope="module")
def pairs(checkpoints, family_ckpts):
    import mlx_glimmer

    return {
        kind: mlx_glimmer.load(target=checkpoints["muse"], drafter=family_ckpts[kind])
        for kind in ("dflash2", "dspark", "dspark_gated")
    }


# --- parity with the references -------------------------------------------------------------


def replay_dflash2(path, window_shift=0):
    """Replays dflash_generate's drafter protocol (DynamicCache with past recording, crop to start) on the
    reference and ours with the same random features / noise; worst errors (logits, first-position q)."""
    from transformers import DynamicCache

    dflash_model = fc.reference("dflash.model")
    ref = dflash_model.DFlash2DraftModel.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_dflash2_model(path)
    cfg = ours.config
    assert cfg.sliding_window == 8 and cfg.block_size == 10 > cfg.sliding_window
    assert (
        [layer.self_attn.causal for layer in ours.layers]
        == [layer.self_attn.is_causal for layer in ref.layers]
        == [True, False]
    )
    for layer in ours.layers:
        if layer.self_attn.window is not None:
            layer.self_attn.window += window_shift
    B, H, V, k = cfg.block_size, cfg.hidden_size, cfg.vocab_size, len(cfg.target_layer_ids)
    rng = np.random.default_rng(0)
    head_w = rng.normal(0, 0.3, (V, H)).astype(np.float32)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.from_numpy(head_w))
    project = lambda h: h @ mx.array(head_w).T  # noqa: E731

    cache = DynamicCache(config=ref.config)
    cache.activate_past_recording()
    context = ours.make_context()
    position, worst, worst_q, same_tokens = 0, 0.0, 0.0, True
    for n_new in ROUNDS:
        feats = rng.standard_normal((1, n_new, k * H)).astype(np.float32)
        noise = rng.standard_normal((1, B, H)).astype(np.float32)
        anchor = int(rng.integers(0, V))
        start = position + n_new
        with torch.no_grad():
            hidden = ref(
                target_hidden=torch.from_numpy(feats),
                noise_embedding=torch.from_numpy(noise),
                position_ids=torch.arange(position, start + B)[None],
                past_key_values=cache,
                use_cache=True,
            )[:, 1 - B :, :]
            cache.crop(-(cache.get_seq_length() - start))
            ref_logits = ref.compute_logits(hidden, head)[0].numpy()
            ref_tokens = ref.propose(hidden, torch.tensor([anchor]), head, 0.0)[0][0].tolist()
            torch.manual_seed(0)
            _, ref_cands, ref_q = ref.propose(hidden, torch.tensor([anchor]), head, 0.7)
        ours.extend_context(mx.array(feats), context)
        position = start
        h = ours(mx.array(noise), position, context)[0][1:]
        logits = compute_logits(h, project, cfg)
        worst = max(worst, rel_err(logits, ref_logits))
        tokens, _, _, _ = ours.candidate_selector.select(h, logits, anchor)
        same_tokens &= tokens.tolist() == ref_tokens
        # Sampling: the first position's draft distribution (its predecessor is the anchor) is the reference's.
        _, cands, _, q = ours.candidate_selector.select(
            h, logits, anchor, SamplingParams(temperature=0.7), Noise(1, start + 1)
        )
        theirs = dict(zip(ref_cands[0, 0].tolist(), ref_q[0, 0].tolist()))
        mine = dict(zip(cands[0].tolist(), q[0].tolist()))
        worst_q = max(worst_q, max(abs(mine[t] - theirs[t]) for t in mine) if set(mine) == set(theirs) else np.inf)
    return worst, worst_q, same_tokens


def test_dflash2_blocks_match_the_reference_across_rounds_past_the_window(family_ckpts):
    worst, worst_q, same_tokens = replay_dflash2(family_ckpts["dflash2"])
    assert same_tokens
    assert worst < 1e-4
    assert worst_q < 1e-4


def test_dflash2_parity_fails_when_the_window_rule_is_off_by_one(family_ckpts):
    """Control: the replay above can fail (a window one wider on our side gives other blocks)."""
    worst, _, _ = replay_dflash2(family_ckpts["dflash2"], window_shift=1)
    assert worst > 1e-3


def test_dspark_blocks_match_the_reference_across_rounds(family_ckpts):
    """dspark-mlx's reference-matched eager interface (extend_context / draft) against ours."""
    loader = fc.reference("dspark_mlx.loader")
    path = family_ckpts["dspark"]
    ref, _ = loader.load_draft(str(path))  # its own loader reads the checkpoint: the format is dspark-mlx's
    ref.reset()
    drafter = DSparkDrafter(load_dspark_model(path), target=None)
    cfg = drafter.config
    assert cfg.own_embeddings and cfg.own_head and drafter.block_size == cfg.block_size + 1
    H, V, k = cfg.hidden_size, cfg.vocab_size, len(cfg.target_layer_ids)
    drafter.reset()
    rng = np.random.default_rng(1)
    worst_logits, worst_conf = 0.0, 0.0
    for n_new in ROUNDS:
        feats = rng.standard_normal((1, n_new, k * H)).astype(np.float32)
        anchor = int(rng.integers(0, V))
        ref.extend_context(mx.array(feats))
        ids, ref_logits, ref_conf = ref.draft(mx.array([anchor]))
        drafter.observe(list(range(n_new)), mx.array(feats[0]))
        tokens, logits, conf, _ = drafter.draft_block(anchor, cfg.block_size)
        assert tokens.tolist() == ids[0, 1:].tolist()
        worst_logits = max(worst_logits, rel_err(logits, ref_logits[0]))
        worst_conf = max(worst_conf, rel_err(conf, ref_conf[0]))
    assert worst_logits < 1e-4 and worst_conf < 1e-4


# --- the loop stays lossless ------------------------------------------------------------------


def plain_greedy(target, prompt, n):
    return [t for s in generate_steps(target, prompt, GenerationSettings(max_tokens=n), drafter=None) for t in s.tokens]


@pytest.mark.parametrize("kind", ["dflash2", "dspark", "dspark_gated"])
def test_greedy_output_equals_plain_decoding_far_past_the_window(kind, pairs):
    pair = pairs[kind]
    assert pair.drafter.kind == kind.removesuffix("_gated")
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 256, size=13).tolist()
    expected = plain_greedy(pair.target, prompt, 60)  # 73 positions: 9 windows of 8
    steps = list(
        generate_steps(
            pair.target,
            prompt,
            GenerationSettings(max_tokens=60, block_size=pair.drafter.block_size),
            drafter=pair.drafter,
        )
    )
    assert [t for s in steps for t in s.tokens] == expected
    drafted = [s.drafted for s in steps[1:]]
    assert max(drafted) == pair.drafter.block_size - 1
    if kind.startswith("dspark"):  # the confidence threshold is on: 0.5 by default, 0.6 gated
        assert pair.drafter.config.confidence_threshold == (0.6 if kind == "dspark_gated" else 0.5)


def test_dspark_head_without_its_own_embedding_borrows_the_target(family_ckpts, checkpoints, tmp_path):
    """A head saved without embed_tokens / lm_head uses the target's embedding rows and output head; still lossless."""
    import shutil

    import mlx_glimmer

    head = tmp_path / "head"
    shutil.copytree(family_ckpts["dspark"], head)
    weights = mx.load(str(head / "model.safetensors"))
    mx.save_safetensors(
        str(head / "model.safetensors"),
        {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))},
    )
    pair = mlx_glimmer.load(target=checkpoints["muse"], drafter=head)
    cfg = pair.drafter.config
    assert not cfg.own_embeddings and not cfg.own_head
    prompt = list(range(30, 45))
    steps = list(
        generate_steps(
            pair.target,
            prompt,
            GenerationSettings(max_tokens=30, block_size=pair.drafter.block_size),
            drafter=pair.drafter,
        )
    )
    assert [t for s in steps for t in s.tokens] == plain_greedy(pair.target, prompt, 30)


def test_dspark_offers_the_whole_block_past_low_confidence(pairs):
    """Where dspark-mlx would stop the block (before the first draft whose sigmoid(confidence) is below the
    threshold), the whole block is still offered: the cut would need a host read, and the verify is as wide
    either way."""
    drafter = pairs["dspark_gated"].drafter
    target = pairs["dspark_gated"].target
    target.capture(drafter.target_layer_ids)
    drafter.reset()
    prompt = list(range(40, 60))
    _, feats = target.forward(mx.array(prompt), target.make_cache(16), capture=True)
    drafter.observe(prompt, feats)
    lengths = []
    for anchor in range(60, 70):
        full, _, conf, _ = drafter.draft_block(anchor, drafter.draft_len)
        probs = 1 / (1 + np.exp(-np.array(conf)))
        below = np.nonzero(probs < drafter.config.confidence_threshold)[0]
        lengths.append(int(below[0]) if below.size else drafter.draft_len)
        tokens, _ = drafter.propose(anchor, drafter.draft_len, SamplingParams(), None)
        assert tokens.tolist() == full.tolist()
    assert min(lengths) < drafter.draft_len  # the reference would have cut some of these blocks


@pytest.fixture(scope="module")
def small_vocab_pairs(tmp_path_factory):
    """A 32-token target (test_sampling's) with a DFlash2 and a gated DSpark head, so marginals can be enumerated."""
    from test_sampling import V

    import mlx_glimmer

    root = tmp_path_factory.mktemp("families_v32")
    tc.build_muse_target(root / "t", vocab_size=V, layers=4, weight_std=0.12, seed=5)
    heads = {
        "dflash2": fc.build_dflash2(
            root / "dflash2",
            vocab_size=V,
            target_layer_ids=(0, 2),
            num_target_layers=4,
            mask_token_id=V - 1,
            block_size=4,
            seed=6,
        ),
        "dspark_gated": fc.build_dspark(
            root / "dspark",
            vocab_size=V,
            target_layer_ids=(0, 2),
            num_target_layers=4,
            mask_token_id=V - 1,
            block_size=3,
            seed=7,
            confidence_threshold=0.4,
        ),
    }
    return {kind: mlx_glimmer.load(target=root / "t", drafter=path) for kind, path in heads.items()}


def first_steps(steps, tokens: int) -> list:
    """The steps of a generation up to the one that brings its output to `tokens` tokens; the generation is
    closed there."""
    out, count = [], 0
    for step in steps:
        out.append(step)
        count += len(step.tokens)
        if count >= tokens:
            break
    steps.close()
    return out


@pytest.mark.parametrize("kind", ["dflash2", "dspark_gated"])
def test_sampled_tokens_follow_the_target_distribution(kind, small_vocab_pairs):
    """Chi-square on tokens 1-3 against the target's exact marginals (enumerated), as test_sampling does."""
    from test_sampling import PROMPT, chi_square_p, exact_marginals

    pair = small_vocab_pairs[kind]
    params = SamplingParams(temperature=0.7, top_p=0.9)
    p1, p2, p3 = exact_marginals(pair.target, params)
    draws, kept, rejected = [], 0, 0
    for seed in range(400):
        # 5 tokens: the first verification offers up to 3 drafts, so tokens 2 and 3 can both be drafted ones.
        # Only the rounds that give the first 3 tokens are read (the later ones would not change them).
        steps = first_steps(
            generate_steps(
                pair.target,
                PROMPT,
                GenerationSettings(params, max_tokens=5, block_size=pair.drafter.block_size, seed=seed),
                drafter=pair.drafter,
            ),
            tokens=3,
        )
        kept += sum(len(s.tokens) - 1 for s in steps[1:])
        rejected += sum(s.drafted - (len(s.tokens) - 1) for s in steps[1:] if not s.stopped)
        draws.append([t for s in steps for t in s.tokens][:3])
    draws = np.array(draws)
    assert kept > 40 and rejected > 40, (kept, rejected)  # both branches of the acceptance test ran
    for position, expected in enumerate([p1, p2, p3]):
        assert chi_square_p(draws[:, position], expected) > 0.001, f"token {position + 1}"


# --- mismatched heads: one error line ---------------------------------------------------------


def _edit_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_config."):
            cfg["dflash_config"][key.split(".", 1)[1]] = value
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "kind, change, words",
    [
        ("dflash2", {"hidden_size": 96}, "hidden_size 96"),
        ("dflash2", {"vocab_size": 300}, "vocab_size 300"),
        ("dflash2", {"dflash_config.target_layer_ids": [1, 3, 9]}, "target_layer_ids [9]"),
        ("dspark", {"hidden_size": 96}, "hidden_size 96"),
        ("dspark", {"vocab_size": 300}, "vocab_size 300"),
        ("dspark", {"target_layer_ids": [1, 3, 12]}, "target_layer_ids [12]"),
    ],
)
def test_mismatched_head_is_one_error_line(kind, change, words, family_ckpts, checkpoints, tmp_path, capsys):
    from mlx_glimmer.cli import main

    bad = _edit_config(family_ckpts[kind], tmp_path / "bad", **change)
    code = main(["generate", str(checkpoints["muse"]), "--drafter", str(bad), "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert len(err) == 1 and err[0].startswith("error:") and "config.json" in err[0] and words in err[0], err


def test_dspark_weights_of_the_wrong_vocabulary_are_one_error_line(family_ckpts, checkpoints, tmp_path):
    """A head trained for another vocabulary (weights and config agree) does not fit the target."""
    import mlx_glimmer
    from mlx_glimmer.errors import GlimmerError

    other = fc.build_dspark(tmp_path / "v300", vocab_size=300)
    with pytest.raises(GlimmerError, match=r"config.json: vocab_size 300 does not match the target's 272"):
        mlx_glimmer.load(target=checkpoints["muse"], drafter=other)


# --- convert, then generate (the acceptance check) ----------------------------------------------


@pytest.mark.parametrize("kind, bits", [("dflash2", "8"), ("dspark", "16")])
def test_convert_then_generate_equals_no_spec_and_json_names_the_family(
    kind, bits, family_ckpts, checkpoints, tmp_path, capsys
):
    from mlx_glimmer.cli import main

    bundle = tmp_path / "bundle"
    assert (
        main(
            [
                "convert",
                "--target",
                str(checkpoints["muse"]),
                "--drafter",
                str(family_ckpts[kind]),
                "--out",
                str(bundle),
                "--bits",
                "16",
                "--drafter-bits",
                bits,
                "--dtype",
                "float32",
                "--quiet",
            ]
        )
        == 0
    )
    capsys.readouterr()
    drafter_cfg = json.loads((bundle / "drafter" / "config.json").read_text())
    assert ("quantization" in drafter_cfg) == (bits != "16")
    runs = {}
    for flag in ([], ["--no-spec"]):
        code = main(
            [
                "generate",
                str(bundle),
                "--prompt",
                "The quick brown fox",
                "--max-tokens",
                "40",
                "--temp",
                "0",
                "--json",
                *flag,
            ]
        )
        assert code == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    spec, plain = runs[False], runs[True]
    assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
    assert spec["drafter_kind"] == kind and plain["drafter_kind"] == "none"
    assert spec["target_forwards"] <= plain["target_forwards"]
    # The torch backend drafts with DFlash only, and says which family the bundle's drafter is.
    assert main(["generate", str(bundle), "--backend", "torch", "--prompt", "hi", "--max-tokens", "2"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"(this is a {kind} block drafter); use --backend mlx" in err[0], err


@pytest.mark.parametrize("kind", ["dflash2", "dspark"])
def test_convert_refuses_a_mismatched_head_with_one_error_line(kind, family_ckpts, checkpoints, tmp_path, capsys):
    from mlx_glimmer.cli import main

    bad = _edit_config(family_ckpts[kind], tmp_path / "bad", hidden_size=96)
    code = main(
        [
            "convert",
            "--target",
            str(checkpoints["muse"]),
            "--drafter",
            str(bad),
            "--out",
            str(tmp_path / "b"),
            "--quiet",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and not (tmp_path / "b").exists()
    assert len(err) == 1 and err[0].startswith("error:") and "config.json: hidden_size 96" in err[0], err
