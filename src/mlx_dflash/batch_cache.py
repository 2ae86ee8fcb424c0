"""Caches of a batch whose rows accept different numbers of tokens each cycle.

Two kinds, one interface for the batch (``joined``, ``extend``, ``filter``, ``row_cache``),
beside the recurrent layers of hybrid targets (mlx-lm's ``ArraysCache``, a state per row):

- ``RowsKVCache``: key/value buffers in which every row keeps its own length (a device array):
  a block is written at each row's end, a mask hides each row's stale tail, and a row is cut back
  by lowering its length, no data moved. Its lengths are arrays, not host counts, so a verify
  over these caches runs compiled, one trace per shape (``Target``). Used for the target's plain
  key/value layers and for the draft's context.
- mlx-lm's ``BatchKVCache`` / ``BatchRotatingKVCache`` for targets with sliding-window layers
  (rotating caches): rows left-padded to a common end; a row cut back by more than the others has
  its rejected tail rolled round to its left padding (``cut_rows``; a ``RowsKVCache``: ``drop``).

mlx-lm's batch caches keep their offsets on the host and move every row's data to cut it back
(a roll of the whole buffer per layer and cycle), which is why the plain layers use their own.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, BatchRotatingKVCache, KVCache, dynamic_roll

from .draft_cache import window_mask
from .rollback import DeviceKVCache, is_recurrent, padded


def _sized(x: mx.array, size: int) -> mx.array:
    """``x`` ([rows, heads, positions, dim]) cut or zero-padded to ``size`` positions."""
    if x.shape[2] >= size:
        return x[..., :size, :]
    return mx.pad(x, [(0, 0), (0, 0), (0, size - x.shape[2]), (0, 0)])


class RowsKVCache(DeviceKVCache):
    """Rows of their own lengths: row r holds its positions 0..offset[r]-1 (``offset``: [rows],
    on the device; RoPE reads it as each row's position). ``bound`` is the longest row's length
    as the host knows it (``settle``); blocks read up to it (``pad_reads``: the whole buffer),
    masked per row."""

    @classmethod
    def joined(cls, cache: KVCache) -> "RowsKVCache":
        """A batch of one row: a sequence's cache (its prompt's prefill)."""
        rows = cls(getattr(cache, "pad_reads", False))
        length = int(cache.offset)
        rows.keys, rows.values = (_sized(x[..., :length, :], padded(length)) for x in (cache.keys, cache.values))
        rows.offset, rows.bound = mx.array([length]), length
        return rows

    def extend(self, other: "RowsKVCache") -> None:
        """Append ``other``'s rows."""
        size = max(self.keys.shape[2], other.keys.shape[2])
        self.keys, self.values = (mx.concatenate([_sized(mine, size), _sized(theirs, size)])
                                  for mine, theirs in ((self.keys, other.keys), (self.values, other.values)))
        self.offset = mx.concatenate([self.offset, other.offset])
        self.bound = max(self.bound, other.bound)

    def filter(self, index: mx.array) -> None:
        """Keep the rows at ``index``."""
        self.keys, self.values, self.offset = self.keys[index], self.values[index], self.offset[index]

    def row(self, index: int, length: int) -> DeviceKVCache:
        """Row ``index``'s first ``length`` positions as a sequence's own cache (what a prefill makes)."""
        one = DeviceKVCache(self.pad_reads)
        one.keys, one.values = (_sized(x[index : index + 1, :, :length, :], padded(length))
                                for x in (self.keys, self.values))
        one.offset = one.bound = length
        return one


BatchCache = Union[RowsKVCache, BatchKVCache, BatchRotatingKVCache, ArraysCache]


def joined(cache: Any) -> BatchCache:
    """A batch of one row from a sequence's cache, of the kind that suits it."""
    if isinstance(cache, DeviceKVCache):  # (the target's plain layers: see ``Target.make_cache``)
        return RowsKVCache.joined(cache)
    return cache.merge([cache])  # (mlx-lm's batch cache of the cache's kind; a recurrent state's batch)


def row_cache(cache: Any, index: int, length: int, held: int) -> Optional[Any]:
    """Row ``index``'s first ``length`` positions as a sequence's own cache, the row holding
    ``held`` (None: not possible: a recurrent state holds them all)."""
    if isinstance(cache, RowsKVCache):
        return cache.row(index, length)
    if is_recurrent(cache):
        return cache.extract(index) if held == length else None
    one = cache.extract(index)
    extra = one.offset - length  # (drafts accepted past a row's max_tokens)
    if extra and (not one.is_trimmable() or one.trim(extra) != extra):
        return None
    return one


def cut_rows(cache: Union[BatchKVCache, BatchRotatingKVCache], drop: list[int]) -> None:
    """Drop the last ``drop[i]`` positions of row i of one of mlx-lm's batch caches: the common
    part trimmed, the rest rolled round to the row's left padding (right padding made left
    padding, as mlx-lm's ``finalize``)."""
    common, rest = min(drop), [d - min(drop) for d in drop]
    if isinstance(cache, BatchRotatingKVCache):  # (after a block: in temporal order, the block at the end)
        if common:  # cut off the buffer, or later updates would rotate the rejected keys back in
            end = cache._idx - common
            cache.keys, cache.values = cache.keys[..., :end, :], cache.values[..., :end, :]
            cache._idx, cache._offset, cache.offset = end, cache._offset - common, cache.offset - common
        if max(rest):
            shifts = mx.array(rest)
            cache.keys = dynamic_roll(cache.keys, shifts[:, None], axis=2)
            cache.values = dynamic_roll(cache.values, shifts[:, None], axis=2)
            cache.left_padding, cache.offset = cache.left_padding + shifts, cache.offset - shifts
        return
    if common:
        cache.trim(common)
    if max(rest):
        cache.prepare(right_padding=rest)
        cache.finalize()


class BatchContext:
    """One draft layer's context for a batch: the projected keys and values of every committed
    token of every row (a ``RowsKVCache``), read through the layer's sink/window if it has one."""

    def __init__(self, cache: RowsKVCache, sink: int, window: Optional[int]):
        self.cache, self.sink, self.window = cache, sink, window

    @property
    def position(self) -> mx.array:
        """[rows]: each row's next position (its context's length)."""
        return self.cache.offset

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.cache.keys_and_values()

    def block_mask(self, block_len: int, sliding_window: Optional[int] = None, causal: bool = True) -> mx.array:
        """[rows, 1, block or 1, context + block]: a row's own context, through the sink and window
        if any; the block's own tokens all (non-causal). A sliding-window layer's queries see the
        positions within ``sliding_window`` of their own (stored index = position), the block's
        later ones too unless ``causal`` (``draft_cache.block_mask``'s rule, per row)."""
        stored = mx.arange(self.cache.size())[None]  # [1, size]
        end = self.cache.offset[:, None]
        visible = stored < end
        if self.window is not None:
            visible = visible & ((stored < self.sink) | (stored >= end - self.window))
        if sliding_window is None:
            own = mx.ones((visible.shape[0], block_len), dtype=mx.bool_)
            return mx.concatenate([visible, own], axis=1)[:, None, None, :]
        near = (end[:, :, None] + mx.arange(block_len)[None, :, None]) - stored[:, None, :] < sliding_window
        context = visible[:, None, :] & near  # [rows, block, size]
        own = mx.broadcast_to(window_mask(block_len, sliding_window, causal)[None],
                              (context.shape[0], block_len, block_len))
        return mx.concatenate([context, own], axis=2)[:, None]
