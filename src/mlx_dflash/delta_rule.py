"""Gated DeltaNet layers (Qwen3.5, Qwen3-Next) verified a whole block at a time.

mlx-lm advances a Gated DeltaNet state one token after another (a fused kernel on
Apple GPUs; on CUDA and the CPU a Python loop of small ops per token) and returns only
the final state. A DFlash verify feeds a block of up to 16 tokens and keeps a prefix of
it, so it wants the block in few launches and the state after ANY prefix. Two forms:

* stepwise, on CUDA: our own kernel (``mx.fast.cuda_kernel``) runs the whole block token
  after token in one launch, each warp holding one row of a head's state in registers;
  the same launch writes the state after every token of a block, and rolling back reads one.
* chunked, elsewhere: the chunked form of the gated delta rule (Yang et al., "Gated Delta
  Networks", 2024). With per-token decay g_t, G_t = g_1...g_t and the state S (Dv x Dk), a
  step is

    S_t = g_t S_{t-1} + d_t k_t^T,   d_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t

  so S_t = G_t S_0 + sum_{i<=t} (G_t / G_i) d_i k_i^T, and the d_t solve one unit lower
  triangular system (I + N) D = R, N[t, i] = beta_t (G_t / G_i) (k_t . k_i) for i < t.
  N is nilpotent, so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8) for 16 tokens: four
  small matmuls, no triangular solver (MLX has one on the CPU only). The state after the
  first n tokens is then one matmul, so rolling back a rejected tail replays nothing.

``BlockDeltaMixer`` wraps ONE layer's token mixer instance (no mlx-lm class is patched):
blocks of 2 to ``MAX_BLOCK`` tokens take these paths, and so do prompts (chunked: ``MAX_BLOCK``
tokens a chunk), except on Apple GPUs, where mlx-lm's fused kernel takes a prompt in one
launch; single tokens, padded batches and anything else run mlx-lm's own forward (so plain
decode steps stay mlx-lm's own).
Its steps mirror mlx-lm's GatedDeltaNet forward (projections, causal conv window,
normalised q/k, gated output norm); tests/test_families.py checks every hybrid family's
DFlash tokens against mlx-lm greedy and the rollback against feeding the accepted tokens
alone, in both forms (the stepwise one on the CPU through mlx-lm's ops); on a GPU,
tests/test_delta_rule.py checks the CUDA kernel against those ops. Its costs against the
chunked form: docs/performance.md.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from .device import on_apple_gpu, on_cuda
from .rollback import Count, shared_count

MAX_BLOCK = 64  # tokens per chunk; a verify block is one chunk, a prompt several

# One warp per row of one value head's state (Dv rows of Dk columns, Dk / 32 per lane), all T
# steps in registers: the recurrence of mlx-lm's `_gated_delta_step_ops`, in the order it
# computes it (decay, recall S k, delta, update, read out S q), one launch for a whole block.
_STEPWISE_CUDA_SOURCE = """
    constexpr int per_lane = Dk / 32;
    const int lane = threadIdx.x;
    const int row = blockIdx.y * blockDim.y + threadIdx.y;
    const int head = blockIdx.z;  // batch * Hv + value head
    const int b = head / Hv, hv = head % Hv, hk = hv / (Hv / Hk);
    const int T = q_shape[1];
    const size_t qk_at = ((size_t)b * T * Hk + hk) * Dk, v_at = ((size_t)b * T * Hv + hv) * Dv + row;
    const size_t gate_at = (size_t)b * T * Hv + hv, state_at = ((size_t)head * Dv + row) * Dk;
    float s[per_lane];
    for (int i = 0; i < per_lane; ++i) s[i] = state_in[state_at + i * 32 + lane];
    for (int t = 0; t < T; ++t) {
      const size_t qk = qk_at + (size_t)t * Hk * Dk;
      const float decay = static_cast<float>(g[gate_at + (size_t)t * Hv]);
      float recall = 0.0f;
      for (int i = 0; i < per_lane; ++i) {
        s[i] *= decay;
        recall += s[i] * static_cast<float>(k[qk + i * 32 + lane]);
      }
      for (int gap = 16; gap > 0; gap >>= 1) recall += __shfl_xor_sync(0xffffffff, recall, gap);
      const float delta = (static_cast<float>(v[v_at + (size_t)t * Hv * Dv]) - recall)
                          * static_cast<float>(beta[gate_at + (size_t)t * Hv]);
      float out = 0.0f;
      for (int i = 0; i < per_lane; ++i) {
        s[i] += static_cast<float>(k[qk + i * 32 + lane]) * delta;
        out += s[i] * static_cast<float>(q[qk + i * 32 + lane]);
      }
      for (int gap = 16; gap > 0; gap >>= 1) out += __shfl_xor_sync(0xffffffff, out, gap);
      if (lane == 0) y[v_at + (size_t)t * Hv * Dv] = static_cast<InT>(out);
      if (SaveStates) {
        const size_t at = (((size_t)t * gridDim.z + head) * Dv + row) * Dk;
        for (int i = 0; i < per_lane; ++i) states[at + i * 32 + lane] = s[i];
      }
    }
    for (int i = 0; i < per_lane; ++i) state_out[state_at + i * 32 + lane] = s[i];
