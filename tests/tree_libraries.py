"""The array libraries the draft-tree module runs on (`tree.Trees` over MLX's and torch's `ArrayOps`), for tests
that run the same cases on each: the `lib` fixture of a test module is one of `LIBRARIES`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import numpy as np

from mlx_glimmer.torch_backend import sampling as torch_sampling
from mlx_glimmer.torch_backend.array_ops import torch_ops
from mlx_glimmer.tree import DraftTree, Trees, mlx_trees


@dataclass(frozen=True)
class Library:
    name: str
    trees: Trees

    def floats(self, values) -> Any:
        return self.trees.ops.array(np.asarray(values, dtype=np.float32).tolist(), self.trees.ops.float32)

    def ints(self, values) -> Any:
        return self.trees.ops.array(np.asarray(values).tolist(), self.trees.ops.index)

    def tokens(self, values) -> Any:
        return self.trees.ops.array(np.asarray(values).tolist(), self.trees.ops.token)

    def eval(self, arrays: list) -> None:
        if self.name == "mlx":
            mx.eval(arrays)

    def with_ops(self, **primitives) -> Library:
        """This library with some primitives replaced."""
        return replace(self, trees=replace(self.trees, ops=replace(self.trees.ops, **primitives)))

    def handmade_tree(self, parents: list[int], tokens: list[int], sources: list[int] | None = None) -> DraftTree:
        """A `DraftTree` from parent indices (0: the anchor) and tokens, nodes numbered from 1, parents first."""
        depths = [0]
        for p in parents:
            depths.append(depths[p] + 1)
        parents_arr = self.ints(parents)
        return DraftTree(
            self.tokens(tokens),
            parents_arr,
            self.ints(depths),
            self.ints(sources or [1] * len(parents)),
            self.trees.ancestor_matrix(parents_arr, max(depths)),
            max(depths),
        )


LIBRARIES = {
    "mlx": Library("mlx", mlx_trees),
    "torch": Library("torch", Trees(torch_ops("cpu"), torch_sampling.probabilities)),
}
