"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next) verified a whole block at a time.

mlx-lm advances a Gated DeltaNet state one token after another (a fused kernel on
Apple GPUs; on CUDA and the CPU a Python loop of small ops per token) and returns only
the final state. A DFlash verify feeds a block of up to 16 tokens and keeps a prefix of
it, so it wants the block in a few large ops and the state after ANY prefix. Both come
from the chunked form of the gated delta rule (Yang et al., "Gated Delta Networks",
2024). With per-token decay g_t, G_t = g_1...g_t and the state S (Dv x Dk), a step is

    S_t = g_t S_{t-1} + d_t k_t^T,   d_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t

so S_t = G_t S_0 + sum_{i<=t} (G_t / G_i) d_i k_i^T, and the d_t solve one unit lower
triangular system (I + N) D = R, N[t, i] = beta_t (G_t / G_i) (k_t . k_i) for i < t.
N is nilpotent, so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) for 16 tokens: four
small matmuls, no triangular solver (MLX has one on the CPU only). The state after the
first n tokens is then one matmul, so rolling back a rejected tail replays nothing.

``BlockDeltaMixer`` wraps ONE layer's token mixer instance (no mlx-lm class is patched):
blocks of 2 to ``MAX_BLOCK`` tokens take this path, and so do prompts, ``MAX_BLOCK`` tokens a
chunk (except on Apple GPUs, where mlx-lm's fused kernel takes a prompt in one launch); single
tokens, padded batches and anything else run mlx-lm's own forward (so plain decode steps stay
mlx-lm's own).
Its steps mirror mlx-lm's GatedDeltaNet forward (projections, causal conv window,
normalised q/k, gated output norm); tests/test_families.py checks every hybrid family's
DFlash tokens against mlx-lm greedy and the rollback against feeding the accepted tokens
alone. Measured on the CPU so far (scripts/hybrid_rollback_costs.py); on Apple GPUs
mlx-lm's fused kernel runs a block in one launch, so there the clear gain is the replay
it saves.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, normalize_qk

from .device import on_apple_gpu

MAX_BLOCK = 64  # tokens per chunk; a verify block is one chunk, a prompt several


def _inverse_unit_lower(n: mx.array) -> mx.array:
    """(I + n)^-1 for strictly lower triangular n [..., T, T]: the product of (I + p^(2^j))
    with p = -n, which sums p^0 .. p^(2^m - 1), and p^T = 0."""
    size = n.shape[-1]
    eye = mx.eye(size, dtype=n.dtype)
    p, inverse, covered = -n, eye + (-n), 2
    while covered < size:
        p = p @ p
        inverse = inverse @ (eye + p)
        covered *= 2
    return inverse


def chunk_delta_rule(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                     state: mx.array) -> tuple[mx.array, tuple]:
    """All T steps of the gated delta rule at once.

    q, k: [B, H, T, Dk] (key heads already repeated to value heads), v: [B, H, T, Dv],
    log_g, beta: [B, H, T], state: [B, H, Dv, Dk] (float32). Returns y [B, H, T, Dv] and
    ``(state, k, d, log_G)``, what ``state_after`` needs for the state after any prefix.
    """
    q, k, v = (x.astype(mx.float32) for x in (q, k, v))
    size = q.shape[2]
    log_G = mx.cumsum(log_g.astype(mx.float32), axis=-1)  # log G_t
    lower = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    gaps = log_G[..., :, None] - log_G[..., None, :]  # log(G_t / G_i), <= 0 where i <= t
    ratio = mx.where(lower, mx.exp(mx.where(lower, gaps, 0.0)), 0.0)  # G_t / G_i for i <= t, else 0
    strict = ratio * (1 - mx.eye(size, dtype=mx.float32))
    beta = beta.astype(mx.float32)[..., None]
    growth = mx.exp(log_G)[..., None]  # G_t
    state_t = state.swapaxes(-1, -2)  # [B, H, Dk, Dv]
    rhs = beta * (v - growth * (k @ state_t))
    d = _inverse_unit_lower(beta * strict * (k @ k.swapaxes(-1, -2))) @ rhs
    y = growth * (q @ state_t) + (ratio * (q @ k.swapaxes(-1, -2))) @ d
    return y, (state, k, d, log_G)


def state_after(chunk: tuple, n: int) -> mx.array:
    """The recurrent state after the first ``n`` tokens of a ``chunk_delta_rule`` call."""
    state, k, d, log_G = chunk
    if n == 0:
        return state
    last = log_G[..., n - 1 : n]
    weights = mx.exp(last - log_G[..., :n])[..., None]  # G_n / G_i
    return mx.exp(last)[..., None] * state + (d[:, :, :n] * weights).swapaxes(-1, -2) @ k[:, :, :n]