"""
_stepwise_cuda_kernel = None  # built at first use (needs MLX's CUDA backend)


def _fits_cuda_kernel(k: mx.array, v: mx.array) -> bool:
    return k.shape[-1] % 32 == 0 and v.shape[-1] % 4 == 0 and v.shape[-2] % k.shape[-2] == 0


def stepwise_delta_rule(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array, save_states: bool = False
                        ) -> tuple[mx.array, mx.array, Optional[mx.array]]:
    """The gated delta rule token after token, as mlx-lm runs it (same shapes as its
    ``gated_delta_ops``: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], state
    [B, Hv, Dv, Dk]; returns y [B, T, Hv, Dv] in q's dtype, the final state (float32) and, with
    ``save_states``, the state after every token [T, B, Hv, Dv, Dk]: a rewind then reads one).

    On CUDA it is one kernel launch (``_STEPWISE_CUDA_SOURCE``) where the chunked form takes
    ~40 small launches a layer; elsewhere, and for head sizes the kernel does not take, it is
    mlx-lm's own ops (a Python loop over tokens)."""
    global _stepwise_cuda_kernel
    state = state.astype(mx.float32)
    if not (on_cuda() and _fits_cuda_kernel(k, v)):
        if not save_states:
            return (*gated_delta_ops(q, k, v, g, beta, state), None)
        ys, states = [], []
        for t in range(q.shape[1]):  # token by token, keeping every state
            y, state = gated_delta_ops(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                       beta[:, t : t + 1], state)
            ys.append(y)
            states.append(state)
        return mx.concatenate(ys, axis=1), state, mx.stack(states)
    if _stepwise_cuda_kernel is None:
        _stepwise_cuda_kernel = mx.fast.cuda_kernel(
            name="dflash_gated_delta_steps", input_names=["q", "k", "v", "g", "beta", "state_in"],
            output_names=["y", "state_out", "states"], source=_STEPWISE_CUDA_SOURCE)
    (B, T, Hk, Dk), (Hv, Dv) = k.shape, v.shape[-2:]
    y, final, states = _stepwise_cuda_kernel(
        inputs=[q, k, v, g, beta, state],
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("SaveStates", save_states)],
        grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape, (T, *state.shape) if save_states else (1,)],
        output_dtypes=[q.dtype, mx.float32, mx.float32])
    return y, final, (states if save_states else None)


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


def state_after(chunk: tuple, n: Union[int, mx.array], last_index: Union[None, int, mx.array] = None) -> mx.array:
    """The recurrent state after the first ``n`` tokens of a ``chunk_delta_rule`` call
    (``n`` may be a count on the device, at least 1: the tokens past it get weight 0; or one
    count per row of the batch, [B]; ``last_index``: ``n - 1``, where the caller has it)."""
    state, k, d, log_G = chunk
    if isinstance(n, int) and n == 0:
        return state
    last_index = n - 1 if last_index is None else last_index
    if isinstance(n, mx.array) and n.ndim == 1:  # each row its own prefix
        last = mx.take_along_axis(log_G, last_index[:, None, None], axis=-1)
        kept = mx.arange(log_G.shape[-1]) < n[:, None, None]
    else:
        at = last_index.reshape(1) if isinstance(last_index, mx.array) else mx.array([last_index])
        last = mx.take(log_G, at, axis=-1)  # log G_n
        kept = mx.arange(log_G.shape[-1]) < n
    weights = mx.where(kept, mx.exp(last - log_G), 0.0)[..., None]  # G_n / G_i for i <= n
    return mx.exp(last)[..., None] * state + (d * weights).swapaxes(-1, -2) @ k


