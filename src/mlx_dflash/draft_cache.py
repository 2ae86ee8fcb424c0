"""The draft's context cache: per layer, the projected keys and values of every committed
token's target features (KV injection), optionally a sink plus a sliding window of them.

Its length may be a device count (a block's accept count the host has not read), so that the
engine can extend it before it reads the count; ``settle`` makes it exact again."""

from __future__ import annotations

import operator
from typing import Optional, Union

import mlx.core as mx

from .rollback import Count, device_count, read_length, reserve, shared_count

COMPACT_SLACK = 64  # a windowed cache drops its middle once it holds this many positions too many


def context_visible(size: int, length: Union[int, mx.array], sink: int, window: Optional[int]) -> mx.array:
    """Which of ``size`` stored positions a block sees: those below ``length`` (past it: a
    rejected tail or unused buffer), and with a window only the first ``sink`` and the last
    ``window`` of them."""
    j = mx.arange(size)
    visible = j < length
    if window is not None:
        visible = visible & ((j < sink) | (j >= length - window))
    return visible


class DraftContextCache:
    """Committed context K/V of one draft layer.

    With a context window (``config.context_window``: our extension) the draft sees only
    the first ``sink`` and the last ``window`` positions (attention-sink style), so a draft
    pass costs the same at any context length; RoPE positions stay absolute. Storage index
    j holds position j below ``sink`` and j + ``dropped`` from there on.

    The count of new positions may still be on the device (the accept count of a block the
    host has not read): they are written at the device ``length`` and the next write lands
    over the rejected tail. ``bound`` is the host's upper bound on ``length``; ``settle``
    makes both exact again once the host knows the count.
    """

    def __init__(self, sink: int = 0, window: Optional[int] = None, pad_reads: bool = False):
        self.sink, self.window = sink, window
        self.pad_reads = pad_reads  # a pass reads the whole buffer, masked (``EngineOptions.pad_reads``)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.length: Count = 0
        self.bound = 0
        self.dropped = 0
        # The position of the next context token, length + dropped, kept beside them (``add`` and
        # ``settle`` set all three): with a device length it is an op, made once for all layers.
        self.position: Count = 0

    def add(self, keys: mx.array, values: mx.array, count: Optional[Count] = None, memo: Optional[dict] = None) -> None:
        """Store the first ``count`` (default: all) of these positions; ``memo``: one for all the
        layers' caches, so that they share their device counts (``rollback.shared_count``)."""
        n = keys.shape[2]
        self.keys, self.values = reserve(self.keys, self.values, self.bound, keys, values)
        if isinstance(self.length, int) and not isinstance(count, mx.array):
            count = n if count is None else count
            self.keys[..., self.length : self.length + count, :] = keys[..., :count, :]
            self.values[..., self.length : self.length + count, :] = values[..., :count, :]
            self.settle(self.position + count)
        else:
            at = device_count(self.length).reshape(1)
            self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
            self.values = mx.slice_update(self.values, values, at, axes=(2,))
            self.length = shared_count(memo, operator.add, self.length, n if count is None else count)
            self.position = shared_count(memo, operator.add, self.length, self.dropped)
            self.bound += n

    def settle(self, positions: int) -> None:
        """The host knows the context now holds ``positions`` positions; drop the middle
        beyond the window from storage when it has grown ``COMPACT_SLACK`` past it."""
        self.length = self.bound = positions - self.dropped
        self.position = positions
        if self.window is None or self.length <= self.sink + self.window + COMPACT_SLACK:
            return
        cut = self.length - self.sink - self.window
        kept = [mx.concatenate([x[..., : self.sink, :], x[..., self.sink + cut : self.length, :]], axis=2)
                for x in (self.keys, self.values)]
        self.keys, self.values = reserve(None, None, 0, *kept)
        self.dropped += cut
        self.length = self.bound = self.length - cut
        self.keys[..., : self.length, :] = kept[0]
        self.values[..., : self.length, :] = kept[1]

    def read_size(self) -> int:
        """How many stored positions a draft pass reads: with ``pad_reads`` the whole buffer,
        masked, as a verify reads the target's: a key length that changes every cycle costs new
        kernels on MLX's CUDA backend."""
        return read_length(self.bound, self.pad_reads) if self.bound else 0

    def fetch(self) -> tuple[Optional[mx.array], Optional[mx.array]]:
        """(keys, values) of the stored context that a draft pass reads (None when empty)."""
        size = self.read_size()
        if size == 0:
            return None, None
        return self.keys[..., :size, :], self.values[..., :size, :]

    def visible(self) -> Optional[mx.array]:
        """Which of the positions read are context to see (None: all)."""
        size = self.read_size()
        exact = isinstance(self.length, int)  # (a length on the device is never compared on the host)
        if exact and size == self.length and (self.window is None or self.length <= self.sink + self.window):
            return None
        return context_visible(size, self.length, self.sink, self.window)

    @property
    def state(self) -> tuple:
        return self.keys, self.values

    def block_mask(self, block_len: int, sliding_window: Optional[int], causal: bool = True) -> Optional[mx.array]:
        return block_mask(self, block_len, sliding_window, causal)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def is_trimmable(self) -> bool:
        """Whether ``trim`` can cut it back: not once a window dropped positions (a cold run
        of the shorter context would still see them)."""
        return self.dropped == 0 and isinstance(self.length, int)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` positions (a prefix cache cutting a stored context back)."""
        n = min(self.length, n)
        self.settle(self.position - n)
        return n


class ContextView:
    """A ``DraftContextCache`` inside a compiled draft pass: its whole buffer read, masked past
    a ``length`` given as an array; no host counts, so the trace does not depend on them."""

    def __init__(self, keys: mx.array, values: mx.array, length: mx.array, dropped: mx.array, sink: int,
                 window: Optional[int]):
        self.keys, self.values, self.length = keys, values, length
        self.position = length + dropped
        self.sink, self.window = sink, window

    def read_size(self) -> int:
        return self.keys.shape[2]

    def fetch(self) -> tuple[mx.array, mx.array]:
        return self.keys, self.values

    def visible(self) -> mx.array:
        return context_visible(self.keys.shape[2], self.length, self.sink, self.window)

    def block_mask(self, block_len: int, sliding_window: Optional[int], causal: bool = True) -> Optional[mx.array]:
        return block_mask(self, block_len, sliding_window, causal)


def window_mask(block_len: int, sliding_window: int, causal: bool) -> mx.array:
    """[L, L]: which of a block's own tokens each of its queries sees in a sliding-window layer:
    those within ``sliding_window`` of its own slot, the later ones too unless ``causal``."""
    q, k = mx.arange(block_len)[:, None], mx.arange(block_len)[None]
    return (k <= q) & (q - k < sliding_window) if causal else mx.abs(q - k) < sliding_window


def block_mask(cache: "DraftContextCache", block_len: int, sliding_window: Optional[int],
               causal: bool = True) -> Optional[mx.array]:
    """Which of [context ; block] keys each block query sees ([L, context read + L]; None: all):
    non-causal; a sliding-window layer (which stores every position: storage index = position)
    sees the positions within ``sliding_window`` of its own, the block's later ones too unless
    ``causal`` (v1's rule; DFlash2's windows are two-sided, ``is_causal: false``)."""
    visible = cache.visible()
    if visible is None and sliding_window is None:
        return None
    n_context, start = cache.read_size(), cache.position
    context = mx.ones((n_context,), dtype=mx.bool_) if visible is None else visible
    context = mx.broadcast_to(context[None], (block_len, n_context))
    own = mx.ones((block_len, block_len), dtype=mx.bool_)
    if sliding_window is not None:
        q = mx.arange(block_len)[:, None]
        context = context & ((start + q) - mx.arange(n_context)[None] < sliding_window)
        own = window_mask(block_len, sliding_window, causal)
    return mx.concatenate([context, own], axis=1)
