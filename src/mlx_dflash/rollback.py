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
  and the conv window of that prefix from the block's inputs. Until the seventh session
  the accepted tokens were replayed through mlx-lm's own mixer instead: on the H200 at
  Qwen3.5-9B shape that replay cost 34.5 ms per cycle on top of a 58.3 ms verify, whose
  recurrence mlx-lm runs token by token off Apple GPUs (BENCHMARKS.md, "Hybrid rollback").
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

TRIMMABLE = (KVCache, QuantizedKVCache)


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