class BlockDeltaMixer(nn.Module):
    """A Gated DeltaNet token mixer (one instance) that runs short inputs as one block and can
    rewind its cache to any prefix of the latest such call (each row of a batch to its own).
    What a rewind needs is kept per cache, so that sequences decoded in turns (a batch and a
    sequence beside it) never take each other's.

    Two forms of the same recurrence: ``stepwise`` (the default on CUDA: one kernel launch for the
    block, which also writes the state after each token, and a rewind reads one) and chunked (the
    default elsewhere: a few large ops, and a rewind is one matmul)."""

    def __init__(self, mixer: nn.Module, stepwise: Optional[bool] = None):
        super().__init__()
        self.mixer = mixer
        self.stepwise = on_cuda() if stepwise is None else stepwise
        # per cache: (its arrays before the latest call, and of the latest block: its conv window +
        # inputs, then what gives the state after any prefix (stepwise: the states after each
        # token; chunked: ``chunk_delta_rule``'s chunk), or None)
        self._calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

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
        # padded batches: mlx-lm's forward.
        metal_prompt = S > MAX_BLOCK and on_apple_gpu()
        plain = (S == 1 or metal_prompt or mask is not None or cache is None or cache.lengths is not None
                 or cache.left_padding is not None)
        if cache is not None:
            self._calls[cache] = (list(cache.cache), None)  # (mlx arrays are immutable)
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
        state = cache[1] if cache[1] is not None else mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), mx.float32)
        g, beta = compute_g(m.A_log, a, m.dt_bias), mx.sigmoid(b)
        if self.stepwise:
            y, cache[1], states = stepwise_delta_rule(q, k, v, g, beta, state, save_states=S <= MAX_BLOCK)
            prefix_states = (states,)
        else:
            y, cache[1], prefix_states = self._chunked(q, k, v, g, beta, state)
        if S <= MAX_BLOCK:  # a block: keep what rewinding to any prefix needs
            self._calls[cache] = (self._calls[cache][0], (conv_input, *prefix_states))
        out = m.out_proj(m.norm(y.astype(inputs.dtype), z).reshape(B, S, -1))
        group = getattr(m, "sharding_group", None)  # sharded over processes: each holds some heads
        return out if group is None else mx.distributed.all_sum(out, group=group)

    def _chunked(self, q, k, v, g, beta, state) -> tuple[mx.array, mx.array, tuple]:
        """(y [B, S, Hv, Dv], the final state, the last chunk: the state after any prefix of it)."""
        if (repeat := v.shape[2] // k.shape[2]) > 1:
            q, k = mx.repeat(q, repeat, axis=2), mx.repeat(k, repeat, axis=2)
        log_g = mx.log(mx.maximum(g, 1e-30))  # a full decay: G ~ 0, not log 0
        q, k, v, log_g, beta = (x.swapaxes(1, 2) for x in (q, k, v, log_g, beta))  # heads first
        ys = []
        for start in range(0, q.shape[2], MAX_BLOCK):  # a prompt: chunk after chunk, carrying the state
            part = slice(start, start + MAX_BLOCK)
            y, chunk = chunk_delta_rule(q[:, :, part], k[:, :, part], v[:, :, part], log_g[..., part],
                                        beta[..., part], state)
            state = state_after(chunk, y.shape[2])
            ys.append(y)
        y = mx.concatenate(ys, axis=2) if len(ys) > 1 else ys[0]
        return y.swapaxes(1, 2), state, chunk

    def block_arrays(self, cache: Any) -> list[mx.array]:
        """What the latest block over ``cache`` keeps for a rewind: a compiled block forward
        returns these (``Target``), and hands the real ones back with ``took_block``."""
        latest = self._calls[cache][1]
        return list(latest) if latest is not None else []

    def took_block(self, cache: Any, before: list, latest: list[mx.array]) -> None:
        """Outside a trace: ``cache``'s arrays before a compiled block and its ``block_arrays``."""
        self._calls[cache] = (before, tuple(latest))

    def rewind(self, cache: Any, keep: Union[int, mx.array], memo: Optional[dict] = None) -> None:
        """Set ``cache`` to its state after the first ``keep`` tokens of the latest call (any
        prefix of a block; of other calls, none of it). ``keep`` may be a count still on the
        device (at least 1): nothing here needs its value on the host. ``memo`` (one per rollback
        of all layers): the layers' rewinds share the index arithmetic on ``keep``, which on a
        GPU is a kernel launch per op (24 layers at Qwen3.5-9B's shape). ``keep`` [B]: each row
        of the batch to its own prefix."""
        before, latest = self._calls.pop(cache, (None, None))
        if isinstance(keep, int) and keep == 0 and before is not None:
            cache.cache = list(before)
        elif latest is not None:
            conv_input, *prefix_states = latest
            rows, last = _prefix_indices(keep, self.mixer.conv_kernel_size - 1, {} if memo is None else memo)
            if rows.ndim == 1:
                cache[0] = mx.take(conv_input, rows, axis=1)
                cache[1] = mx.take(prefix_states[0], last, axis=0) if self.stepwise else state_after(prefix_states, keep, last)
            else:  # (a batch's rows, each to its own prefix)
                cache[0] = mx.take_along_axis(conv_input, rows[..., None], axis=1)
                cache[1] = (mx.take_along_axis(prefix_states[0], last.reshape(1, -1, 1, 1, 1), axis=0)[0] if self.stepwise
                            else state_after(prefix_states, keep, last))
        else:
            raise RuntimeError("a recurrent cache can roll back its latest call, once; part of it only after a block")


def _prefix_indices(keep: Count, window: int, memo: dict) -> tuple[mx.array, Count]:
    """(the conv window's rows, the last kept token's index) of a prefix of ``keep`` tokens,
    made once per ``memo`` (the index by ``rollback.shared_count``, as the offsets are cut)."""
    if ("rows", window) not in memo:
        memo["rows", window] = (keep[:, None] if isinstance(keep, mx.array) and keep.ndim == 1 else keep) + mx.arange(window)
    return memo["rows", window], shared_count(memo, operator.sub, keep, 1)
