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
  window and a recurrent state): a state update cannot be undone. We restore
  the snapshot taken before verify and advance it over the accepted tokens only,
  re-running the layer's own token mixer on the inputs recorded during verify.
  The alternative, keeping every per-step state of the block, needs a delta-rule
  loop of our own (mlx-lm returns only the final state, so it would fork the
  layer's forward) and writes block_size copies of each [heads, Dv, Dk] float32
  state per verify. Measured for one layer at Qwen3.5-9B size on a 2-core CPU:
  replaying 8 accepted tokens 42.9 ms, keeping 16 per-step states 31.4 ms: a wash,
  so we keep mlx-lm's own code. On the H200 the replay costs 34.5 ms per cycle
  (all layers) while 16 states are ~0.8 GB of writes (~0.3 ms): there per-step
  states would win, once a recurrence of our own is worth its upkeep
  (BENCHMARKS.md, "Hybrid rollback").
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

TRIMMABLE = (KVCache, QuantizedKVCache)


def _gated_delta_mixer(layer: nn.Module, x: mx.array, cache: ArraysCache) -> None:
    """Advance a Qwen3.5 / Qwen3-Next linear-attention layer's cache over inputs ``x``."""
    layer.linear_attn(layer.input_layernorm(x), None, cache)


# model_type -> how to advance a recurrent layer's cache over recorded layer inputs
RECURRENT_MIXERS: dict[str, Callable[[nn.Module, mx.array, ArraysCache], None]] = {
    "qwen3_5": _gated_delta_mixer,
    "qwen3_5_moe": _gated_delta_mixer,
    "qwen3_next": _gated_delta_mixer,
}


def is_recurrent(cache: Any) -> bool:
    return isinstance(cache, ArraysCache)


def unsupported_cache(cache: Any) -> bool:
    return not isinstance(cache, (*TRIMMABLE, RotatingKVCache, ArraysCache))


def trim_attention_cache(cache: Any, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` positions of a key/value cache."""
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


def snapshot_recurrent(cache: ArraysCache) -> list:
    """The cache's arrays before a forward (mlx arrays are immutable; the list is not)."""
    return list(cache.cache)


def rewind_recurrent(cache: ArraysCache, snapshot: list, mixer: Callable, layer: nn.Module,
                     block_inputs: mx.array, keep: int) -> None:
    """Restore ``snapshot`` and advance it over the first ``keep`` recorded block inputs."""
    cache.cache = list(snapshot)
    if keep > 0:
        mixer(layer, block_inputs[:, :keep], cache)
