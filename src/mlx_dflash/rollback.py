"""Undo the rejected tail of a verified block, one rule per mlx-lm cache type.

Verify appends the whole block to every layer's cache; only the accepted prefix
may stay. What "removing the tail" means depends on how a cache stores history:

- ``KVCache`` / ``QuantizedKVCache``: positions below ``offset`` are the history,
  so trimming the offset is enough.
- ``RotatingKVCache`` (sliding-window layers of Gemma 3 and gpt-oss): a
  multi-token update leaves the buffer in temporal order with the block at its
  end. Trimming only the offset would leave the rejected keys in the buffer,
  where later single-token updates rotate them back in as context; so the tail
  is cut off the buffer itself, which keeps every later update exact.
- ``ArraysCache`` (Gated DeltaNet layers of Qwen3.5 / Qwen3-Next: a causal-conv
  window and a recurrent state): a state update cannot be undone by trimming. The
  layer's token mixer is wrapped (``delta_rule.BlockDeltaMixer``): it runs a block in the
  chunked form of the delta rule, which gives the state after any prefix in one matmul,
  and the conv window of that prefix from the block's inputs. (Replaying the accepted tokens
  through mlx-lm's own mixer instead costs a large share of a verify again: off Apple GPUs
  mlx-lm runs that recurrence token by token.)

A rollback by a count the host has not read yet (the accept count still on the device)
lets the engine queue the next cycle before it waits for this one. ``DeviceKVCache``
and ``BlockDeltaMixer.rewind`` take such a count; the others need it on the host.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, create_attention_mask


TRIMMABLE = (KVCache, QuantizedKVCache)


def is_recurrent(cache: Any) -> bool:
    return isinstance(cache, ArraysCache)


def unsupported_cache(cache: Any) -> bool:
    return not isinstance(cache, (*TRIMMABLE, RotatingKVCache, ArraysCache))


# With ``pad_reads`` (GPUs), blocks of up to this many tokens (verifies) read whole key buffers,
# masked, instead of the keys in use: MLX's CUDA backend builds kernels per shape, and a length
# that changes every cycle is a new shape every verify. Prompts keep mlx-lm's exact read.
PADDED_BLOCK = 64


def visible_keys(n_keys: int, offset: mx.array, n_queries: int, window: Optional[int] = None) -> mx.array:
    """[n_queries, n_keys]: query i sits at ``offset + i`` and sees the keys up to itself (within
    the last ``window`` positions, itself included); those past it are a stale tail (rejected
    drafts, unused buffer). Per-row offsets ([rows]): [rows, 1, n_queries, n_keys]."""
    query = (offset[..., None] + mx.arange(n_queries))[..., None]  # [..., n_queries, 1]
    key = mx.arange(n_keys)
    visible = key <= query
    if window is not None:
        visible = visible & (key > query - window)
    return visible if offset.ndim == 0 else visible[:, None]


Count = Union[int, mx.array]  # a number of positions: known to the host, or still on the device


def device_count(n: Count) -> mx.array:
    """A count as a compiled forward takes it: an array (a host int becomes one)."""
    return n if isinstance(n, mx.array) else mx.array(n)


def shared_count(memo: Optional[dict], op: Callable[[Count, Count], Count], a: Count, b: Count) -> Count:
    """``op(a, b)`` (add or subtract) on counts. Layers move in step, so with a ``memo`` (one per
    update of all the layers) the same device operands give one result for all of them: on a
    GPU each op on a device count is a kernel launch (a rollback cut SmolLM2's 30 offsets, one
    value, with 30 launches). Ints stay ints; adding or subtracting an int 0 makes no op."""
    if isinstance(b, int) and b == 0:
        return a
    if memo is None or (isinstance(a, int) and isinstance(b, int)):
        return op(a, b)
    key = (op, *((x,) if isinstance(x, int) else id(x) for x in (a, b)))
    if key not in memo:
        memo[key] = (a, b, op(a, b))  # (the operands stay alive with it: their ids stay theirs)
    return memo[key][2]


def write_at(buffer: mx.array, new: mx.array, offset: mx.array) -> mx.array:
    """``buffer`` with ``new`` written from position ``offset`` (a device scalar) on; per-row
    offsets ([rows]): each row from its own."""
    if offset.ndim == 0:
        return mx.slice_update(buffer, new, offset.reshape(1), axes=(2,))
    positions = offset[:, None, None, None] + mx.arange(new.shape[2])[:, None]  # [rows, 1, n, 1]
    return mx.put_along_axis(buffer, mx.broadcast_to(positions, new.shape), new, axis=2)


def padded(length: int) -> int:
    """``length`` rounded up to mlx-lm's cache step (256): the buffer sizes ``reserve`` makes."""
    return -(-length // KVCache.step) * KVCache.step


def read_length(length: int, pad: bool) -> int:
    """How many key positions a block reads from a buffer holding ``length`` in use: all of
    it, or with ``pad`` the whole buffer (``EngineOptions.pad_reads``)."""
    return padded(length) if pad else length


def reserve(old_keys: Optional[mx.array], old_values: Optional[mx.array], used: int, keys: mx.array,
            values: mx.array) -> tuple[mx.array, mx.array]:
    """Key/value buffers with room for ``used`` positions and these new ones: the old ones,
    or copies grown in mlx-lm's steps of 256 positions (a buffer written at a device offset
    cannot be cut to size on the way)."""
    needed = used + keys.shape[2]
    if old_keys is not None and needed <= old_keys.shape[2]:
        return old_keys, old_values
    size = padded(needed)
    grown = [mx.zeros((*x.shape[:2], size, x.shape[3]), x.dtype) for x in (keys, values)]
    if old_keys is not None:
        grown = [mx.concatenate([old[..., :used, :], new[..., used:, :]], axis=2)
                 for old, new in zip((old_keys, old_values), grown)]
    return grown[0], grown[1]


class DeviceKVCache(KVCache):
    """A ``KVCache`` whose length may be a device scalar, so that it can be cut by an accept
    count the host has not read: writes land at the device offset (over a rejected tail),
    RoPE reads that offset, and a mask hides the positions past it.

    ``bound`` is what the host knows: at most that many positions are in use. Keys are
    fetched up to it, or for a block the whole buffer (``PADDED_BLOCK``); while it equals the
    offset (an int) single tokens and prompts read exactly what mlx-lm's ``KVCache`` reads,
    with its masks.
    """

    def __init__(self, pad_reads: bool = False) -> None:
        super().__init__()
        self.offset: Union[int, mx.array] = 0
        self.bound = 0
        self.pad_reads = pad_reads  # blocks read the whole buffer

    def _fetched(self, n: int) -> int:
        """How many key positions a call of ``n`` tokens reads."""
        return read_length(self.bound + n, self.pad_reads) if 1 < n <= PADDED_BLOCK else self.bound + n

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = reserve(self.keys, self.values, self.bound, keys, values)
        n = keys.shape[2]
        fetched = self._fetched(n)
        if isinstance(self.offset, int):
            self.keys[..., self.offset : self.offset + n, :] = keys
            self.values[..., self.offset : self.offset + n, :] = values
        else:
            self.keys, self.values = write_at(self.keys, keys, self.offset), write_at(self.values, values, self.offset)
        self.offset = self.offset + n
        self.bound += n
        return self.keys[..., :fetched, :], self.values[..., :fetched, :]

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        fetched = self._fetched(N)
        if isinstance(self.offset, int) and self.offset == self.bound and fetched == self.bound + N:
            return create_attention_mask(N, offset=self.offset, return_array=return_array, window_size=window_size)
        return visible_keys(fetched, device_count(self.offset), N, window_size)

    def make_room(self, n: int) -> None:
        """Grow the buffers (if needed) so that ``n`` more positions fit past ``bound``."""
        new_keys, new_values = self.keys[..., :n, :], self.values[..., :n, :]  # (only shapes and dtypes are used)
        self.keys, self.values = reserve(self.keys, self.values, self.bound, new_keys, new_values)

    def wrote(self, keys: mx.array, values: mx.array, n: int, offset: Union[int, mx.array]) -> None:
        """Take the buffers of a compiled block forward, which wrote ``n`` positions (now up to
        ``offset``)."""
        self.keys, self.values, self.offset = keys, values, offset
        self.bound += n

    def move(self, rows: mx.array, start: mx.array) -> None:
        """Write positions ``rows`` (a tree's accepted path first) over those from ``start`` on."""
        moved = [mx.take(x, rows, axis=2) for x in (self.keys, self.values)]
        self.keys, self.values = (write_at(x, y, start) for x, y in zip((self.keys, self.values), moved))

    def drop(self, num_tokens: Count, memo: Optional[dict] = None) -> None:
        """Forget the last ``num_tokens`` positions (an int, or a count still on the device);
        ``memo``: see ``shared_count``."""
        self.offset = shared_count(memo, operator.sub, self.offset, num_tokens)
        if isinstance(self.offset, int):
            self.bound = self.offset

    def settle(self, in_use: int, exact: bool = False) -> None:
        """The host now knows at most ``in_use`` positions are in use (``exact``: that many):
        fetch no more. An exact count turns the offset back into an int, so that single
        tokens take mlx-lm's own path again (no mask: its one-query attention kernel; with
        a device offset they need a mask, which MLX's CUDA backend runs as a matmul-softmax-
        matmul, a third more kernels a step: tools/launch_costs.py)."""
        self.bound = in_use
        if exact:
            self.offset = in_use

    def trim(self, n: int) -> int:
        n = min(self.offset, n) if isinstance(self.offset, int) else n
        self.drop(n)
        return n

    def keys_and_values(self):
        return self.keys[..., : self.bound, :], self.values[..., : self.bound, :]

    def size(self) -> int:
        return self.bound


class BufferView:
    """A ``DeviceKVCache`` inside a compiled block forward (``Target``): its whole buffer read,
    written at a device offset, masked past each query (a tree's nodes: the past and their
    ``ancestors``, [nodes, nodes]). Only arrays, no host counts: one trace serves every block of
    a length while the buffers keep their size (256 positions)."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, ancestors: Optional[mx.array] = None):
        self.keys, self.values, self.offset, self.ancestors = keys, values, offset, ancestors

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = write_at(self.keys, keys, self.offset), write_at(self.values, values, self.offset)
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None) -> mx.array:
        if self.ancestors is None:
            return visible_keys(self.keys.shape[2], self.offset, N, window_size)
        node = mx.arange(self.keys.shape[2]) - self.offset  # (the tree's node at each key position)
        inside = mx.take(self.ancestors, mx.clip(node, 0, N - 1), axis=1) & (node < N)
        return (node < 0)[None] | inside


def recurrent_view(window: mx.array, state: mx.array) -> ArraysCache:
    """A Gated DeltaNet layer's cache inside a compiled block forward (``Target``): its conv
    window and recurrent state, inputs of the trace."""
    view = ArraysCache(2)
    view.cache = [window, state]
    return view


def cache_arrays(cache: Any) -> tuple[mx.array, mx.array]:
    """The two arrays a compiled block forward takes and returns for a layer's cache: keys and
    values (a ``DeviceKVCache``'s whole buffers), or a recurrent layer's conv window and state."""
    return (cache[0], cache[1]) if is_recurrent(cache) else (cache.keys, cache.values)


def trim_attention_cache(cache: Any, num_tokens: Count, memo: Optional[dict] = None) -> None:
    """Drop the last ``num_tokens`` positions of a key/value cache (of a ``DeviceKVCache``
    also by a count still on the device; ``memo``: see ``shared_count``)."""
    if isinstance(cache, DeviceKVCache):
        cache.drop(num_tokens, memo)
        return
    if isinstance(cache, RotatingKVCache):
        keys, values, offset, keep, max_size, idx = cache.state
        if idx != keys.shape[2]:
            raise RuntimeError("rotating cache is not in temporal order; only a multi-token update can be rolled back")
        end = idx - num_tokens
        cache.state = (keys[..., :end, :], values[..., :end, :], offset - num_tokens, keep, max_size, end)
        return
    trimmed = cache.trim(num_tokens)
    if trimmed != num_tokens:
        raise RuntimeError(f"cache trimmed {trimmed} of {num_tokens} tokens")


def keep_path(cache: Any, path: list[int], tree_size: int) -> None:
    """After a tree's verify wrote its ``tree_size`` nodes at the end of a key/value cache: keep
    the nodes of ``path`` (indices into the tree, the root first), moved to consecutive positions
    (their RoPE positions already are), and drop the rest. The host knows every count here."""
    end = cache.state[5] if isinstance(cache, RotatingKVCache) else cache.offset  # (its buffer is in temporal order)
    start = end - tree_size
    if path != list(range(len(path))):
        moved = mx.array([start + node for node in path])
        cache.keys[..., start : start + len(path), :] = cache.keys[..., moved, :]
        cache.values[..., start : start + len(path), :] = cache.values[..., moved, :]
    trim_attention_cache(cache, tree_size - len(path))
