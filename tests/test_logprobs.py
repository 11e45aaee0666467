"""Log-probabilities, as a specification.

A generated token's log-probability is the log-softmax of the target's own logits at its position (before
temperature, top-k and top-p), and its top alternatives are the likeliest tokens there: exactly what mlx-lm's
forward over the same tokens gives, whatever committed the token (the first token after the prefill, plain
steps, width-1 rounds of the drafting loop, chains, draft-tree paths through side branches, the server's
batched steps), greedy or sampled, on a tiny Muse target (sliding window) and a tiny Llama target, on MLX and
on torch. Asking for them changes no token and adds no host read; not asking computes nothing. The API,
`generate --json` and the server report the same values, in their own shapes.
"""

from __future__ import annotations

import copy
import json
import queue
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from oracle_drafter import AlwaysPlain, OracleDrafter, TreeOracle
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer.cli import main
from mlx_glimmer.generate import GenerationStats, chunks_from_steps
from mlx_glimmer.logprobs import prompt_logprobs
from mlx_glimmer.server.app import ServerState, create_app, model_context
from mlx_glimmer.server.run import Delta, Failed, Finished, GenerationRequest, Job
from mlx_glimmer.server.worker import GenerationWorker
from mlx_glimmer.settings import BatchSettings, GenerationSettings, SamplingError, SamplingParams
from mlx_glimmer.speculative import generate_steps
from mlx_glimmer.tree import mlx_trees

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = [256] + list(b"Once upon a time")
TOP = 4
TOL = 2e-4  # float32 logits of a verify against those of one forward over the whole sequence
N_TOKENS = 32
SAMPLED = SamplingParams(temperature=0.7, top_p=0.95)


def reference(pair, tokens: list[int]) -> np.ndarray:
    """mlx-lm's own forward over `tokens` from an empty cache: log-softmax of its logits [L, V], float32."""
    logits = pair.target.model(mx.array(tokens)[None])[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def logprobs_of(steps):
    return [lp for s in steps for lp in s.logprobs]


def assert_the_targets_own(pair, prompt: list[int], tokens: list[int], logprobs, top: int = TOP) -> None:
    """Each entry is its token's log-softmax at its position after `prompt` + the tokens before it, and its
    `top` alternatives are the likeliest tokens there, best first, with theirs."""
    assert [lp.token for lp in logprobs] == tokens
    ref = reference(pair, prompt + tokens)
    for j, lp in enumerate(logprobs):
        row = ref[len(prompt) - 1 + j]
        assert lp.logprob == pytest.approx(row[lp.token], abs=TOL), j
        values = [v for _, v in lp.top]
        assert len(lp.top) == top and values == sorted(values, reverse=True)
        assert all(v == pytest.approx(row[t], abs=TOL) for t, v in lp.top), j
        if top:
            assert values[-1] >= np.sort(row)[-top] - TOL  # none likelier is left out


@pytest.fixture(scope="module", params=["muse", "llama"])
def pair(request):
    return request.getfixturevalue(f"{request.param}_pair")


@pytest.fixture(scope="module")
def greedy(pair):
    """The target's plain greedy continuation of PROMPT (what the oracles know)."""
    return tokens_of(generate_steps(pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, speculative=False)))


WRONG = {i for i in range(N_TOKENS) if i % 9 == 4}  # the oracles are wrong there: rejections, side branches


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_plain_steps_and_the_first_token_report_the_targets_own(pair, params):
    settings = GenerationSettings(params, max_tokens=12, speculative=False, logprobs=TOP, seed=3)
    steps = list(generate_steps(pair.target, PROMPT, settings))
    assert all(len(s.logprobs) == len(s.tokens) == 1 for s in steps)
    assert_the_targets_own(pair, PROMPT, tokens_of(steps), logprobs_of(steps))


