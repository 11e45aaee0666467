"""A completion's text: its tokens decoded as they read after its prompt.

mlx-lm's streaming detokenizers read generated tokens as a text of their own, and for byte-level BPE and
SentencePiece tokenizers that drops the first token's leading space (" Paris" after "The capital of France
is" reads "Paris"), as decoding drops it at the start of a text. Chat replies want that; a completion continues
its prompt, and its text is what the generated tokens add to the prompt's: `tokenizer.decode(prompt +
generated)` after `tokenizer.decode(prompt)`, leading space kept, as OpenAI and vLLM give it.

`Continuation` decodes that incrementally, as vLLM does: each new token by decoding a few tokens of context
with and without the tokens not yet sent, any tokenizer alike. Text ending in a replacement character waits
for the next token (bytes of a character split across tokens), so nothing sent is ever taken back. A prompt of
token ids may itself end inside a character: that character is then the completion's, sent whole once its
last bytes come, and the prompt's own text (`prompt_text`, what `echo` shows) stops before it.
"""

from __future__ import annotations

import os

REPLACEMENT = "\ufffd"
CONTEXT = 5  # prompt tokens decoded with the first generated ones (a word's pieces, a split character's bytes)


def prompt_text(tokenizer, prompt: list[int]) -> str:
    """The text of a prompt given as token ids, up to any character it ends inside of (which the completion
    finishes)."""
    return tokenizer.decode(prompt).rstrip(REPLACEMENT)


def shared_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


class Continuation:
    """A streaming detokenizer (mlx-lm's interface: `reset`, `add_token`, `finalize`, `text`, `last_segment`)
    for the tokens that follow `prompt`: `text` is what they add to its text so far, complete characters only
    until `finalize`. `ids_prompt`: the prompt came as token ids, so it may end inside a character (a text
    prompt cannot: a replacement character ending it is its own).

    `take_offsets()` gives where each token whose text is out since the last call stands in `text`: the length
    of the longest start of `text` that the tokens before it read as (a token holding part of a character
    stands where that character starts)."""

    def __init__(self, tokenizer, prompt: list[int], ids_prompt: bool = False):
        self.tokenizer = tokenizer
        self.prompt = list(prompt)
        self.ids_prompt = ids_prompt
        self.reset()

    def reset(self) -> None:
        self.tokens = list(self.prompt)
        self.read = len(self.tokens)  # the text of the tokens before this is out ...
        self.start, self.head = self.context(CONTEXT)  # ... read from `start` as `head`
        whole, back = self.decode(0), CONTEXT
        while self.start > 0 and not self.reads_as(whole):
            back *= 2
            self.start, self.head = self.context(back)
        self.whole = True  # `read` stands between two characters, where decoding may start afresh
        if self.ids_prompt and self.head.endswith(REPLACEMENT):  # the completion's (as in `prompt_text`)
            self.head, self.whole = self.head.rstrip(REPLACEMENT), False
        self.text = ""
        self.offset = 0
        self.offsets: list[int] = []  # of the tokens sent, not yet taken

    def reads_as(self, prompt: str) -> bool:
        """Whether the prompt's tokens from `start` read as the end of its text `prompt` does: a few tokens of
        context may start inside a character, or inside a run of bytes that a tokenizer reads as one
        (SentencePiece's byte fallback), and a prompt of ids must show where its final replacement characters
        start."""
        return prompt.endswith(self.head) and (not self.ids_prompt or bool(self.head.rstrip(REPLACEMENT)))

    def context(self, tokens: int) -> tuple[int, str]:
        start = max(0, self.read - tokens)
        return start, self.decode(start)

    def decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.tokens[start:end])

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.flush(force=False)

    def finalize(self) -> None:
        self.flush(force=True)

    def flush(self, force: bool) -> None:
        """Send what the tokens after `read` add, unless it may still change (force: send it anyway)."""
        if self.read == len(self.tokens):
            return
        window = self.decode(self.start)
        if window.endswith(REPLACEMENT) and not force:
            return
        shared, before = shared_prefix(self.head, window), len(self.text)
        for end in range(self.read, len(self.tokens)):  # each token sent now stands after what those before read
            known = self.head if end == self.read and self.whole else self.decode(self.start, end)
            self.offsets.append(before + max(0, shared_prefix(known, window) - shared))
        self.text += window[shared:]
        if self.whole:  # else a run of bytes starting inside a character would read as replacement characters
            self.start = self.read
        self.read, self.whole = len(self.tokens), not window.endswith(REPLACEMENT)
        self.head = self.decode(self.start)

    def take_offsets(self) -> list[int]:
        offsets, self.offsets = self.offsets, []
        return offsets

    @property
    def last_segment(self) -> str:
        """The text added since the last time this was read."""
        segment = self.text[self.offset :]
        self.offset = len(self.text)
        return segment


def text_offsets(tokenizer, tokens: list[int], text: str) -> list[int]:
    """Where each of `tokens` (a whole prompt's) stands in `text`, the prompt's text. A tokenizer that reads
    the tokens back with something before `text` (`<s>`, a leading space) has them counted from where `text`
    starts there."""
    detok = Continuation(tokenizer, [])
    for token in tokens:
        detok.add_token(token)
    detok.finalize()
    extra = len(detok.text) - len(text) if detok.text.endswith(text) else 0
    return [min(max(offset - extra, 0), len(text)) for offset in detok.take_offsets()]
