"""Many answers at once on torch: a fixed number of slots, each refilled with the next prompt as its answer ends.

This is the answer generator of `distill` on a CPU, where the answers, not the training, bound how much data
a sitting yields. transformers' `generate` spends most of a batched step outside the model's matrix products
here: its `DynamicCache` concatenates every layer's keys and values each step (a copy of the whole cache),
and rows whose answer has ended keep computing until the longest one ends. Its continuous batching
(`generate_batch`) pages attention in a form that is slower still on a CPU.

Here every layer's keys and values live in one buffer [slots, kv heads, capacity, head dim] written in
place, each slot at its own position; a decode step is one forward of one token per slot, with each slot's
position as `position_ids` and a 4D mask that shows each slot its own entries (within the window on a
sliding layer). A slot whose answer ended takes the next prompt in the next refill: the prompts are
prefilled right-padded, several per forward up to `prefill_tokens` padded positions (`batching.py`: the
whole refill in one forward pads to its longest prompt and outgrows the caches), and their entries written
into the free slots. Once no prompt waits, the buffer shrinks to the slots still answering, so the tail of a
run does not drag idle rows along.

The model is the transformers decoder `TorchTarget` wraps, so any model that takes `position_ids` and a
custom mask (what a tree verify needs, `target.tree_refusal`) can run here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from ..batching import BATCH_TOKENS, length_groups
from .target import TorchTarget, layer_masks


class SlotCache:
    """The cache object the decoder's attention layers call `update` on: writes in place, returns the keys
    and values the current forward attends to."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows: torch.Tensor | None = None  # prefill: the slots written; decode: None (every slot)
        self.width = 0  # prefill: the padded prompt width
        self.positions: torch.Tensor | None = None  # decode: each slot's position
        self.span = 0  # decode: keys attended to (the longest slot's length after this token)

    def prefill(self, rows: torch.Tensor, width: int) -> None:
        self.rows, self.width, self.positions = rows, width, None

    def decode(self, positions: torch.Tensor, span: int) -> None:
        self.rows, self.positions, self.span = None, positions, span

    def keep(self, rows: torch.Tensor) -> None:
        """Only these slots remain, in this order."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.slots = len(rows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == len(self.keys):
            shape = (self.slots, key_states.shape[1], self.capacity, key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros(shape))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.rows is not None:
            keys[self.rows, :, : self.width] = key_states
            values[self.rows, :, : self.width] = value_states
            return key_states, value_states
        every = torch.arange(self.slots, device=keys.device)
        keys[every, :, self.positions] = key_states[:, :, 0]
        values[every, :, self.positions] = value_states[:, :, 0]
        return keys[:, :, : self.span], values[:, :, : self.span]


def slot_masks(target: TorchTarget, seen: torch.Tensor, distance: torch.Tensor):
    """`layer_masks` from which keys each query may see (`seen`, [rows, queries, keys]) and how far back each key
    lies (`distance`)."""
    return layer_masks(target, lambda window: seen if window is None else seen & (distance < window))


class SlotGenerator:
    """`generate` yields (index into `prompts`, answer ids) as each answer ends, stop token included."""

    def __init__(self, target: TorchTarget, stop_ids, *, slots: int = 64, prefill_tokens: int = BATCH_TOKENS):
        if target.tree_unsupported is not None:
            raise ValueError(f"batched answers need per-token positions and masks: {target.tree_unsupported}")
        self.target, self.slots, self.prefill_tokens = target, slots, prefill_tokens
        self.stop_ids = set(int(t) for t in stop_ids)
        self.device = target.device

    def _forward(self, cache: SlotCache, ids: torch.Tensor, positions: torch.Tensor, mask) -> torch.Tensor:
        out = self.target.decoder(
            input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, **{self.target.cache_kw: cache}
        )
        return out.last_hidden_state

    def _pick(self, hidden: torch.Tensor, temperature: float, generator) -> list[int]:
        logits = self.target.head(hidden).float()
        if temperature <= 0:
            return logits.argmax(-1).tolist()
        # By the inverse of each row's cumulative distribution, one uniform draw a row: `torch.multinomial` draws
        # one exponential per vocabulary entry, and on a 49k vocabulary that was a third of a sampled batch's time.
        cumulative = torch.softmax(logits / temperature, dim=-1).cumsum(-1)
        draw = torch.rand(len(cumulative), 1, generator=generator, device=cumulative.device) * cumulative[:, -1:]
        return torch.searchsorted(cumulative, draw, right=True)[:, 0].clamp(max=cumulative.shape[-1] - 1).tolist()

    def _prefill(
        self, cache: SlotCache, prompts: list[list[int]], rows: list[int], temperature, generator
    ) -> list[int]:
        """Write the prompts' entries into slots `rows` in one right-padded forward; each prompt's first token."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)
        steps = torch.arange(width, device=self.device)
        positions = steps.expand(len(prompts), width)
        seen = (steps[None, :] <= steps[:, None]).expand(len(prompts), width, width)
        distance = (steps[:, None] - steps[None, :]).expand(len(prompts), width, width)
        cache.prefill(torch.tensor(rows, device=self.device), width)
        hidden = self._forward(cache, ids, positions, slot_masks(self.target, seen, distance))
        ends = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        return self._pick(hidden[torch.arange(len(prompts)), ends], temperature, generator)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> Iterator[tuple[int, list[int]]]:
        if not prompts:
            return
        if max_tokens < 1:
            for i in range(len(prompts)):
                yield i, []
            return
        generator = torch.Generator(device=self.device).manual_seed(seed)
        slots = min(self.slots, len(prompts))
        cache = SlotCache(slots, max(len(p) for p in prompts) + max_tokens)
        waiting = deque(range(len(prompts)))
        owner: list[int | None] = [None] * slots  # prompt index answered in each slot
        answers: dict[int, list[int]] = {}
        length = torch.zeros(slots, dtype=torch.long, device=self.device)  # entries each slot holds
        last = [0] * slots  # each slot's newest token, the next decode's input
        refill_at = max(1, slots // 8)  # prefill free slots in groups, not one prompt per step

        def settle(slot: int, token: int):
            """Append a token to the slot's answer; return the finished answer when it ends."""
            index = owner[slot]
            answer = answers[index]
            answer.append(token)
            last[slot] = token
            if token in self.stop_ids or len(answer) >= max_tokens:
                owner[slot] = None
                return index, answers.pop(index)
            return None

        while waiting or any(o is not None for o in owner):
            free = [s for s in range(len(owner)) if owner[s] is None]
            busy = len(owner) - len(free)
            if waiting and free and (len(free) >= refill_at or busy == 0):
                take = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                for group in length_groups([len(prompts[i]) for i in take], self.prefill_tokens):
                    rows, indices = [free[g] for g in group], [take[g] for g in group]
                    firsts = self._prefill(cache, [prompts[i] for i in indices], rows, temperature, generator)
                    for slot, index, token in zip(rows, indices, firsts):
                        owner[slot] = index
                        answers[index] = []
                        length[slot] = len(prompts[index])
                        done = settle(slot, token)
                        if done:
                            yield done
                continue
            if not waiting and busy <= len(owner) // 2 and busy:
                kept = [s for s in range(len(owner)) if owner[s] is not None]
                cache.keep(torch.tensor(kept, device=self.device))
                owner = [owner[s] for s in kept]
                last = [last[s] for s in kept]
                length = length[kept]
            span = int(length.max()) + 1
            keys = torch.arange(span, device=self.device)
            seen = (keys[None, :] <= length[:, None])[:, None]
            distance = (length[:, None] - keys[None, :])[:, None]
            cache.decode(length, span)
            ids = torch.tensor(last, device=self.device)[:, None]
            hidden = self._forward(cache, ids, length[:, None], slot_masks(self.target, seen, distance))
            length += torch.tensor([o is not None for o in owner], device=self.device)
            tokens = self._pick(hidden[:, 0], temperature, generator)
            for slot, token in enumerate(tokens):
                if owner[slot] is not None:
                    done = settle(slot, token)
                    if done:
                        yield done
