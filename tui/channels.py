"""Split Muse Glimmer's channel-framed output into reasoning and answer.

A Muse turn is a run of messages, each behind a header
(as `mlx_lm/chat_templates/muse_spark.py` describes the family's format):

    to=self<|message|>reasoning<|eom|>
    <|start|>assistant to=NAME<|message|><atem:function_calls>...<|eom|>
    <|start|>assistant to=user<|message|>answer<|eot|>

Header text is dropped. The markers need not be single tokens, so this works
on decoded text. Output without any header is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HEADERS = {
    "to=self<|message|>": "reasoning",
    "to=user<|message|>": "answer",
    "to=commentary<|message|>": "answer",
    "<atem:function_calls>": "tool",
}
ENDS = {
    "reasoning": {"<|eom|>": "header"},
    "answer": {"<|eom|>": "header", "<|eot|>": "answer"},
    "tool": {"<|eom|>": "header"},
}


@dataclass
class Channels:
    blocks: list[tuple[str, str]] = field(default_factory=list)  # (kind, text) in order: reasoning, answer, tool
    framed: bool = False

    @property
    def answer(self) -> str:
        return "".join(t for k, t in self.blocks if k == "answer").strip()

    @property
    def reasoning(self) -> list[str]:
        """Reasoning and tool-call blocks, in order: everything shown apart from the answer."""
        return [t.strip() for k, t in self.blocks if k != "answer" and t.strip()]


def _partial_marker(text: str, markers) -> int:
    """Length of the longest tail of `text` that could still grow into one of `markers`."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def is_framed(text: str, final: bool = True) -> bool:
    if any(h in text for h in HEADERS):
        return True
    head = text.lstrip()
    return not final and bool(head) and any(h.startswith(head) for h in HEADERS)


def split_channels(text: str, final: bool = True) -> Channels:
    """Split decoded output; with `final=False` a marker cut off at the end is held back."""
    if not is_framed(text, final):
        return Channels([("answer", text)] if text else [], framed=False)
    blocks: list[list[str]] = []
    state, pos = "header", 0
    while True:
        markers = HEADERS if state == "header" else ENDS[state]
        hits = [(i, m) for m in markers if (i := text.find(m, pos)) >= 0]
        end = min(hits)[0] if hits else len(text)
        piece = text[pos:end]
        if not hits and not final:
            piece = piece[: len(piece) - _partial_marker(piece, markers)]
        if state != "header":
            blocks[-1][1] += piece
        if not hits:
            break
        i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
        pos = i + len(marker)
        new = markers[marker]
        if new != state and new != "header":
            blocks.append([new, ""])
        state = new
    return Channels([(k, t) for k, t in blocks], framed=True)
