"""A completion's text continues its prompt, as the tokenizer reads the two together.

`/v1/completions` answers with what the generated tokens add to the prompt's text: `decode(prompt + answer)`
after `decode(prompt)`, leading space kept (" Paris" after "The capital of France is"), as OpenAI and vLLM
give it. With `echo` the text is the prompt (as given: a string as it is, token ids decoded), then that. A
prompt of token ids may end inside a character: the character is the completion's (its first character, sent
whole once its last bytes come), so the echoed prompt stops before it; no replacement character is ever sent
that a later token would change. `text_offset` indexes the choice's text. All alike streamed or not, with or
without log-probabilities, decoded alone or together with another request.

Each is checked against the tokenizer itself, for three kinds of tokenizer: SentencePiece with byte fallback (a
tiny checkpoint given one: its decode drops the leading space of a text's first word), byte-level BPE without
merges (the tiny checkpoints' own: one byte a token) and byte-level BPE with merges (the demo target,
SmolLM2-135M, through `mlx-glimmer serve`, hence `network`). On the tiny checkpoints the target's replies are
scripted (tests/scripted_serve.py), so each prompt is followed by a known text: a word after a space, a word
after a word, the rest of a word, a character split across tokens; a scripted target decodes alone, so two
requests decoded together run on the tiny llama as it writes (random bytes), each checked against the tokens
the server committed for it.
"""

from __future__ import annotations

import json
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from scripted_serve import ScriptedTarget
from slow_machine import slow_machine_timeout