@pytest.mark.parametrize("params", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_chain_rounds_report_each_committed_tokens_verify_row(pair, greedy, params):
    oracle = OracleDrafter(len(PROMPT), greedy, WRONG, pair.target.vocab_size)
    settings = GenerationSettings(params, max_tokens=N_TOKENS, block_size=6, tree="off", logprobs=TOP, seed=5)
    steps = list(generate_steps(pair.target, PROMPT, settings, drafter=oracle))
    if params.greedy:
        assert tokens_of(steps) == greedy and max(len(s.tokens) for s in steps) == 6  # whole blocks kept
    assert_the_targets_own(pair, PROMPT, tokens_of(steps), logprobs_of(steps))


def test_tree_paths_through_side_branches_report_each_tokens_parent_row(pair, greedy):
    oracle = TreeOracle(len(PROMPT), greedy, WRONG, pair.target.vocab_size)
    steps = list(
        generate_steps(
            pair.target, PROMPT, GenerationSettings(max_tokens=N_TOKENS, tree=15, logprobs=TOP), drafter=oracle
        )
    )
    assert tokens_of(steps) == greedy and all(s.tree for s in steps[1:])
    starts = np.cumsum([len(s.tokens) for s in steps])[:-1]  # the generated index of each round's first token
    kept = [set(range(start, start + len(s.tokens) - 1)) for s, start in zip(steps[1:], starts)]  # its drafts
    assert any(WRONG & drafts for drafts in kept)  # a drafter's second choice kept: a side branch
    assert max(s.accepted for s in steps[1:]) >= 3
    assert_the_targets_own(pair, PROMPT, tokens_of(steps), logprobs_of(steps))


@pytest.mark.parametrize("tree", [7, "off"])
def test_sampled_rounds_of_the_real_drafter_report_the_targets_own(pair, tree):
    block_size = 8 if tree == "off" else "auto"  # a tree of N nodes sets the width itself
    settings = GenerationSettings(SAMPLED, max_tokens=24, block_size=block_size, tree=tree, logprobs=TOP, seed=11)
    steps = list(generate_steps(pair.target, PROMPT, settings, drafter=pair.drafter))
    assert all(s.tree == (tree != "off") for s in steps[1:-1])
    assert_the_targets_own(pair, PROMPT, tokens_of(steps), logprobs_of(steps))


def test_width_one_rounds_of_the_drafting_loop_report_the_targets_own(muse_pair):
    settings = GenerationSettings(max_tokens=10, block_size=8, logprobs=0)
    steps = list(generate_steps(muse_pair.target, PROMPT, settings, drafter=muse_pair.drafter, policy=AlwaysPlain()))
    assert all(s.drafted == 0 for s in steps)
    assert_the_targets_own(muse_pair, PROMPT, tokens_of(steps), logprobs_of(steps), top=0)


class CountingTrees:
    """MLX's draft trees, counting the log-probability tables asked of it."""

    def __init__(self):
        self.tables = 0

    def __getattr__(self, name):
        return getattr(mlx_trees, name)

    def token_logprobs(self, *args, **kwargs):
        self.tables += 1
        return mlx_trees.token_logprobs(*args, **kwargs)

    def round_logprobs(self, *args, **kwargs):
        self.tables += 1
        return mlx_trees.round_logprobs(*args, **kwargs)


class Seam:
    """`target` with counting trees, recording the arrays each host read takes."""

    def __init__(self, target):
        self._target = target
        self.trees = CountingTrees()
        self.reads: list[int] = []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def read(self, *arrays):
        self.reads.append(sum(a is not None for a in arrays))
        return self._target.read(*arrays)


@pytest.mark.parametrize("how", ["plain", "chain", "tree"])
def test_they_change_no_token_ride_on_the_one_read_and_cost_nothing_when_off(muse_pair, how):
    settings = GenerationSettings(SAMPLED, max_tokens=20, seed=7, speculative=how != "plain")
    settings = settings.updated(**({"block_size": 4, "tree": "off"} if how == "chain" else {"tree": 5}))
    runs = {}
    for logprobs in (None, 2):
        seam = Seam(muse_pair.target)
        asked = settings.updated(logprobs=logprobs)
        steps = list(generate_steps(seam, PROMPT, asked, drafter=muse_pair.drafter))
        runs[logprobs] = (tokens_of(steps), seam)
        assert all((s.logprobs is None) == (logprobs is None) for s in steps)
        assert len(seam.reads) == len(steps)  # one host read per target call, either way
    (off_tokens, off), (on_tokens, on) = runs[None], runs[2]
    assert on_tokens == off_tokens
    assert off.trees.tables == 0 and on.trees.tables == len(on.reads)
    assert [n + 1 for n in off.reads] == on.reads  # the table is one more array of the same read


def test_the_api_reports_one_per_returned_token_and_none_for_the_stop_token(muse_pair):
    result = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=40, block_size=4, logprobs=2)
    chunks = list(mlx_glimmer.stream_generate(muse_pair, PROMPT, max_tokens=40, block_size=4, logprobs=2))
    assert [lp.token for lp in result.logprobs] == result.token_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert [lp for c in chunks for lp in c.logprobs] == result.logprobs
    stop = result.token_ids[10]
    settings = GenerationSettings(max_tokens=40, block_size=4, logprobs=2)
    steps = list(generate_steps(muse_pair.target, PROMPT, settings, drafter=muse_pair.drafter, stop_ids=[stop]))
    assert steps[-1].stopped and len(steps[-1].logprobs) == len(steps[-1].tokens)  # the loop has the stop token's
    chunks = list(
        chunks_from_steps(muse_pair.tokenizer, (s for s in steps), GenerationStats(), 40, time.perf_counter(), float)
    )
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == result.token_ids[:10] and [lp.token for c in chunks for lp in c.logprobs] == ids
    assert mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=5, speculative=False).logprobs is None


