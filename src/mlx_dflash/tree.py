"""DDTree: verify the draft's most likely continuations as a tree, in one target pass.

A block draft gives a distribution at every slot; a chain verifies only its argmax. A tree
holds the ``budget`` most likely prefixes under the product of those marginals (best first,
``build_tree``), all verified at once: node positions are the block's start plus their depth
(siblings share one), and each node sees the whole past and, inside the tree, exactly its
ancestors (``DraftTree.ancestors``). The walk then follows the target's own choice at each
node (argmax, or its sample) while that is one of the node's children; the first choice
without a matching child is the bonus token. Every kept token is the target's own choice, so
the output is the target's at any temperature. The target side (positions, mask, moving the
kept nodes' keys and values together) is ``Target.verify_tree`` and ``rollback.keep_path``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from .cpu_kernels import logsumexp


@dataclass
class DraftTree:
    """Nodes depth first, the root (the block's first token) at index 0 and each node's more
    likely children before its others: the draft's own chain is nodes 0, 1, 2, ..., so a walk
    along it keeps nodes already in place (``rollback.keep_path`` moves nothing)."""

    tokens: list[int]
    parents: list[int]  # -1 for the root
    depths: list[int]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[dict[int, int]]:
        """Per node, its children by token."""
        children: list[dict[int, int]] = [{} for _ in self.tokens]
        for node in range(1, self.size):
            children[self.parents[node]][self.tokens[node]] = node
        return children

    def ancestors(self) -> np.ndarray:
        """[size, size] bool: row i marks node i and its ancestors (what node i attends to)."""
        seen = np.zeros((self.size, self.size), dtype=bool)
        for node in range(self.size):
            if node:
                seen[node] = seen[self.parents[node]]
            seen[node, node] = True
        return seen

    def walk(self, choices: list[int]) -> tuple[list[int], int]:
        """(the accepted path of node indices from the root, the bonus token): follow the
        target's choice after each node while it is one of that node's children."""
        children = self.children()
        path = [0]
        while choices[path[-1]] in children[path[-1]]:
            path.append(children[path[-1]][choices[path[-1]]])
        return path, choices[path[-1]]


def build_tree(root: int, logprobs: np.ndarray, ids: np.ndarray, budget: int) -> DraftTree:
    """The ``budget`` most likely prefixes (plus the root) under per-depth log-probabilities.

    ``logprobs`` / ``ids`` [depth, K]: each depth's top K candidates, best first. Best first
    over rank tuples: popping a prefix that ends in rank r at depth d pushes its next sibling
    (rank r + 1) and its first child (rank 0 at depth d + 1), so each pop is the best prefix
    not taken yet, and the set is closed under prefixes (a tree)."""
    depth_max, k = logprobs.shape
    popped: list[tuple[int, int, int]] = []  # (depth, token, parent's pop index or -1 for the root)
    heap = [(-float(logprobs[0, 0]), 0, 0, 0, -1)] if depth_max and k else []  # (-score, order, depth-1, rank, parent)
    order = 1
    while heap and len(popped) < budget:
        negative, _, depth, rank, parent = heapq.heappop(heap)
        popped.append((depth + 1, int(ids[depth, rank]), parent))
        me = len(popped) - 1
        if rank + 1 < k:
            sibling = negative + float(logprobs[depth, rank] - logprobs[depth, rank + 1])
            heapq.heappush(heap, (sibling, order, depth, rank + 1, parent))
            order += 1
        if depth + 1 < depth_max:
            heapq.heappush(heap, (negative - float(logprobs[depth + 1, 0]), order, depth + 1, 0, me))
            order += 1
    children: dict[int, list[int]] = {}  # pop index (-1: the root) -> its children's, in pop order: best first
    for pop, (_, _, parent) in enumerate(popped):
        children.setdefault(parent, []).append(pop)
    tokens, parents, depths = [root], [-1], [0]
    stack = [(pop, 0) for pop in reversed(children.get(-1, []))]  # (pop index, its parent's node)
    while stack:
        pop, parent = stack.pop()
        depth, token, _ = popped[pop]
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        stack += [(child, len(tokens) - 1) for child in reversed(children.get(pop, []))]
    return DraftTree(tokens, parents, depths)


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(log-probabilities, ids) [depth, k] of each row's ``k`` most likely tokens, best first."""
    logits = logits.astype(mx.float32)
    k = min(k, logits.shape[-1])
    ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[:, :k] if k < logits.shape[-1] else \
        mx.broadcast_to(mx.arange(k), logits.shape)
    values = mx.take_along_axis(logits, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    logprobs = mx.take_along_axis(values, order, axis=-1) - logsumexp(logits)
    return logprobs, mx.take_along_axis(ids, order, axis=-1)


def draft_tree(root: int, logits: mx.array, budget: int, columns: Optional[mx.array] = None) -> DraftTree:
    """The tree of ``budget`` nodes from a draft's logits [depth, V] (one host read); ``columns``:
    the token id of each column (a draft vocabulary's; None: the column's own index). Over a
    draft vocabulary the log-probabilities are normalized over it."""
    logprobs, ids = top_candidates(logits, budget)
    return build_tree(root, np.array(logprobs), np.array(ids if columns is None else columns[ids]), budget)


def tree_mask(tree: DraftTree, sequential: mx.array, first_column: int, window: Optional[int] = None) -> mx.array:
    """The attention mask of a tree's verify from the mask a chain of ``tree.size`` tokens
    would get (``sequential``, [size, keys]): node i sees the past that the chain's token at
    its depth sees, and in the tree's columns (from ``first_column``) its ancestors (those
    within a sliding ``window``)."""
    n, keys = tree.size, sequential.shape[-1]
    depths = np.array(tree.depths)
    inside = tree.ancestors()
    if window is not None:
        inside &= (depths[:, None] - depths[None, :]) < window
    past = sequential.reshape(-1, n, keys)[-1][mx.array(depths)]  # (a mask may carry leading axes)
    columns = np.arange(keys) - first_column
    in_tree = (columns >= 0) & (columns < n)
    own = np.zeros((n, keys), dtype=bool)
    own[:, in_tree] = inside[:, columns[in_tree]]
    return mx.where(mx.array(in_tree), mx.array(own), past.astype(mx.bool_))
