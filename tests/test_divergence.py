"""`bench` names the first divergence between methods with the logit margins of both kernel shapes."""

import numpy as np

from mlx_glimmer import bench
from mlx_glimmer.divergence import explain_divergence, next_token_logits
from mlx_glimmer.settings import GenerationSettings
from mlx_glimmer.speculative import generate_steps

PROMPT = [256] + list(b"Once upon a time")


def plain_tokens(target, n=30):
    return [t for s in generate_steps(target, PROMPT, GenerationSettings(max_tokens=n)) for t in s.tokens]


def test_both_kernels_agree_with_plain_decoding_and_a_runner_up_gap_is_the_margin(muse_pair):
    target = muse_pair.target
    ref = plain_tokens(target)
    context = PROMPT + ref[:5]
    step, verify = next_token_logits(target, context, 1), next_token_logits(target, context, 16)
    assert int(np.argmax(step)) == int(np.argmax(verify)) == ref[5]
    np.testing.assert_allclose(step, verify, rtol=1e-4, atol=1e-4)  # float32: kernels differ by rounding only
    runner_up = int(np.argsort(step)[-2])
    other = ref[:5] + [runner_up] + ref[6:]
    d = explain_divergence(target, "float32", PROMPT, ref, other, 16, muse_pair.tokenizer.decode)
    assert d["position"] == 5 and d["tokens"] == [ref[5], runner_up]
    assert set(d["kernels"]) == {"step (1 row)", "verify (16 rows)"}
    for k in d["kernels"].values():
        assert k["argmax"] == ref[5] and abs(k["gap"] - k["margin"]) < 1e-4
    assert d["tie"] == all(k["gap"] <= k["tolerance"] for k in d["kernels"].values())
    assert explain_divergence(target, "float32", PROMPT, ref, ref[:10], 16) is None  # a prefix: no divergence


def test_bench_reports_a_mismatch_with_both_margins(muse_pair, monkeypatch):
    real = bench.time_ours

    def wrong_once(pair, ids, settings):
        toks, dt, stats = real(pair, ids, settings)
        if settings.speculative and len(toks) > 4:
            toks = toks[:3] + [(toks[3] + 1) % 256] + toks[4:]  # as if the verify kernel had flipped token 3
        return toks, dt, stats

    monkeypatch.setattr(bench, "time_ours", wrong_once)
    report = bench.run_bench(muse_pair, ["Once upon a time"], max_tokens=12, block_sizes=[4], warmup=0, baseline=False)
    spec = report["results"]["spec_b4_toff"]  # a fixed width verifies chains: tree "auto" runs as "off"
    assert spec["mismatches"] == 1
    d = spec["divergences"][0]
    assert d["prompt"] == 1 and d["position"] == 3 and set(d["kernels"]) == {"step (1 row)", "verify (4 rows)"}
    assert d["tie"] is False  # a token the target does not prefer by a wide gap: a real disagreement
    table = bench.format_table(report)
    assert "OUTPUT MISMATCHES" in table and "spec_b4_toff prompt 1: first divergence at generated token 3" in table
    assert "step (1 row): top1-top2" in table and "verify (4 rows): top1-top2" in table and "DISAGREE" in table