class BlockDeltaMixer(nn.Module):
    """A Gated DeltaNet token mixer (one instance) that runs short inputs in chunked form
    and can rewind its cache to any prefix of the latest such call."""

    def __init__(self, mixer: nn.Module):
        super().__init__()
        self.mixer = mixer
        self._before: Optional[list] = None  # the cache's arrays before the latest call
        self._latest: Optional[tuple] = None  # (conv window + inputs, chunk) of the latest chunked call

    def _projections(self, inputs: mx.array) -> tuple[mx.array, ...]:
        """(q|k|v before the conv [B, S, conv_dim], z [B, S, Hv, Dv], b, a [B, S, Hv])."""
        m = self.mixer
        B, S, _ = inputs.shape
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key head
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(inputs), m.in_proj_ba(inputs))
            qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
            return qkv, z, b, a
        z = m.in_proj_z(inputs).reshape(B, S, m.num_v_heads, m.head_v_dim)
        return m.in_proj_qkv(inputs), z, m.in_proj_b(inputs), m.in_proj_a(inputs)

    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        m = self.mixer
        B, S, _ = inputs.shape
        # One token (a plain decode step: mlx-lm's own step, a fused kernel on Apple GPUs; nothing
        # to roll back), prompts on Apple GPUs (that kernel takes a whole prompt in one launch),
        # padded batches and sharded layers: mlx-lm's forward.
        metal_prompt = S > MAX_BLOCK and on_apple_gpu()
        plain = (S == 1 or metal_prompt or mask is not None or cache is None or cache.lengths is not None
                 or cache.left_padding is not None or getattr(m, "sharding_group", None) is not None)
        self._before = None if cache is None else list(cache.cache)  # mlx arrays are immutable
        self._latest = None
        if plain:
            return m(inputs, mask, cache)
        qkv, z, b, a = self._projections(inputs)
        window = cache[0] if cache[0] is not None else mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), inputs.dtype)
        conv_input = mx.concatenate([window, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(m.conv_kernel_size - 1) :])
        conv_out = nn.silu(m.conv1d(conv_input))
        q, k, v = mx.split(conv_out, [m.key_dim, 2 * m.key_dim], axis=-1)
        q = q.reshape(B, S, m.num_k_heads, m.head_k_dim)
        k = k.reshape(B, S, m.num_k_heads, m.head_k_dim)
        v = v.reshape(B, S, m.num_v_heads, m.head_v_dim)
        q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
        if (repeat := m.num_v_heads // m.num_k_heads) > 1:
            q, k = mx.repeat(q, repeat, axis=2), mx.repeat(k, repeat, axis=2)
        state = cache[1] if cache[1] is not None else mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), mx.float32)
        log_g = mx.log(mx.maximum(compute_g(m.A_log, a, m.dt_bias), 1e-30))  # a full decay: G ~ 0, not log 0
        q, k, v, log_g, beta = (x.swapaxes(1, 2) for x in (q, k, v, log_g, mx.sigmoid(b)))  # heads first
        ys = []
        for start in range(0, S, MAX_BLOCK):  # a prompt: chunk after chunk, carrying the state
            part = slice(start, start + MAX_BLOCK)
            y, chunk = chunk_delta_rule(q[:, :, part], k[:, :, part], v[:, :, part], log_g[..., part],
                                        beta[..., part], state)
            state = state_after(chunk, y.shape[2])
            ys.append(y)
        cache[1] = state
        if S <= MAX_BLOCK:  # a block: keep what rewinding to any prefix needs
            self._latest = (conv_input, chunk)
        y = mx.concatenate(ys, axis=2) if len(ys) > 1 else ys[0]
        out = m.norm(y.swapaxes(1, 2).astype(inputs.dtype), z)
        return m.out_proj(out.reshape(B, S, -1))

    def rewind(self, cache: Any, keep: int) -> None:
        """Set ``cache`` to its state after the first ``keep`` tokens of the latest call (any
        prefix of a chunked block; of other calls, none of it)."""
        if keep == 0 and self._before is not None:
            cache.cache = list(self._before)
        elif self._latest is not None:
            conv_input, chunk = self._latest
            window = self.mixer.conv_kernel_size - 1
            cache[0] = mx.contiguous(conv_input[:, keep : keep + window])
            cache[1] = state_after(chunk, keep)
        else:
            raise RuntimeError("a recurrent cache can roll back its latest call, once; part of it only after a block")
        self._before = self._latest = None