@pytest.mark.parametrize("value", [21, -1, True, 2.0, "3"])
def test_a_bad_logprobs_setting_is_refused_naming_it(value):
    with pytest.raises(SamplingError, match="logprobs"):
        GenerationSettings(logprobs=value)


def test_a_prompts_own_are_the_targets_after_the_tokens_before_it(muse_pair):
    tokens = PROMPT + list(b" there was a princess")
    whole = prompt_logprobs(muse_pair.target, tokens, 3)
    assert whole[0] is None and len(whole) == len(tokens)
    assert_the_targets_own(muse_pair, tokens[:1], tokens[1:], whole[1:], top=3)
    chunked = prompt_logprobs(muse_pair.target, tokens, 3, chunk=7)  # a prefill in chunks, past the window
    assert chunked[0] is None
    assert_the_targets_own(muse_pair, tokens[:1], tokens[1:], chunked[1:], top=3)
    assert mlx_glimmer.prompt_logprobs(muse_pair, tokens, 3) == whole


@pytest.fixture(scope="module")
def torch_muse(checkpoints):
    from mlx_glimmer.torch_backend import load_torch

    return load_torch(target=checkpoints["muse"], drafter=checkpoints["assistant"], device="cpu")


@pytest.mark.parametrize("tree", [None, "off", 7], ids=["plain", "chain", "tree"])
def test_torch_reports_the_targets_own_in_the_one_read(torch_muse, muse_pair, tree):
    settings = GenerationSettings(SAMPLED, max_tokens=16, block_size=4, logprobs=3, speculative=tree is not None)
    settings = settings.updated(tree=tree)
    seam = Seam(torch_muse.target)
    seam.trees = torch_muse.target.trees
    steps = list(generate_steps(seam, PROMPT, settings, drafter=torch_muse.drafter))
    assert len(seam.reads) == len(steps)
    assert_the_targets_own(muse_pair, PROMPT, tokens_of(steps), logprobs_of(steps), top=3)
    echo = prompt_logprobs(torch_muse.target, PROMPT, 3)
    assert_the_targets_own(muse_pair, PROMPT[:1], PROMPT[1:], echo[1:], top=3)