import mlx_glimmer
from mlx_glimmer.server.app import ServerState, create_app, model_context
from mlx_glimmer.server.batch import BatchPolicy
from mlx_glimmer.server.continuation import Continuation
from mlx_glimmer.server.run import Finished
from mlx_glimmer.server.worker import GenerationWorker
from mlx_glimmer.settings import BatchSettings, GenerationSettings

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCRIPT = "The capital of France is Paris. Ça coûte 5 €."  # what the scripted targets write ('T' only once)
PROMPTS = [
    "The capital of France is",  # followed by " Paris": a word after a space
    "The capital of France is Paris. Ça coûte 5 ",  # ends in a space; followed by "€"
    "The capital of France is Paris. Ça co",  # mid-word; followed by "ûte"
]
MAX_TOKENS = 8
KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
SPM_PIECES = ["▁", "▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "▁co", "ût", "e", ".", "▁Ç", "a"]


def write_sentencepiece_tokenizer(path) -> None:
    """A Llama-style SentencePiece tokenizer in 272 ids: <unk> <s> </s>, the 256 byte-fallback pieces, then a few
    words; `<s>` starts every encoded text, and decoding drops the leading space of the first word."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(piece, -1.0 - 1 / len(piece)) for piece in SPM_PIECES]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def sentencepiece_target(checkpoints, tmp_path_factory):
    """The tiny llama target with a SentencePiece tokenizer instead of its byte-level one."""
    path = tmp_path_factory.mktemp("spm") / "target"
    shutil.copytree(checkpoints["llama"], path)
    for old in path.iterdir():
        if old.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            old.unlink()
    write_sentencepiece_tokenizer(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2}))
    return path


def scripted(pair):
    """`pair` whose target writes SCRIPT: after its first token (the marker), every next token is SCRIPT's."""
    script = list(pair.tokenizer.encode(SCRIPT))
    eos = min(pair.tokenizer.eos_token_ids)
    return replace(pair, target=ScriptedTarget(pair.target, script[0], [([], script[1:] + [eos])], eos)), script


class Served:
    """An in-process server on `pair` (its worker's committed tokens recorded per prompt, as the answers' ids)."""

    def __init__(self, pair, script: list[int] | None = None, max_batch: int = 8):
        self.tokenizer, self.script = pair.tokenizer, script
        self.worker = GenerationWorker(
            lambda: pair, max_queue=8, prompt_cache_bytes=1 << 26, batch=BatchSettings(max_batch)
        )
        self.worker.start()
        self.answers: dict[tuple, list[int]] = {}
        submit = self.worker.submit

        def recording(job):
            emit = job.emit

            def record(event):
                if isinstance(event, Finished):
                    self.answers[tuple(job.request.prompt_tokens)] = event.token_ids
                emit(event)

            job.emit = record
            with self.lock:
                self.held.append(job)
                if len(self.held) < self.hold:
                    return
                jobs, self.held, self.hold = self.held, [], 1
            for queued in jobs:
                submit(queued)

        self.lock, self.held, self.hold = threading.Lock(), [], 1
        self.worker.submit = recording
        state = ServerState(self.worker, "tiny", GenerationSettings(max_tokens=MAX_TOKENS), model_context(pair))
        self.client = TestClient(create_app(state), raise_server_exceptions=False)

    def post(self, body: dict):
        return self.client.post("/v1/completions", json=body)

    def queue_together(self, n: int) -> None:
        """The next `n` requests reach the worker at once, whichever order and pace they arrive in: none
        starts alone before the others wait. The batch policy starts afresh (nothing measured: it batches)."""
        self.hold, self.worker.policy = n, BatchPolicy()

    def answer(self, prompt) -> list[int]:
        return self.answers[tuple(prompt_ids(self.tokenizer, prompt))]

    def close(self):
        self.client.close()
        self.worker.close(timeout=5)


@pytest.fixture(scope="module", params=["sentencepiece", "byte_level"])
def served(request, checkpoints):
    target = (
        request.getfixturevalue("sentencepiece_target") if request.param == "sentencepiece" else checkpoints["llama"]
    )
    pair, script = scripted(mlx_glimmer.load(target=target, drafter=checkpoints["llama_assistant"]))
    server = Served(pair, script)
    yield server
    server.close()


def prompt_ids(tokenizer, prompt) -> list[int]:
    return list(prompt) if isinstance(prompt, list) else list(tokenizer.encode(prompt))


def split_characters(tokenizer, script: list[int]) -> list[list[int]]:
    """Prompts of token ids that end inside a character of `script` (every such cut)."""
    return [script[:k] for k in range(2, len(script)) if tokenizer.decode(script[:k]).endswith("\ufffd")]


def cases(served: Served) -> list:
    """Every prompt: the text ones (which the tokenizer splits as it splits SCRIPT), then token ids ending inside
    a character."""
    for prompt in PROMPTS:
        assert prompt_ids(served.tokenizer, prompt) == served.script[: len(prompt_ids(served.tokenizer, prompt))]
    return PROMPTS + split_characters(served.tokenizer, served.script)


def continuation(tokenizer, prompt, answer: list[int]) -> tuple[str, str]:
    """(the prompt's text as echoed, what the answer adds to it): `decode(prompt + answer)` after
    `decode(prompt)`; a prompt of token ids leaves a character it ends inside of to the answer."""
    ids = prompt_ids(tokenizer, prompt)
    whole, before = tokenizer.decode(ids + answer), tokenizer.decode(ids)
    if isinstance(prompt, list):
        before = before.rstrip("\ufffd")
    assert whole.startswith(before)
    return (prompt if isinstance(prompt, str) else before), whole[len(before) :]


def complete(post, prompt, **fields) -> dict:
    """The completion's choice (`text`, `logprobs`, and our `glimmer` figures), whole or joined from its chunks."""
    r = post({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    if not fields.get("stream"):
        return {**r.json()["choices"][0], "glimmer": r.json()["glimmer"]}
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(line) for line in lines[:-1]]
    choices = [c for e in events for c in e["choices"]]
    lists = [c["logprobs"] for c in choices if c["logprobs"]]
    logprobs = {key: [v for lp in lists for v in lp[key]] for key in KEYS} if lists else None
    glimmer = next(e["glimmer"] for e in events if "glimmer" in e)
    return {"text": "".join(c["text"] for c in choices), "logprobs": logprobs, "glimmer": glimmer}


def assert_offsets_index_the_text(choice: dict, start: int = 0) -> None:
    """Each token stands at its `text_offset` in the choice's text (one holding part of a character where that
    character starts, so only the order is checked), from the `start`-th token on."""
    text, tokens, offsets = choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert len(offsets) == len(tokens) and offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
    for i, (token, offset) in enumerate(zip(tokens, offsets)):
        if i >= start and "\ufffd" not in token:
            assert text[offset : offset + len(token)] == token, (i, token, offset, text)


def leading(served: Served, prompt) -> int:
    """Tokens at an echoed prompt's start that are not in its text as they are: `<s>`, and the first word
    whose leading space SentencePiece's decoding drops."""
    ids = prompt_ids(served.tokenizer, prompt)
    return 2 if served.tokenizer.decode(ids[:1]) == "<s>" else 0


# ---- the tiny checkpoints, scripted ----------------------------------------------------------------------


def test_the_text_is_what_the_answer_adds_to_the_prompts_text(served):
    for prompt in cases(served):
        choice = complete(served.post, prompt)
        answer = served.answer(prompt)
        assert answer == served.script[len(prompt_ids(served.tokenizer, prompt)) :][:MAX_TOKENS]
        assert choice["text"] == continuation(served.tokenizer, prompt, answer)[1], prompt


def test_echo_gives_the_prompt_then_what_follows_as_the_tokenizer_decodes_them_together(served):
    for prompt in cases(served):
        text = complete(served.post, prompt, echo=True)["text"]
        ids, answer = prompt_ids(served.tokenizer, prompt), served.answer(prompt)
        assert text == "".join(continuation(served.tokenizer, prompt, answer)), prompt
        if leading(served, prompt) == 0:  # the tokenizer reads the prompt back as it was given
            assert text == served.tokenizer.decode(ids + answer)


def test_a_stream_sends_the_same_text_and_never_a_character_it_takes_back(served):
    """The chunks only ever add to the text, so text that reads as expected once joined was never sent wrong."""
    for prompt in cases(served):
        for echo in (False, True):
            streamed = complete(served.post, prompt, echo=echo, stream=True)["text"]
            echoed, after = continuation(served.tokenizer, prompt, served.answer(prompt))
            assert streamed == (echoed + after if echo else after), (prompt, echo)
            assert complete(served.post, prompt, echo=echo)["text"] == streamed


def test_text_offset_indexes_the_text_whole_and_streamed(served):
    for prompt in cases(served):
        for stream in (False, True):
            plain = complete(served.post, prompt, logprobs=3, stream=stream)
            echoed, after = continuation(served.tokenizer, prompt, served.answer(prompt))
            assert plain["text"] == after and plain["logprobs"]["text_offset"][0] == 0
            assert_offsets_index_the_text(plain)
            echo = complete(served.post, prompt, logprobs=3, echo=True, stream=stream)
            assert echo["text"] == echoed + after
            assert echo["logprobs"]["text_offset"][len(prompt_ids(served.tokenizer, prompt))] == len(echoed)
            assert_offsets_index_the_text(echo, start=leading(served, prompt))


def test_the_detokenizer_reads_any_tokens_after_any_prompt_as_the_tokenizer_does(served):
    """Random tokens (bytes that split characters, or are no UTF-8 at all) cut anywhere: the text is what the
    tokenizer decodes, and what it held at each token is a start of it. Only where the tokenizer itself reads
    every start of the tokens as a start of the whole: SentencePiece's byte fallback reads a run of byte pieces
    that is no UTF-8 as one U+FFFD a piece, a valid character before the bad bytes included, so it takes back
    what a shorter run read as."""
    rng, kept = random.Random(0), 0
    tokenizer = served.tokenizer
    vocab = range(3, 272) if tokenizer.decode([1]) == "<s>" else range(256)
    for _ in range(400):
        ids = [rng.choice(vocab) for _ in range(rng.randint(2, 12))]
        whole = tokenizer.decode(ids)
        if not all(whole.startswith(tokenizer.decode(ids[:k]).rstrip("\ufffd")) for k in range(1, len(ids))):
            continue
        kept += 1
        cut = rng.randint(1, len(ids) - 1)
        detok = Continuation(tokenizer, ids[:cut], ids_prompt=True)
        held = []
        for token in ids[cut:]:
            detok.add_token(token)
            held.append(detok.text)
        detok.finalize()
        assert detok.text == continuation(tokenizer, ids[:cut], ids[cut:])[1], ids
        assert all(detok.text.startswith(text) for text in held), ids
    assert kept >= 100


# ---- decoded together with another request: the tiny llama, as it writes --------------------------------


@pytest.fixture(scope="module")
def llama_served(llama_pair):
    server = Served(llama_pair, max_batch=2)
    yield server
    server.close()


def test_two_requests_decoded_together_each_continue_their_own_prompt(llama_served):
    """A long prompt and a short one, each ending inside a character (token ids) their answers complete, asked at
    once: both batched, each text (echoed or not, streamed or not) what its answer adds to its prompt."""
    lead = 0xCE  # of a Greek letter
    long = list(("Un café, s'il vous plaît. " * 90).encode())[:2195] + [lead]  # 2,196 tokens
    short = [256] + list("Le thé est à ".encode()) + [lead]
    for echo, stream in ((False, False), (True, True)):
        llama_served.answers.clear()
        llama_served.queue_together(2)
        fields = {"max_tokens": 24, "echo": echo, "stream": stream, "logprobs": 2}
        with ThreadPoolExecutor(2) as pool:
            choices = list(pool.map(lambda p: complete(llama_served.post, p, **fields), (long, short)))
        for prompt, choice in zip((long, short), choices):
            assert choice["glimmer"]["batch_size"] == 2 and choice["glimmer"]["batched_tokens"] > 0
            answer = llama_served.answer(prompt)
            assert 0x80 <= answer[0] < 0xC0  # it completes the prompt's last character
            echoed, after = continuation(llama_served.tokenizer, prompt, answer)
            assert choice["text"] == (echoed + after if echo else after), (echo, stream)
            assert_offsets_index_the_text(choice)


# ---- the demo target through `mlx-glimmer serve`: SmolLM2, as it writes --------------------------------

DEMO_PROMPTS = ["The capital of France is", "The capital of France is ", "The capital of Fra"]
DEMO_SPLIT = "The capital of Japan is 東京"  # its tokens split both characters


@pytest.fixture(scope="module")
def demo(demo_server, demo_pair):
    import httpx2 as httpx

    def post(body):
        timeout = slow_machine_timeout(body.get("max_tokens", 16), requests=2)  # two may be asked at once
        return httpx.post(demo_server.url + "/completions", json={"model": "demo", **body}, timeout=timeout)

    return post, demo_pair


def demo_answer(pair, prompt, max_tokens: int = MAX_TOKENS) -> list[int]:
    """The target's greedy answer, as the server gives a request decoded alone (or together, but for a tie)."""
    ids = prompt_ids(pair.tokenizer, prompt)
    return mlx_glimmer.generate(pair, ids, max_tokens=max_tokens, temperature=0.0, speculative=False).token_ids


@pytest.mark.network
def test_demo_completions_continue_the_prompt_as_smollm2_decodes_them(demo):
    post, pair = demo
    tokenizer = pair.tokenizer
    split = split_characters(tokenizer, list(tokenizer.encode(DEMO_SPLIT)))
    assert split and complete(post, DEMO_PROMPTS[0])["text"].startswith(" Paris")
    for prompt in DEMO_PROMPTS + split:
        ids, answer = prompt_ids(tokenizer, prompt), demo_answer(pair, prompt)
        echoed, after = continuation(tokenizer, prompt, answer)
        assert complete(post, prompt)["text"] == after, prompt
        for stream in (False, True):
            choice = complete(post, prompt, echo=True, logprobs=3, stream=stream)
            assert choice["text"] == echoed + after == tokenizer.decode(ids + answer), (prompt, stream)
            assert_offsets_index_the_text(choice)
            assert choice["logprobs"]["text_offset"][len(ids)] == len(echoed)


@pytest.mark.network
def test_demo_two_requests_decoded_together_each_continue_their_own_prompt(demo):
    post, pair = demo
    prompts = [DEMO_PROMPTS[0], list(pair.tokenizer.encode(DEMO_SPLIT))[:-1]]  # the second ends inside '京'
    fields = {"max_tokens": 16, "logprobs": 1}
    with ThreadPoolExecutor(2) as pool:
        choices = list(pool.map(lambda p: complete(post, p, **fields), prompts))
    assert max(c["glimmer"]["batch_size"] for c in choices) == 2
    for prompt, choice in zip(prompts, choices):
        assert choice["text"] == continuation(pair.tokenizer, prompt, demo_answer(pair, prompt, 16))[1], prompt
        assert_offsets_index_the_text(choice)
