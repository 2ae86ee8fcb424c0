"""A prefix cache: the state after a prompt and its reply, reused by later prompts that start with it.

Chat clients and agent loops resend a growing history every turn; without a cache every turn
pays the whole prefill again. When a generation ends (or its caller stops it early) the engine
stores the target's caches (keys and values; a hybrid target's recurrent states too) and the
draft's context after its prompt and reply, all but the latest token (``engine.decode_cycles``;
the server's batch in ``batch.BatchDecoder.remove``); a later prompt restores the longest
stored prefix of it and prefills only the rest: a chat's next turn, only its new message.
Key/value caches can be cut back, so an entry that shares only part of a new prompt serves that
part too. A recurrent state (or a sliding window that has wrapped) cannot: it is kept after a
reply only where the generation's last cycle ended exactly there, so targets with such caches
also store each prompt after its prefill (all but its last token, which a generation always
runs itself) and reuse whole stored prompts (each turn of a chat starts with the previous
turn's prompt, so those hit as well).

The entries live in mlx-lm's ``LRUPromptCache`` (a trie of token sequences, least recently
used evicted first) bounded by bytes; each entry's caches are copied in and copied out, so
a generation never writes into what is stored.
"""

from __future__ import annotations

import copy
from typing import Any, Hashable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, LRUPromptCache

from .draft_cache import DraftContextCache
from .errors import DFlashError
from .proposer import Proposer
from .rollback import DeviceKVCache, is_recurrent
from .target import Target

MAX_ENTRIES = 1 << 20  # bounded by bytes, not by count
DEFAULT_SIZE = "1G"  # the server's


def parse_bytes(text: str) -> int:
    """A byte count: a number with an optional K, M or G suffix (powers of 1024): '512M', '2G', '0'."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    value = text.strip().upper().removesuffix("B") or "?"
    scale = units.get(value[-1], 1)
    try:
        number = float(value[:-1] if value[-1] in units else value)
    except ValueError:
        raise DFlashError(f"not a byte count: {text!r} (examples: 0, 500M, 2G)") from None
    if not number >= 0 or number == float("inf"):
        raise DFlashError(f"a byte count must be 0 or more, got {text!r}")
    return int(number * scale)


class PrefixCache:
    """Prefill states of prompts, bounded by ``max_bytes`` (least recently used dropped first).

    Pass it to every generation that may share prompts (``stream_generate(..., prefix_cache=...)``;
    the server keeps one). Entries of different model pairs are kept apart.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise DFlashError(f"a prefix cache's size must be 0 or more bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.entries = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)
        self.hits = self.misses = 0
        self.reused_tokens = 0  # prompt tokens restored instead of prefilled, over all hits

    def resume(self, target: Target, proposer: Proposer, cache: list[Any], prefix: list[int]) -> int:
        """Restore into ``cache`` and ``proposer`` the longest stored start of ``prefix`` and
        return its length (0: a miss, nothing changed)."""
        caches, rest = self.entries.fetch_nearest_cache(_pair(target, proposer), prefix)
        reused = len(prefix) - len(rest) if caches is not None else 0
        if reused == 0:
            self.misses += 1
            return 0
        self.hits += 1
        self.reused_tokens += reused
        cache[:] = caches[: len(cache)]
        proposer.use_context(caches[len(cache) :], reused)
        return reused

    def store(self, target: Target, proposer: Proposer, cache: list[Any], prefix: list[int], exact: bool = True) -> None:
        """Keep a copy of the state after ``prefix``: the target's ``cache`` and the proposer's
        context, each cut back to ``prefix`` where it holds more (a generation's rejected or
        unneeded drafts). ``exact``: recurrent states hold exactly ``prefix`` (they cannot be cut
        back: not kept otherwise)."""
        if self.max_bytes == 0 or len(prefix) < 2:  # (mlx-lm's trie never finds a one-token prefix)
            return
        copies = copy.deepcopy(cache + proposer.context_caches())
        if not all(_cut(c, len(prefix), exact) for c in copies):
            return
        mx.eval([c.state for c in copies])  # (materialized: not a graph over the generation it came from)
        if sum(c.nbytes for c in copies) <= self.max_bytes:
            self.entries.insert_cache(_pair(target, proposer), list(prefix), copies)

    def store_prompt(self, target: Target, proposer: Proposer, cache: list[Any], prefix: list[int]) -> None:
        """Keep the state after a prompt's prefill where the generation's end may not be able to:
        key/value caches are always cut back to the prompt and reply then (a copy fewer here)."""
        if not all(isinstance(c, KVCache) for c in cache):
            self.store(target, proposer, cache, prefix)

    def stats(self) -> dict:
        """What ``/health`` reports under ``prefix_cache``."""
        return {"hits": self.hits, "misses": self.misses, "bytes": self.entries.nbytes, "max_bytes": self.max_bytes,
                "entries": len(self.entries), "reused_tokens": self.reused_tokens}


def _cut(cache: Any, positions: int, exact: bool) -> bool:
    """Cut a copied cache back to its first ``positions`` positions, which hold the stored
    tokens; False where it cannot be (a recurrent state past them, a wrapped rotating cache)."""
    if isinstance(cache, DeviceKVCache):  # (its length may be a device count: the host knows it now)
        cache.settle(positions, exact=True)
        return True
    if isinstance(cache, DraftContextCache):
        cache.settle(positions)
        return True
    if is_recurrent(cache):
        return exact
    offset = getattr(cache, "offset", None)
    if offset == positions:
        return True
    if isinstance(offset, int) and offset > positions and cache.is_trimmable():
        cache.trim(offset - positions)
        return True
    return False


def _pair(target: Target, proposer: Proposer) -> Hashable:
    """What entries are kept apart by: the model pair, and the options that decide the caches' types."""
    return id(target.model), proposer.context_key, target.options
