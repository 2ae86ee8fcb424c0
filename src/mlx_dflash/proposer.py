"""Proposers: what drafts a block for the engine to verify.

``DFlashProposer`` drafts with a DFlash draft model in one pass, conditioned on the target's
tapped hidden states (its context), using the target's embedding and head. Tests and
benchmarks use ``replay.ReplayProposer`` instead, which replays a known continuation with
planted mistakes.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Union

import mlx.core as mx

from .draft import DFlashDraft
from .target import Target


MAX_SINGLE_ROWS = 256  # deferred single-token contexts stored at most this many at a time


def single_rows(n: int) -> int:
    """The rows ``n`` deferred single-token contexts are stored in, padded: 16, 32, 64, ... 256."""
    return max(16, 1 << (n - 1).bit_length())


class Proposer(Protocol):
    """Anything that drafts a block: the DFlash draft, or a replay for tests/benchmarks."""

    layer_ids: list[int]  # target layers whose outputs it consumes
    block_size: int  # the largest block it drafts for

    def start(self, target: Target) -> None:
        """Begin a new sequence."""

    def add_context(self, features: mx.array, kept: Union[None, int, mx.array] = None) -> None:
        """Tapped target features [1, n, K*H] of newly verified tokens, of which the first
        ``kept`` are committed (None: all n; may be a count still on the device)."""

    def settle(self, positions: int) -> None:
        """The host has read the counts: ``positions`` committed tokens have context now."""

    @property
    def state(self) -> list:
        """The arrays its stored context is in: the prefill evaluates them (a prompt's context
        is prompt work; left to the first draft, it was timed as decoding)."""

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Draft ``num_tokens`` tokens following ``first_token`` (shape [1])."""

    @property
    def context_key(self) -> int:
        """Which stored contexts it can continue from (a prefix cache's entries are kept apart by it)."""

    def context_caches(self) -> list:
        """Its stored context, every committed token's (for a prefix cache to copy)."""

    def use_context(self, caches: list, positions: int) -> None:
        """Continue from a stored context of ``positions`` tokens (``context_caches``' copy)."""


def greedy_head(draft: DFlashDraft, target: Target) -> tuple[Optional[mx.array], Callable[[mx.array], mx.array]]:
    """(the ids greedy drafts pick among, None: every id; the head that scores them): the draft's
    vocabulary and a head of just those rows where it has one and the target's options use it
    (``EngineOptions.draft_vocab``), else the target's whole head."""
    vocab = draft.config.draft_vocab
    if not (vocab and target.options.draft_vocab):
        return None, target.head
    ids = mx.array(vocab, dtype=mx.uint32)
    return ids, target.head_rows(ids)


