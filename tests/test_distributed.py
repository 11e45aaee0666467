"""A target split across two processes by `mlx.launch` (ring backend over loopback) generates what one process
generates: speculative equal to plain token for token past the sliding window, plain equal to one process's
plain (or parting only at a floating-point tie), one answer printed by rank 0, and commands that cannot run
split refused in one error line."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from slow_machine import slow_machine_timeout
from split_generate import PROMPT

import mlx_glimmer
from mlx_glimmer import launcher
from mlx_glimmer.cli import main
from mlx_glimmer.distributed import check_divisible
from mlx_glimmer.divergence import explain_first_divergence, next_token_logits
from mlx_glimmer.errors import GlimmerError
from mlx_glimmer.generate import encode_prompt
from mlx_glimmer.ranks import loopback_ports

TOKENS = 32  # after a 17-token prompt: six times the tiny targets' sliding window of 8
LAUNCH = Path(sys.executable).parent / "mlx.launch"
COMMAND = Path(sys.executable).parent / "mlx-glimmer"
TESTS = Path(__file__).parent


def launch(command: list, generations: int) -> subprocess.CompletedProcess:
    """`command` on two ranks under `mlx.launch --backend ring`. Every generation's forwards wait on both
    processes, so the time allowed grows with the work (`generations` of TOKENS tokens) and stays generous for
    a busy machine; on a timeout the whole process group goes."""
    timeout = 240 + 4 * TOKENS * generations
    cmd = [
        str(LAUNCH),
        "-n",
        "2",
        "--backend",
        "ring",
        "--starting-port",
        str(loopback_ports(2)),
        "--",
        *map(str, command),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mlx.launch ran past {timeout}s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines the ranks wrote, as the launcher relays them. It prints its own coloured `[WARN]` lines
    in several writes from another thread than the relay, so a rank's line can land inside one of them
    (`\x1b[33m[WARN] error: ...`): the line is read from its `error:` on."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)
    return [m.group(0) for m in re.finditer(r"\berror: .*", plain)]


def one_json_line(result: subprocess.CompletedProcess) -> dict:
    lines = result.stdout.splitlines()
    assert len(lines) == 1, f"expected one line on stdout, got {len(lines)}:\n{result.stdout[:2000]}\n{result.stderr}"
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def split_runs(checkpoints):
    """`split_generate.py` on two ranks: every generation of the Muse and Llama targets, split."""
    c = checkpoints
    script = [sys.executable, TESTS / "split_generate.py", c["muse"], c["assistant"], c["llama"]]
    return one_json_line(launch([*script, c["llama_assistant"], TOKENS], generations=8))


def test_each_rank_holds_half_of_every_decoder_layer(split_runs, muse_pair):
    """Every projection of a decoder layer is halved; only its norms (vectors of the hidden size) stay whole."""
    from mlx.utils import tree_flatten

    layers = tree_flatten(muse_pair.target.model.model.parameters()["layers"])
    norms = sum(v.nbytes for name, v in layers if "norm" in name)
    projections = sum(v.nbytes for name, v in layers if "norm" not in name)
    assert split_runs["world"] == 2 and split_runs["target"] == "SplitTarget"
    assert split_runs["layer_bytes"] == [projections // 2 + norms] * 2


@pytest.mark.parametrize("way", ["spec_block4", "spec_auto", "oracle_block8", "oracle_auto"])
def test_split_speculative_equals_split_plain_past_the_window(split_runs, way):
    muse = split_runs["muse"]
    assert len(muse["plain"]) == TOKENS
    assert muse[way] == muse["plain"]


def test_split_oracle_rounds_run_long_and_end_at_its_lies(split_runs):
    """The oracle lies every few tokens: rounds both fill the block of 8 and stop early, and still agree."""
    lengths = split_runs["muse"]["oracle_acceptance"]
    assert max(lengths) == 8 and min(lengths) < 8


def test_split_auto_rounds_take_the_widths_rank_0_chose(split_runs):
    """Under `auto` the widths follow each process's timings, yet both ranks ran the same rounds (or the answer
    would not have come, equal to plain: above): with the oracle, rounds verify drafts. Which widths they take
    follows the machine's timings (under load one width can win every round), so only that drafting rounds ran
    is asserted here."""
    widths = split_runs["muse"]["oracle_auto_widths"]
    assert max(widths) > 1 and len(widths) < TOKENS


def same_or_tie(target, prompt: list[int], reference: list[int], tokens: list[int]) -> None:
    """`tokens` equal `reference` (one process's plain greedy), or part from it first where one process's own
    logits hold the two tokens within float32 rounding."""
    kernels = {"one process": lambda context: next_token_logits(target, context, 1)}
    d = explain_first_divergence(kernels, "float32", prompt, reference, tokens)
    assert len(tokens) == len(reference)
    assert d is None or d["tie"], f"split and one process disagree beyond a tie: {d}"


def test_split_plain_equals_one_process_plain(split_runs, muse_pair):
    one = mlx_glimmer.generate(muse_pair, PROMPT, max_tokens=TOKENS, temperature=0, speculative=False).token_ids
    same_or_tie(muse_pair.target, PROMPT, one, split_runs["muse"]["plain"])


def test_llama_splits_by_mlx_lm_shard(split_runs, llama_pair):
    llama = split_runs["llama"]
    one = mlx_glimmer.generate(llama_pair, PROMPT, max_tokens=TOKENS, temperature=0, speculative=False).token_ids
    assert llama["spec_block4"] == llama["plain"]
    same_or_tie(llama_pair.target, PROMPT, one, llama["plain"])


def test_generate_under_mlx_launch_prints_one_answer(checkpoints, muse_pair):
    prompt = "Once upon a time"
    command = [COMMAND, "generate", checkpoints["muse"], "--drafter", checkpoints["assistant"], "--prompt", prompt]
    result = launch([*command, "--max-tokens", TOKENS, "--temp", "0", "--block-size", "4", "--json"], generations=1)
    answer = one_json_line(result)
    assert "error:" not in result.stderr
    one = mlx_glimmer.generate(muse_pair, prompt, max_tokens=TOKENS, temperature=0, speculative=False)
    same_or_tie(muse_pair.target, encode_prompt(muse_pair.tokenizer, prompt), one.token_ids, answer["token_ids"])
    assert answer["generated_tokens"] == TOKENS and answer["drafter_kind"] != "none"


def test_other_commands_under_mlx_launch_are_refused_in_one_line(checkpoints):
    result = launch([COMMAND, "bench", checkpoints["muse"]], generations=0)
    errors = error_lines(result.stderr)
    assert result.stdout == ""
    assert len(errors) == 1 and "bench" in errors[0] and "`generate`, `serve`, `chat`" in errors[0], result.stderr
    # rank 1 leaves without an error of its own (one would let the launcher stop rank 0 before its line); it may be
    # stopped by the launcher (-15) once rank 0 has failed, on a busy machine
    rank1_codes = [int(code) for code in re.findall(r"rank 1 exited with code (-?\d+)", result.stderr)]
    assert "rank 0 exited with code 2" in result.stderr and all(code <= 0 for code in rank1_codes), result.stderr


def test_a_wrong_flag_under_mlx_launch_is_said_once_by_rank_0(checkpoints):
    """Every rank meets the same wrong flag; rank 0's line comes alone, and the launcher is not left waiting."""
    result = launch([COMMAND, "generate", checkpoints["muse"], "hi", "--max-tokens", "0"], generations=0)
    errors = error_lines(result.stderr)
    assert len(errors) == 1 and "--max-tokens" in errors[0] and "rank" not in errors[0], result.stderr
    assert "rank 0 exited with code 2" in result.stderr, result.stderr


def test_an_error_only_another_rank_meets_is_said_with_its_rank(monkeypatch, capsys):
    """A rank other than 0 holds its error back (rank 0 failing alike speaks first and the launcher stops the
    rest), then says it, naming itself: a file missing on its host alone still shows."""
    waits = []
    monkeypatch.setattr(launcher.time, "sleep", waits.append)
    monkeypatch.setenv("MLX_RANK", "1")
    assert main(["generate", str(TESTS / "no-such-bundle"), "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: rank 1: ") and waits == [launcher.FOLLOWER_ERROR_WAIT]
    monkeypatch.setenv("MLX_RANK", "0")
    assert main(["generate", str(TESTS / "no-such-bundle"), "hi"]) == 2
    lead = capsys.readouterr().err
    assert lead.startswith("error: ") and "rank" not in lead
    assert waits == [launcher.FOLLOWER_ERROR_WAIT]


class SplitServer:
    """`serve` on two ranks under `mlx.launch`: its stderr kept in `log`, its URL once rank 0 prints it."""

    def __init__(self, command: list, timeout: float):
        cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(loopback_ports(2)), "--"]
        # Ctrl-C as from a terminal: not ignored, as it is in a shell's background job (where this suite may run)
        self.proc = subprocess.Popen(
            [*cmd, *map(str, command)],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.log: list[str] = []
        self.lines: queue.Queue = queue.Queue()
        self.drainer = threading.Thread(target=self.drain, daemon=True)
        self.drainer.start()
        deadline = time.monotonic() + timeout
        while " at http://" not in (line := self.lines.get(timeout=max(0.1, deadline - time.monotonic())) or ""):
            if line is None or self.proc.poll() is not None:
                self.kill()
                pytest.fail("serve under mlx.launch exited before it was ready:\n" + "".join(self.log))
        self.url = line.split(" at ")[-1].strip()

    def drain(self):
        for line in self.proc.stderr:
            self.log.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def chat(self, body: dict, timeout: float) -> dict:
        """A chat completion's message, finish reason and usage (streamed: put together from its chunks)."""
        r = httpx.post(self.url + "/chat/completions", json={"temperature": 0, **body}, timeout=timeout)
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            choice = r.json()["choices"][0]
            return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"]}
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        return {"content": content, "finish_reason": [c["choices"][0]["finish_reason"] for c in chunks][-1]}

    def interrupt(self, timeout: float) -> None:
        """Ctrl-C to every rank (as a terminal sends it; the launcher itself is spared, to report their
        exits), and wait until they are all gone and `log` holds everything they wrote."""
        ranks = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(int(pid), signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("serve under mlx.launch did not stop on Ctrl-C:\n" + "".join(self.log))
        self.drainer.join(timeout)  # its last lines may still be in the pipe when the process is gone

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_serve_under_mlx_launch_answers_as_one_process_and_stops_cleanly(checkpoints, muse_pair):
    """Rank 0 serves, the other rank follows: answers streamed or not are one process's greedy answers; a
    request stopped early by a stop string (rank 0 closes its generation mid-way) leaves both ranks in step for
    a follow-up turn, which extends the cached conversation; Ctrl-C stops both ranks."""
    tokens = 24
    wait = slow_machine_timeout(tokens)
    command = [COMMAND, "serve", checkpoints["muse"], "--drafter", checkpoints["assistant"], "--port", "0"]
    server = SplitServer(command, slow_machine_timeout(tokens, requests=2))
    try:
        question = [{"role": "user", "content": "Once upon a time"}]
        one = mlx_glimmer.generate(muse_pair, question, max_tokens=tokens, temperature=0).text
        answer = server.chat({"messages": question, "max_tokens": tokens}, wait)
        assert answer == {"content": one, "finish_reason": "length"}
        assert server.chat({"messages": question, "max_tokens": tokens, "stream": True}, wait) == answer

        half = one[len(one) // 2 :]
        stop = next(ch for ch in half if ch != "\ufffd" and one.index(ch) > 0)
        cut = server.chat({"messages": question, "max_tokens": tokens, "stop": [stop]}, wait)
        assert cut == {"content": one[: one.index(stop)], "finish_reason": "stop"}

        follow_up = [*question, {"role": "assistant", "content": one}, {"role": "user", "content": "And then?"}]
        then = mlx_glimmer.generate(muse_pair, follow_up, max_tokens=tokens, temperature=0).text
        assert server.chat({"messages": follow_up, "max_tokens": tokens, "stream": True}, wait)["content"] == then
    except BaseException:
        server.kill()
        raise
    server.interrupt(slow_machine_timeout())
    log = "".join(server.log)
    assert "every process stopped" in log and "Traceback" not in log, f"launcher exit {server.proc.returncode}:\n{log}"
    assert server.proc.returncode == 0 and "exited with code" not in log and "was killed" not in log, log


def test_heads_that_do_not_divide_over_the_ranks_are_refused(muse_pair, tmp_path):
    """Four query heads and two key/value heads split over two processes, not over three."""
    config = tmp_path / "config.json"
    check_divisible(muse_pair.target.model, SimpleNamespace(size=lambda: 2), config)
    with pytest.raises(GlimmerError, match=r"config\.json: num_attention_heads 4 does not divide over 3 processes"):
        check_divisible(muse_pair.target.model, SimpleNamespace(size=lambda: 3), config)


def test_chat_calls_on_two_ranks_answer_as_one_process(checkpoints, muse_pair):
    """The chat app's calls on rank 0 (turns, one cancelled after its first round, a follow-up on the same
    cache, a resumed chat's cache rebuilt) while the other rank follows: the same answers and caches as in one
    process, and both ranks end when rank 0 stops."""
    from split_chat import chat

    script = [sys.executable, TESTS / "split_chat.py", checkpoints["muse"], checkpoints["assistant"], TOKENS]
    split = one_json_line(launch(script, generations=5))
    one = chat(muse_pair, TOKENS)
    assert split["cancelled"]["cancelled"] and len(split["cancelled"]["tokens"]) < TOKENS
    assert split["rebuilt"] == len(split["follow_up"]["processed"])
    assert split == one