def test_generate_json_prints_them_with_the_flag(checkpoints, capsys):
    argv = ["generate", str(checkpoints["muse"]), "--prompt", "Hi", "--max-tokens", "6", "--prompt-lookup", "--json"]
    assert main([*argv, "--logprobs", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [lp["token"] for lp in out["logprobs"]] == out["token_ids"]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in out["logprobs"])
    assert main(argv) == 0 and "logprobs" not in json.loads(capsys.readouterr().out)
    for extra, says in ((["--logprobs", "21"], "--logprobs"), (["--logprobs", "x"], "--logprobs")):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert main([a for a in argv if a != "--json"] + ["--logprobs", "2"]) == 2
    assert "--logprobs needs --json" in capsys.readouterr().err


# ---- the server ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(checkpoints):
    """(test client, the pair it serves) on the tiny Muse target, greedy by default."""
    pair = mlx_glimmer.load(target=checkpoints["muse"], drafter=checkpoints["assistant"])
    worker = GenerationWorker(lambda: pair, max_queue=8, prompt_cache_bytes=1 << 26)
    worker.start()
    server = ServerState(worker, "tiny", GenerationSettings(max_tokens=8), model_context(pair))
    with TestClient(create_app(server), raise_server_exceptions=False) as client:
        yield client, pair
    worker.close(timeout=5)


ASK = [{"role": "user", "content": "Tell me a story"}]


def close(a, b) -> bool:
    """JSON values alike, floats to `TOL` (a second request may verify other widths: its logits differ in the
    last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= TOL
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def events_of(r) -> list[dict]:
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_chat_reports_what_the_api_reports_whole_and_streamed(served):
    client, pair = served
    body = {"messages": ASK, "max_tokens": 8, "logprobs": True, "top_logprobs": 3}
    whole = client.post("/v1/chat/completions", json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    api = mlx_glimmer.generate(pair, ASK, max_tokens=8, logprobs=3)
    assert len(content) == whole["usage"]["completion_tokens"] == len(api.logprobs)
    for entry, lp in zip(content, api.logprobs):
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=TOL)
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx([v for _, v in lp.top], abs=TOL)
    streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [e["choices"][0] for e in events_of(streamed) if e["choices"]]
    pieces = [entry for c in chunks if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert close(pieces, content)
    plain = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 8}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completions_report_the_legacy_shape_and_echo_the_prompts_own(served):
    client, pair = served
    prompt = "Once upon a time"
    body = {"prompt": prompt, "max_tokens": 6, "logprobs": 2, "echo": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    ids = list(pair.tokenizer.encode(prompt))
    own = mlx_glimmer.prompt_logprobs(pair, ids, 2)
    api = mlx_glimmer.generate(pair, prompt, max_tokens=6, logprobs=2)
    assert choice["text"].startswith(prompt)
    assert len(logprobs["tokens"]) == len(ids) + len(api.token_ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [lp.logprob for lp in own[1:] + api.logprobs]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=TOL)
    assert all(len(top) <= 3 for top in logprobs["top_logprobs"][1:])  # two alternatives and the chosen token
    offsets, texts = logprobs["text_offset"], logprobs["tokens"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], texts[: len(ids)]))
    assert offsets[len(ids)] == len(prompt)  # the completion's first token starts after the echoed prompt

    events = events_of(client.post("/v1/completions", json={**body, "stream": True}))
    first = events[0]["choices"][0]
    assert first["text"] == prompt and first["logprobs"]["token_logprobs"][0] is None
    joined = {key: [v for e in events if e["choices"][0]["logprobs"] for v in e["choices"][0]["logprobs"][key]]
              for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}  # fmt: skip
    assert close(joined, logprobs)

    echoed = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "echo": True}).json()
    assert echoed["choices"][0]["text"].startswith(prompt) and echoed["choices"][0]["logprobs"] is None
    alone = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "logprobs": 0}).json()
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        [lp.logprob for lp in api.logprobs], abs=TOL
    )


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": ASK, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": True, "n": 2}, "n"),
        ("/v1/chat/completions", {"messages": ASK, "logprobs": 2}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 1, "n": 3}, "n"),
    ],
)
def test_bad_logprobs_fields_get_a_400_naming_the_field(served, path, body, param):
    client, _ = served
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


@pytest.fixture(scope="module")
def batching(pair):
    """A generation worker decoding concurrent requests together, on the pair."""
    worker = GenerationWorker(lambda: pair, max_queue=8, prompt_cache_bytes=1 << 26, batch=BatchSettings(max_batch=4))
    worker.start()
    yield worker
    worker.close(timeout=10)


def answered(events: queue.Queue) -> tuple[list[Delta], Finished]:
    """A job's `Delta`s and its `Finished` event."""
    deltas = []
    while not isinstance(event := events.get(timeout=slow_machine_timeout()), Finished):
        assert not isinstance(event, Failed), event.message
        deltas.append(event)
    return deltas, event


def test_a_request_decoded_in_a_batch_reports_the_targets_own_as_it_does_alone(pair, batching):
    """Three requests decoded together, two asking for log-probabilities (with 4 and 0 alternatives): each gets
    the tokens it gets alone, and those asking get, per token, the log-softmax of the target's own logits at its
    position and the values they get alone; the third gets none."""
    prompts = [PROMPT, PROMPT + list(b" in a land"), [256] + list(b"The river ran")]
    tops = [TOP, None, 0]
    queues = []
    for prompt, top in zip(prompts, tops):
        events: queue.Queue = queue.Queue()
        settings = GenerationSettings(max_tokens=16, block_size=4, logprobs=top)
        batching.submit(Job(GenerationRequest(prompt, settings), events.put))
        queues.append(events)
    for prompt, top, events in zip(prompts, tops, queues):
        deltas, done = answered(events)
        assert done.batch_size == 3 and done.batched_tokens > 0
        alone = mlx_glimmer.generate(replace(pair, drafter=copy.copy(pair.drafter)), prompt, max_tokens=16,
                                     block_size=4, logprobs=top)  # fmt: skip
        assert done.token_ids == alone.token_ids
        if top is None:
            assert all(d.logprobs is None for d in deltas)
            continue
        logprobs = [lp for d in deltas for lp in d.logprobs or []]
        assert_the_targets_own(pair, prompt, done.token_ids, logprobs, top=top)
        for lp, own in zip(logprobs, alone.logprobs, strict=True):
            assert lp.logprob == pytest.approx(own.logprob, abs=TOL)
            assert [v for _, v in lp.top] == pytest.approx([v for _, v in own.top], abs=TOL)