class DFlashProposer:
    """Greedy block drafts from a DFlash draft model, using the target's embedding and head."""

    def __init__(self, draft: DFlashDraft):
        self.draft = draft
        self.layer_ids = draft.config.target_layer_ids
        self.block_size = draft.block_size
        self.mask_id = mx.array([draft.config.mask_token_id], dtype=mx.uint32)

    def start(self, target: Target) -> None:
        self.target = target
        self.options = target.options  # (resolved for this backend: how draft passes run)
        self.cache = self.draft.make_cache(self.options.pad_reads)
        self.single: list[mx.array] = []  # tapped features of single tokens (plain steps), not stored yet
        self.draft_vocab, self.draft_head = greedy_head(self.draft, target)

    def add_context(self, features: mx.array, kept: Union[None, int, mx.array] = None) -> None:
        if isinstance(kept, int):
            features, kept = features[:, :kept], None
        # Plain steps add one token each: stored together at the next draft, not one by one
        # (a few ops fewer per step, where a small model on a GPU is launch-bound).
        if features.shape[1] == 1 and kept is None:
            self.single.append(features)
            return
        self._store_singles()
        self.draft.store_context(self.draft.project_context(features), self.cache, kept)

    def settle(self, positions: int) -> None:
        if not self.single:  # (else the cache does not hold them all yet)
            for layer_cache in self.cache:
                layer_cache.settle(positions)

    @property
    def state(self) -> list:
        return [layer_cache.state for layer_cache in self.cache]

    @property
    def context_key(self) -> int:
        return id(self.draft)

    def context_caches(self) -> list:
        self._store_singles()
        return self.cache

    def use_context(self, caches: list, positions: int) -> None:
        self.cache, self.single = caches, []

    def _store_singles(self) -> None:
        """Store the deferred single-token contexts; with ``pad_reads`` in row counts of
        ``single_rows`` (a few shapes, each of which costs a GPU time the first time it runs)."""
        while self.single:
            rows, self.single = self.single[:MAX_SINGLE_ROWS], self.single[MAX_SINGLE_ROWS:]
            features, count = mx.concatenate(rows, axis=1), None
            if self.options.pad_reads and single_rows(len(rows)) > len(rows):
                padding = mx.zeros((1, single_rows(len(rows)) - len(rows), features.shape[2]), features.dtype)
                features, count = mx.concatenate([features, padding], axis=1), len(rows)
            self.draft.store_context(self.draft.project_context(features), self.cache, count)

    def _slot_hidden(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Final hidden states [1, num_tokens, H] of the block slots after ``first_token``."""
        block = mx.concatenate([first_token.astype(mx.uint32), mx.repeat(self.mask_id, num_tokens)])
        self._store_singles()
        embeddings = self.draft.scale_embeddings(self.target.embed(block[None]))
        return self.draft.run_block(embeddings, self.cache, compile=self.options.compile_draft,
                                    pack=self.options.pack_draft, rowwise=self.options.rowwise_products)[:, 1:]

    def draft_logits(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Logits [num_tokens, V] over the whole vocabulary (one draft pass): what v1 sampling needs."""
        return self.draft.scale_logits(self.target.head(self._slot_hidden(first_token, num_tokens))[0])

    def candidate_logits(self, first_token: mx.array, num_tokens: int) -> tuple[mx.array, Optional[mx.array]]:
        """Where a tree's candidates come from (one draft pass, ``tree.py``): logits [num_tokens,
        V'] over the draft vocabulary if it has one, and the token id of each column (None: the
        whole vocabulary). A smaller head, as greedy drafts take: whatever the candidates, the
        target's own choices walk the tree."""
        return self._greedy_logits(first_token, num_tokens)[1], self.draft_vocab

    def _greedy_logits(self, first_token: mx.array, num_tokens: int) -> tuple[mx.array, mx.array]:
        """(the slots' hidden states, their logits over the draft vocabulary or the whole one)."""
        hidden = self._slot_hidden(first_token, num_tokens)[0]
        return hidden, self.draft.scale_logits(self.draft_head(hidden))

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        """Greedy drafts (one draft pass), from the draft vocabulary if it has one; a DFlash2
        draft's selector picks each slot among the head's top-k by the token before it."""
        hidden, logits = self._greedy_logits(first_token, num_tokens)
        if self.selects:
            return self._walk(hidden, logits, first_token, self.draft_vocab)[0]
        drafted = mx.argmax(logits, axis=-1)
        return drafted if self.draft_vocab is None else self.draft_vocab[drafted]

    @property
    def selects(self) -> bool:
        """A DFlash2 draft: its selector picks (or samples) each slot's token."""
        return self.draft.config.dflash2 is not None

    def sample(self, first_token: mx.array, num_tokens: int, temperature: float, key: mx.array
               ) -> tuple[mx.array, mx.array]:
        """A DFlash2 draft's sampled drafts [n] and their distributions q [n, V] (sparse: on
        the candidates of each slot)."""
        hidden = self._slot_hidden(first_token, num_tokens)[0]
        logits = self.draft.scale_logits(self.target.head(hidden))  # (the full head: q must be the drafts' own)
        return self._walk(hidden, logits, first_token, None, temperature, key)

    def _walk(self, hidden: mx.array, logits: mx.array, first_token: mx.array, ids: Optional[mx.array],
              temperature: float = 0.0, key: Optional[mx.array] = None) -> tuple[mx.array, Optional[mx.array]]:
        """The selector over ``logits`` (columns: ``ids``, or the whole vocabulary)."""
        return self.draft.candidate_selector.walk(hidden, logits, first_token, self.draft.config.dflash2.selector_top_k,
                                                  ids, temperature, key)
