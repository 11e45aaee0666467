"""The torch backend decodes a pair exactly as MLX does, losslessly, from bundles and transformers directories."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tiny_checkpoints as tc
import torch
from oracle_drafter import OracleDrafter

import mlx_glimmer
from mlx_glimmer.cli import JSON_FIELDS, main
from mlx_glimmer.noise import Noise
from mlx_glimmer.sampling import probabilities as mlx_probabilities
from mlx_glimmer.sampling import sample as mlx_sample
from mlx_glimmer.settings import GenerationSettings, SamplingParams
from mlx_glimmer.speculative import generate_steps  # the one loop, on either backend
from mlx_glimmer.speculative import generate_steps as mlx_steps
from mlx_glimmer.torch_backend import load_torch
from mlx_glimmer.torch_backend.parity import ParityReport, PromptResult, explain
from mlx_glimmer.torch_backend.sampling import probabilities, sample
from mlx_glimmer.torch_backend.weights import transformers_name

PROMPT = [256] + list(b"Once upon a time")  # BOS + 16 bytes: twice the Muse window of 8
N_TOKENS = 220  # > 25 windows


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls: thread hand-offs cost more than they save (and the CI box is shared).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def torch_pairs(checkpoints):
    return {
        "muse": load_torch(target=checkpoints["muse"], drafter=checkpoints["assistant"], device="cpu"),
        "llama": load_torch(target=checkpoints["llama"], drafter=checkpoints["llama_assistant"], device="cpu"),
    }


@pytest.fixture(scope="module")
def bundle8(tmp_path_factory, checkpoints):
    """The tiny Muse pair converted to an 8-bit bundle (float32 scales)."""
    from mlx_glimmer.convert.bundle import convert

    out = tmp_path_factory.mktemp("b8") / "bundle"
    convert(checkpoints["muse"], out, drafter=checkpoints["assistant"], bits=8, group_size=32, dtype="float32")
    return out


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def lengths_of(steps):
    return [len(s.tokens) for s in steps[1:]]


@pytest.mark.parametrize("name", ["muse", "llama"])
def test_mlx_and_torch_decode_the_same_tokens_plain_and_speculative(name, muse_pair, llama_pair, torch_pairs):
    mlx_pair, torch_pair = (muse_pair if name == "muse" else llama_pair), torch_pairs[name]
    plain_mlx = tokens_of(mlx_steps(mlx_pair.target, PROMPT, GenerationSettings(max_tokens=48)))
    plain_torch = tokens_of(generate_steps(torch_pair.target, PROMPT, GenerationSettings(max_tokens=48)))
    spec_mlx = list(
        mlx_steps(mlx_pair.target, PROMPT, GenerationSettings(max_tokens=48, block_size=4), drafter=mlx_pair.drafter)
    )
    spec_torch = list(
        generate_steps(
            torch_pair.target, PROMPT, GenerationSettings(max_tokens=48, block_size=4), drafter=torch_pair.drafter
        )
    )
    assert plain_torch == plain_mlx
    assert tokens_of(spec_torch) == tokens_of(spec_mlx) == plain_mlx
    # The drafters agree too: the same tokens are accepted in the same rounds.
    assert lengths_of(spec_torch) == lengths_of(spec_mlx)


class TorchOracle(OracleDrafter):
    def propose(self, anchor, count, params, noise):
        draft, _ = super().propose(anchor, count, params, noise)
        return torch.tensor(np.array(draft), dtype=torch.long), None


def test_torch_speculative_is_lossless_far_past_the_sliding_window(muse_pair, torch_pairs):
    target, drafter = torch_pairs["muse"].target, torch_pairs["muse"].drafter
    assert target.config.sliding_window == 8
    plain = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=N_TOKENS)))
    assert plain == tokens_of(mlx_steps(muse_pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS)))
    spec = tokens_of(
        generate_steps(target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, block_size=16), drafter=drafter)
    )
    # High agreement: long accepted runs, rejections of every size, all past the window.
    wrong = {i for i in range(N_TOKENS) if i % 23 == 5 or i % 37 == 0}
    steps = list(
        generate_steps(
            target,
            PROMPT,
            GenerationSettings(max_tokens=N_TOKENS, block_size=8),
            drafter=TorchOracle(len(PROMPT), plain, wrong, 272),
        )
    )
    assert spec == plain and tokens_of(steps) == plain
    assert max(lengths_of(steps)) == 8 and np.mean(lengths_of(steps)) > 5


def test_both_targets_have_every_member_the_loop_and_the_drafters_use(muse_pair, torch_pairs):
    from mlx_glimmer.target_model import SamplingOps, TargetModel

    def members(protocol) -> set[str]:
        return {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)

    for target in (muse_pair.target, torch_pairs["muse"].target):
        assert [n for n in members(TargetModel) if not hasattr(target, n)] == [], type(target).__name__
        assert [n for n in members(SamplingOps) if not hasattr(target.sampling, n)] == [], type(target).__name__


def test_every_drafter_inherits_the_drafter_contract(muse_pair, torch_pairs):
    from mlx_glimmer.drafters.base import Drafter
    from mlx_glimmer.drafters.draft_model import DraftModelDrafter
    from mlx_glimmer.drafters.prompt_lookup import PromptLookupDrafter

    drafters = [
        muse_pair.drafter,
        torch_pairs["muse"].drafter,
        PromptLookupDrafter(),
        DraftModelDrafter(muse_pair.target.model),
    ]
    assert all(isinstance(d, Drafter) for d in drafters)


def test_torch_keeps_a_decode_state_across_turns(torch_pairs):
    pair = torch_pairs["muse"]
    state = mlx_glimmer.DecodeState()
    first = mlx_glimmer.generate(pair, PROMPT, max_tokens=20, block_size=4, state=state)
    turn2 = PROMPT + first.token_ids + list(b" more")
    second = mlx_glimmer.generate(pair, turn2, max_tokens=20, block_size=4, state=state)
    assert 0 < second.stats.prefill_tokens < second.stats.prompt_tokens
    assert second.token_ids == mlx_glimmer.generate(pair, turn2, max_tokens=20, block_size=4).token_ids
    # Plain decoding's run-ahead forward is undone when a stream is closed early.
    stream = mlx_glimmer.stream_generate(pair, turn2, max_tokens=20, speculative=False, state=state)
    answer = [t for _, chunk in zip(range(5), stream) for t in chunk.token_ids]
    assert state.ahead == 1
    stream.close()
    assert state.ahead == 0 and state.cache.get_seq_length() == len(state.processed)
    turn3 = turn2 + answer + list(b" go")
    third = mlx_glimmer.generate(pair, turn3, max_tokens=12, speculative=False, state=state)
    assert third.token_ids == mlx_glimmer.generate(pair, turn3, max_tokens=12, speculative=False).token_ids


def test_transformers_own_dflash_assisted_generation_agrees_greedy(torch_pairs):
    """The path we chose not to use (see mlx_glimmer.torch_backend) gives the same greedy tokens."""
    target, drafter = torch_pairs["muse"].target, torch_pairs["muse"].drafter
    out = target.model.generate(
        torch.tensor([PROMPT]),
        assistant_model=drafter.model,
        speculation_type="dflash",
        do_sample=False,
        max_new_tokens=48,
        min_new_tokens=48,
        eos_token_id=None,
    )
    ours = tokens_of(generate_steps(target, PROMPT, GenerationSettings(max_tokens=48, block_size=16), drafter=drafter))
    assert out[0, len(PROMPT) :].tolist() == ours


def test_distilled_drafter_proposes_from_its_draft_vocab_like_mlx(tmp_path, checkpoints, muse_pair):
    vocab = np.array(sorted(set(range(0, 272, 3)) | set(PROMPT)), dtype=np.int32)
    drafter = tc.with_draft_vocab(checkpoints["assistant"], tmp_path / "distilled", vocab)
    mlx_pair = mlx_glimmer.load(target=checkpoints["muse"], drafter=drafter)
    torch_pair = load_torch(target=checkpoints["muse"], drafter=drafter, device="cpu")
    assert torch_pair.drafter.draft_vocab.tolist() == vocab.tolist()
    spec_mlx = list(
        mlx_steps(mlx_pair.target, PROMPT, GenerationSettings(max_tokens=40, block_size=4), drafter=mlx_pair.drafter)
    )
    spec_torch = list(
        generate_steps(
            torch_pair.target, PROMPT, GenerationSettings(max_tokens=40, block_size=4), drafter=torch_pair.drafter
        )
    )
    assert all(t in set(vocab.tolist()) for s in spec_torch[1:] for t in s.tokens[:-1])  # accepted drafts
    assert tokens_of(spec_torch) == tokens_of(spec_mlx)
    assert lengths_of(spec_torch) == lengths_of(spec_mlx)


def test_bundle_loads_on_torch_with_mlx_dequantized_weights(bundle8):
    mlx_pair = mlx_glimmer.load(bundle8)
    torch_pair = load_torch(bundle8, device="cpu")
    assert torch_pair.source == "bundle" and torch_pair.dtype == torch.float32
    expected = {}
    for model, prefix in ((mlx_pair.target.model, ""), (mlx_pair.drafter.model, "drafter.")):
        for path, module in model.named_modules():
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                w = mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)
                expected[prefix + path + ".weight"] = w
            elif "weight" in module and not isinstance(module.weight, dict):
                expected[prefix + path + ".weight"] = module.weight
    assert sum(isinstance(m, nn.QuantizedLinear) for _, m in mlx_pair.target.model.named_modules()) > 10
    got = dict(torch_pair.target.model.state_dict())
    got.update({"drafter." + k: v for k, v in torch_pair.drafter.model.state_dict().items()})
    for name, value in expected.items():
        key = name if name.startswith("drafter.") else transformers_name(name, "muse_glimmer")
        assert np.array_equal(got[key].numpy(), np.array(value)), name


def test_parity_command_on_a_bundle_reports_and_exits_0(bundle8, capsys, tmp_path):
    report = tmp_path / "parity.json"
    argv = [
        "parity",
        str(bundle8),
        "--num-prompts",
        "2",
        "--max-tokens",
        "24",
        "--device",
        "cpu",
        "--json",
        str(report),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("all 4 runs identical") == 2 and "-> PASS" in out
    assert "speculative rounds: mlx " in out
    data = json.loads(report.read_text())
    assert data["passed"] and len(data["prompts"]) == 2
    runs = data["prompts"][0]["tokens"]
    assert set(runs) == {"mlx plain", "mlx spec", "torch plain", "torch spec"} and len(runs["mlx plain"]) == 24
    rounds = data["prompts"][0]["rounds"]
    assert rounds["mlx spec"] == rounds["torch spec"] and rounds["mlx plain"] == 23  # the drafters agree too


def test_a_divergence_is_a_tie_only_within_the_tolerance_on_both_backends():
    flat = np.zeros(16, dtype=np.float32)
    flat[:4] = [30.0, 30.0 - 1e-4, 10.0, -30.0]  # tokens 0 and 1 1e-4 apart: within 3e-4 x max|logit|
    wide = flat.copy()
    wide[1] = 29.0

    def check(mlx_logits, torch_logits, dtype="float32"):
        backends = {"mlx": lambda ids: mlx_logits, "torch": lambda ids: torch_logits}
        return explain(("a", "b"), 5, 0, 1, [1, 2], backends, {"mlx": dtype, "torch": dtype}, lambda t: str(t))

    tie = check(flat, flat)
    assert tie.tie and tie.margin["mlx"] == pytest.approx(1e-4, rel=0.1)
    assert not check(flat, wide).tie  # one backend sees a clear choice: a real disagreement
    assert check(flat, wide, dtype="bfloat16").tie  # bfloat16 rounding covers a 1-logit gap at |logit| 30
    report = ParityReport("x", "", "", "float32", "none", 8, None, [PromptResult(1, "p", 2, {}, {}, divergences=[tie])])
    assert report.passed
    report.prompts[0].divergences.append(check(flat, wide))
    assert not report.passed


def test_generate_backend_torch_prints_the_documented_json(bundle8, muse_pair, capsys):
    argv = [
        "generate",
        str(bundle8),
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "30",
        "--block-size",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", *JSON_FIELDS}
    assert out["generated_tokens"] == len(out["token_ids"]) and len(out["acceptance_lengths"]) == out["target_forwards"]
    ref = mlx_glimmer.generate(mlx_glimmer.load(bundle8), "Hello there", max_tokens=30, speculative=False)
    assert out["token_ids"] == ref.token_ids and out["text"] == ref.text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--backend", "torch", "--device", "tpu"], "--device"),
        (["--backend", "torch", "--torch-dtype", "float8"], "--torch-dtype"),
        (["--backend", "torch", "--prompt-lookup"], "DFlash"),
    ],
)
def test_torch_flag_mistakes_are_one_error_line(bundle8, capsys, argv, needle):
    assert main(["generate", str(bundle8), "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(0.7, top_p=0.9, top_k=12)], ids=str)
def test_filters_and_seeded_samples_match_mlx(params):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((200, 32)) * 3).astype(np.float32)
    p_torch = probabilities(torch.from_numpy(logits), params)
    p_mlx = mlx_probabilities(mx.array(logits), params)
    np.testing.assert_allclose(p_torch.numpy(), np.array(p_mlx), atol=1e-6)
    for seed in (0, 7, 2**62 + 3):  # the same seed and positions: the same tokens on both libraries
        where = Noise(seed, 1000)
        assert sample(p_torch, where).tolist() == np.array(mlx_sample(p_mlx, where)).tolist()
