"""The target as the loop sees it: the `TargetModel` protocol, written once for every array library (MLX's
`target.Target`, torch's `torch_backend.target.TorchTarget`), and the sampling and tree ops it carries."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from .noise import Noise
from .settings import SamplingParams
from .tree import MODEL, DraftTree

Array = Any  # an mx.array or a torch.Tensor, whichever the target computes with


class SamplingOps(Protocol):
    """One array library's `sampling` module (`mlx_glimmer.sampling`, `torch_backend.sampling`)."""

    def probabilities(self, logits: Array, params: SamplingParams) -> Array: ...
    def argmax(self, logits: Array) -> Array: ...
    # row i: the sample of position where.start + i; `tokens`: the ids of the columns (default 0..V-1)
    def sample(self, probs: Array, where: Noise, tokens: Array | None = None) -> Array: ...
    def gumbel_scores(self, probs: Array, where: Noise) -> Array: ...  # log probs + noise: argmax is the sample
    def spread(self, probs: Array, ids: Array, vocab_size: int) -> Array: ...  # [n, len(ids)] -> [n, vocab_size]
    def greedy_verdict(self, draft: Array, target_logits: Array) -> Array: ...  # [accepted, next token], lazy


class TreeOps(Protocol):
    """Draft trees on one array library (`tree.Trees` over its `array_ops.ArrayOps`): builds, judges and reads
    trees, and computes the log-probabilities of what a round commits."""

    def chain(self, tokens: Array, source: int = MODEL) -> DraftTree: ...
    def merged_tree(self, log_probs: Array, budget: int, lookup: list[int], vocab: Array | None) -> DraftTree: ...
    def verdict(self, tree: DraftTree, logits: Array, params: SamplingParams, noise: Noise | None) -> Array: ...
    def chain_verdict(self, tree: DraftTree, judged: Array) -> Array: ...
    def read_path(self, values: list[int], size: int) -> Any: ...  # a `tree.Path`
    def token_logprobs(self, logits: Array, tokens: Array, top: int, rows: Array | None = None) -> Array: ...
    def round_logprobs(self, logits: Array, tree: DraftTree, verdict: Array, top: int) -> Array: ...


class TargetModel(Protocol):
    """The target on one array library (`target.Target`, `torch_backend.target.TorchTarget`):
    all that the loop needs and that differs between libraries.

    forward(tokens, cache, capture)  tokens [L] -> final hidden states [L, H] and, with capture, the
                                     outputs of the layers named by `capture(layer_ids)` [L, k*H] (else None);
                                     with `tree`, [anchor, nodes] attending to their ancestors only
    keep(cache, positions, width)    after a verify of `width`, keep `positions` of it in order (a tree's path)
    head(hidden)                     logits [L, V] as the model's own forward computes them
    make_cache(reserve)              a KV cache that rolls back at least `reserve` tokens at any length
    trim(cache, n)                   forget the last n positions (n <= 0: nothing)
    join(*ids)                       token arrays end to end, on the device
    launch(*arrays) / sync(...)      start computing / finish computing (the cache's contents too)
    read(*arrays)                    the one blocking host read of a round: integer entries, end to end
    lazy                             True where work only runs when launched or read (MLX): the loop then
                                     queues the next round before yielding this one
    memory                           `memory.DeviceMemory`: clear_cache cadence (a no-op off Metal)

    The drafters also read its shape (`hidden_size`, `num_layers`, `vocab_size`), embed tokens with its
    table and borrow its head; `generate` reports its peak memory.
    """

    sampling: SamplingOps
    trees: TreeOps
    lazy: bool
    memory: Any
    model: Any  # the library's own model: its weights stay resident while it generates
    tree_unsupported: str | None  # why it verifies chains only, trees never (None: trees too): `tree_check.py`

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def activation_dtype(self) -> Any: ...  # the dtype of its hidden states (a drafter's weights take it)

    def capture(self, layer_ids: Sequence[int]) -> None: ...
    def forward(
        self, tokens: Array, cache: Any, capture: bool, tree: DraftTree | None = None
    ) -> tuple[Array, Array | None]: ...
    def head(self, hidden: Array) -> Array: ...
    def make_cache(self, reserve: int) -> Any: ...
    def can_trim(self, cache: Any, n: int) -> bool: ...
    def trim(self, cache: Any, n: int) -> None: ...
    def keep(self, cache: Any, positions: list[int], width: int) -> None: ...  # after a verify: keep those, in order
    def tokens(self, ids: Sequence[int] | Array) -> Array: ...  # token ids as this library's array
    def join(self, *ids: Array) -> Array: ...
    def launch(self, *arrays: Array | None) -> None: ...
    def sync(self, *arrays: Array | None, cache: Any = None) -> None: ...
    def read(self, *arrays: Array | None) -> list[int]: ...
    def embed(self, ids: Array) -> Array: ...  # raw rows of the token embedding table
    def head_rows(self, ids: Array) -> Callable[[Array], Array]: ...  # the head over vocabulary rows `ids` only
    def reset_peak_memory(self) -> None: ...
    def peak_memory_gb(self) -> float: ...
    def last_logits(self, tokens: list[int]) -> Any: ...  # float32 numpy logits [V] after a full forward
