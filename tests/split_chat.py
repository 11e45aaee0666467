"""A chat on a split target, as the chat app's jobs make their calls (`tui/jobs.py`): rank 0 loads, measures
the verify cost, answers a turn, answers one cancelled after its first round, answers a follow-up on the same
decode state, then rebuilds a resumed chat's cache on a fresh state and answers on it; the other rank follows
(`follower.follow`). Rank 0 prints one JSON line: each answer's token ids and what the cache held after it.

    mlx.launch -n 2 --backend ring -- python split_chat.py TARGET DRAFTER TOKENS
"""

import json
import sys
import threading

from mlx_glimmer import lockstep
from mlx_glimmer.decode_state import DecodeState
from mlx_glimmer.follower import follow
from mlx_glimmer.loading import load
from mlx_glimmer.ranks import split_group
from mlx_glimmer.tui.session import Conversation, Settings, rebuild_state, run_turn


def chat(pair, tokens: int) -> dict:
    """The calls of a chat session, in the app's order; works the same in one process."""
    conversation = Conversation(Settings().with_changes(temperature=0, max_tokens=tokens, seed=0))
    lockstep.calibrate(pair, conversation.settings.generation)
    state, out = DecodeState(), {}

    def turn(name: str, user: str, cancel_after_first: bool = False) -> None:
        cancel = threading.Event()
        messages = conversation.messages(user)
        progress = (lambda text, stats: cancel.set()) if cancel_after_first else None
        answer = run_turn(
            pair,
            messages,
            state=state,
            cancel=cancel,
            on_progress=progress,
            progress_interval=0.0,
            **conversation.generation_kwargs(),
        )
        out[name] = {"tokens": answer.token_ids, "cancelled": answer.cancelled, "processed": list(state.processed)}
        if not answer.cancelled:
            conversation.turns.append(answer)

    turn("first", "Once upon a time")
    turn("cancelled", "Tell me more", cancel_after_first=True)
    turn("follow_up", "And then?")
    held = list(state.processed)
    state = DecodeState()
    out["rebuilt"] = rebuild_state(pair, held, state, conversation.settings)
    turn("after_rebuild", "What next?")
    return out


if __name__ == "__main__":
    target, drafter, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if split_group() is not None and split_group().rank() > 0:
        sys.exit(follow(lambda: load(target, drafter=drafter)))
    result = chat(lockstep.load(lambda: load(target, drafter=drafter)), tokens)
    lockstep.stop()
    print(json.dumps(result))
