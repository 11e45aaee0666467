"""Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` (one entry per token with its text,
bytes and `top_logprobs`) and the legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.
`TokenPieces` gives each token's exact bytes and text."""

from __future__ import annotations

import functools

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from ..logprobs import TokenLogprob


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, read backwards: the character a byte-level BPE vocabulary writes -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenPieces:
    """Each token's own bytes and text, as log-probabilities report them (a token may hold part of a
    character: its text then shows U+FFFD, its bytes are exact). Read from the vocabulary the way mlx-lm's
    detokenizer for this tokenizer reads it: byte-level BPE pieces through GPT-2's byte alphabet,
    SentencePiece pieces with their word marker as a space, any other tokenizer by decoding the token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer

    def bytes(self, token: int) -> bytes:
        detok = self.detokenizer
        if isinstance(detok, BPEStreamingDetokenizer) and token < len(detok.tokenmap):
            table = _byte_of_char()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in detok.tokenmap[token])
        if isinstance(detok, SPMStreamingDetokenizer) and token < len(detok.tokenmap):
            return detok.tokenmap[token].replace("\u2581".encode("utf-8"), b" ")
        return self.tokenizer.decode([token]).encode("utf-8")

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", "replace")

    def entry(self, token: int, logprob: float) -> dict:
        """{token, logprob, bytes}: one token of chat's `logprobs.content` or its `top_logprobs`."""
        return {"token": self.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}


def chat_logprobs(pieces: TokenPieces, logprobs: list[TokenLogprob]) -> dict:
    """Chat's `choices[i].logprobs`: per token its text, log-probability, bytes and `top_logprobs`."""
    return {
        "content": [
            {**pieces.entry(lp.token, lp.logprob), "top_logprobs": [pieces.entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(
    pieces: TokenPieces, tokens: list[int], logprobs: list[TokenLogprob | None], offsets: list[int]
) -> dict:
    """The legacy completions' `choices[i].logprobs` for `tokens` (their entries in `logprobs`: None for a
    prompt's first token, which has none): texts, log-probabilities, the alternatives with the chosen token
    among them (as OpenAI gives them: up to `logprobs` + 1), and each token's `offsets` in the choice's text."""
    texts = [pieces.text(t) for t in tokens]
    top = []
    for lp in logprobs:
        if lp is None:
            top.append(None)
            continue
        alternatives = {pieces.text(t): v for t, v in lp.top}
        alternatives.setdefault(pieces.text(lp.token), lp.logprob)
        top.append(alternatives)
    return {
        "tokens": texts,
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": list(offsets),
    }
