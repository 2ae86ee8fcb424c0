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

Where the engine queues cycles ahead (greedy, GPUs), the tree is built and walked on the device
instead (``device_tree``, ``DeviceTree.walk``), so a tree's cycle needs no host read before the
next is queued: it picks the same best prefixes among those that leave the draft's argmax at
most ``DEVICE_DEVIATIONS`` times, each time to one of its ``DEVICE_RANKS`` best candidates
(a fixed candidate table, so every shape is known in advance).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import mlx.core as mx
import numpy as np

from .cpu_kernels import logsumexp

DEVICE_RANKS = 4  # a device-built tree's candidates per depth
DEVICE_DEVIATIONS = 2  # how often one of its prefixes may leave the draft's argmax
# Subtracted per depth from a prefix's score: a child then always scores below its parent, also
# where a draft certain of a token gives it a log-probability of exactly 0 (the top B stay a tree).
DEPTH_TIE_BREAK = 1e-6


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


@dataclass
class DeviceTree:
    """A tree built on the device (``device_tree``): [n] arrays, the root at index 0, and
    [n, n] ``ancestors`` (row i: node i and its ancestors)."""

    tokens: mx.array
    depths: mx.array
    ancestors: mx.array
    parents: mx.array  # the root's is itself

    @property
    def size(self) -> int:
        return self.tokens.size

    def walk(self, choices: mx.array) -> tuple[mx.array, mx.array]:
        """The greedy walk, on the device: (the nodes reordered, the accepted path from the
        root first, [n]; the number of accepted drafts, [1]). A node is on the path when every
        node from the root to it is the target's choice after its parent."""
        matches = (self.tokens == choices[self.parents]) | (mx.arange(self.size) == 0)
        on_path = ~mx.any(self.ancestors & ~matches[None, :], axis=1)
        order = mx.argsort(mx.where(on_path, self.depths, self.size + mx.arange(self.size)))
        accepted = mx.max(mx.where(on_path, self.depths, 0)).reshape(1)
        return order, accepted


@lru_cache(maxsize=8)
def candidate_table(depth: int, k: int, deviations: int) -> tuple[mx.array, mx.array, mx.array]:
    """Every prefix of up to ``depth`` ranks below ``k`` with at most ``deviations`` ranks other
    than 0, as (ranks [C, depth], -1 past its length; its length [C]; where its last rank is
    in a flattened [depth, k] table [C])."""
    prefixes: list[tuple[int, ...]] = [()]
    table = []
    for _ in range(depth):  # (each round: the prefixes one rank longer)
        prefixes = [p + (r,) for p in prefixes for r in range(k) if r == 0 or sum(x > 0 for x in p) < deviations]
        table += prefixes
    ranks = np.full((len(table), depth), -1, dtype=np.int32)
    for row, prefix in enumerate(table):
        ranks[row, : len(prefix)] = prefix
    lengths = (ranks >= 0).sum(axis=1).astype(np.int32)
    last = (lengths - 1) * k + ranks[np.arange(len(table)), lengths - 1]
    return mx.array(ranks), mx.array(lengths), mx.array(last)


def device_candidates(depth: int, k: int) -> int:
    """How many prefixes a device-built tree picks from (a larger budget: ``build_tree``)."""
    return candidate_table(depth, k, DEVICE_DEVIATIONS)[0].shape[0]


def device_tree(root: mx.array, logits: mx.array, budget: int, columns: Optional[mx.array] = None) -> DeviceTree:
    """The tree of ``budget`` nodes after ``root`` ([1]) from a draft's logits [depth, V], built
    on the device: the ``budget`` best of the candidate prefixes (``candidate_table``) under the
    product of the depths' probabilities, as ``draft_tree``'s among them."""
    depth = logits.shape[0]
    logprobs, ids = top_candidates(logits, DEVICE_RANKS)
    k = ids.shape[1]
    ranks, lengths, last = candidate_table(depth, k, DEVICE_DEVIATIONS)
    flat = logprobs.reshape(-1)
    steps = mx.arange(depth) * k + mx.maximum(ranks, 0)
    scores = mx.sum(mx.where(ranks >= 0, flat[steps], 0.0), axis=1) - DEPTH_TIE_BREAK * lengths
    chosen = mx.sort(mx.argpartition(-scores, kth=budget - 1)[:budget])
    tokens = (ids if columns is None else columns[ids]).reshape(-1)[last[chosen]]
    ranks = mx.concatenate([mx.full((1, depth), -1, mx.int32), ranks[chosen]])  # the root first
    depths = mx.concatenate([mx.zeros(1, mx.int32), lengths[chosen]])
    # j is an ancestor of i (or i itself): no longer, and i's ranks begin with j's
    beyond = mx.arange(depth)[None, None, :] >= depths[None, :, None]
    same = mx.all((ranks[:, None, :] == ranks[None, :, :]) | beyond, axis=2)
    ancestors = same & (depths[None, :] <= depths[:, None])
    parents = mx.argmax(ancestors & (depths[None, :] == depths[:, None] - 1), axis=1)
    tokens = mx.concatenate([root.astype(mx.uint32), tokens.astype(mx.uint32)])
    return DeviceTree(tokens, depths, ancestors, parents)
