"""The DFlash draft model and its checkpoint I/O.

A draft is a handful of pre-norm Qwen3 decoder layers with no embedding and no
head: it borrows the target's. It fills a block ``[x, MASK, ..., MASK]`` in one
non-causal forward pass, conditioned on the target's hidden states through "KV
injection": every layer projects the context features with its own k/v
projections and prepends them to the block's keys and values.

Its configuration: ``draft_config.py``; its context cache: ``draft_cache.py``; loading
and saving the published format: ``draft_io.py``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from .cpu_kernels import attention, rope, swiglu
from .device import on_gpu
from .draft_cache import ContextView, DraftContextCache, window_mask
from .draft_config import DFlash2Config, DraftConfig, default_target_layer_ids
from .projections import BlockProjections, block_projections
from .rollback import Count, device_count


class DraftAttention(nn.Module):
    """Block queries attend to [context K/V ; block K/V], all with this layer's projections."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        dim, hd = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.scale = hd**-0.5
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            hd,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n_heads: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n_heads, -1).transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Projected, normed, RoPE'd K/V of context features (what the draft cache stores)."""
        keys = rope(self.rope, self.k_norm(self._heads(self.k_proj(context), self.n_kv_heads)), offset)
        values = self._heads(self.v_proj(context), self.n_kv_heads)
        return keys, values

    def attend_blocks(self, x: mx.array, context: mx.array, anchors: mx.array, sees_context: mx.array,
                      sliding_window: Optional[int] = None, causal: bool = True) -> mx.array:
        """Training: all A blocks of each sequence in one pass.

        x [B, A*bs, H] holds A blocks; block i sits at positions anchors[:, i] + (0..bs-1).
        sees_context [B, A, T]: which context positions block i may see (those before its anchor).
        A block also sees itself (bidirectionally) and never another block, so block-to-block
        scores are computed per block ([bs, bs]) instead of masking an [A*bs, A*bs] matrix.
        A sliding-window layer's queries see only positions within ``sliding_window`` of their
        own, the block's later ones too unless ``causal`` (as ``draft_cache.block_mask``).
        """
        B, N, _ = x.shape
        A = anchors.shape[1]
        bs = N // A
        kv, rep = self.n_kv_heads, self.n_heads // self.n_kv_heads

        def per_block(t: mx.array, n_heads: int) -> mx.array:  # -> [B, heads, A, bs, hd], RoPE'd per block
            t = t.reshape(B * A, bs, n_heads, -1).transpose(0, 2, 1, 3)
            t = self.rope(t, offset=anchors.reshape(-1))
            return t.reshape(B, A, n_heads, bs, -1).transpose(0, 2, 1, 3, 4)

        q = per_block(self.q_norm(self.q_proj(x).reshape(B, N, self.n_heads, -1)), self.n_heads)
        k = per_block(self.k_norm(self.k_proj(x).reshape(B, N, kv, -1)), kv)
        v = self.v_proj(x).reshape(B, A, bs, kv, -1).transpose(0, 3, 1, 2, 4)  # [B, kv, A, bs, hd]
        ctx_k, ctx_v = self.context_kv(context, 0)  # [B, kv, T, hd]
        T = ctx_k.shape[2]
        q = q.reshape(B, kv, rep, A, bs, -1) * self.scale
        ctx_scores = q.reshape(B, kv, rep, N, -1) @ ctx_k[:, :, None].swapaxes(-1, -2)  # [B, kv, rep, N, T]
        visible = mx.repeat(sees_context, bs, axis=1)[:, None, None]  # [B, 1, 1, N, T]
        own_scores = (q @ k[:, :, None].swapaxes(-1, -2)).reshape(B, kv, rep, N, bs)  # [.., N, bs]
        if sliding_window is not None:
            positions = (anchors[:, :, None] + mx.arange(bs)).reshape(B, 1, 1, N, 1)  # each query's
            visible = visible & (positions - mx.arange(T) < sliding_window)
            own = mx.tile(window_mask(bs, sliding_window, causal), (A, 1))  # [N, bs]
            own_scores = mx.where(own, own_scores, mx.array(-1e9, own_scores.dtype))
        ctx_scores = mx.where(visible, ctx_scores, mx.array(-1e9, ctx_scores.dtype))
        probs = mx.softmax(mx.concatenate([ctx_scores, own_scores], axis=-1).astype(mx.float32), axis=-1)
        probs = probs.astype(q.dtype)
        out = probs[..., :T] @ ctx_v[:, :, None]  # [B, kv, rep, N, hd]
        out = out + (probs[..., T:].reshape(B, kv, rep, A, bs, bs) @ v[:, :, None]).reshape(out.shape)
        out = out.reshape(B, self.n_heads, N, -1).transpose(0, 2, 1, 3).reshape(B, N, -1)
        return self.o_proj(out)

    def __call__(self, x: mx.array, cache: "DraftContextCache", mask: Optional[mx.array]) -> mx.array:
        """Block queries over the cached context and the block itself; ``mask``: ``block_mask``."""
        B, L, _ = x.shape
        start = cache.position  # the block's first token sits right after the context
        queries = rope(self.rope, self.q_norm(self._heads(self.q_proj(x), self.n_heads)), start)
        keys = rope(self.rope, self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), start)
        values = self._heads(self.v_proj(x), self.n_kv_heads)
        ctx_k, ctx_v = cache.fetch()
        if ctx_k is not None:
            keys = mx.concatenate([ctx_k, keys], axis=2)
            values = mx.concatenate([ctx_v, values], axis=2)
        out = attention(queries, keys, values, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@mx.compile  # (one fused kernel rather than a few per tap: a v2 pass runs four per layer)
def block_conv(y: mx.array, deltas: mx.array, base: mx.array, group_size: int) -> mx.array:
    """DFlash2's per-token convolution over a block ([B, T, H]): out[t, c] = sum over taps of
    (base[tap, c] + deltas[t, tap, c // group_size]) * y[t - tap, c], with y = 0 before the
    block's start (it never reaches into the context). deltas: [B, T, taps, H / group_size]."""
    B, T, H = y.shape
    # Per channel group throughout ([B, T, groups, group_size]), so that the kernels' sums and the
    # products fuse into one kernel beside each shift (no reshape between them).
    grouped = y.reshape(B, T, -1, group_size)
    base = base.reshape(base.shape[0], -1, group_size)
    out = (base[0, ...] + deltas[:, :, 0, :, None]) * grouped
    for tap in range(1, base.shape[0]):
        shifted = mx.pad(grouped[:, : max(T - tap, 0)], [(0, 0), (min(tap, T), 0), (0, 0), (0, 0)])
        out = out + (base[tap, ...] + deltas[:, :, tap, :, None]) * shifted
    return out.reshape(B, T, H)


class SublayerConv(nn.Module):
    """The convolutions before and after one sublayer of a DFlash2 layer; their per-token
    kernels are a shared base plus a projection of the sublayer's normed input. Initialised to
    the identity (base tap 0 = 1, the rest and the projection 0): then the layer is v1's."""

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.group_size, self.taps = group_size, taps
        self.base_kernel = mx.zeros((2, taps, hidden)).at[:, 0].add(1.0)  # [before/after, tap, channel]
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group_size), bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)

    def deltas(self, h: mx.array) -> mx.array:
        """[B, T, 2, taps, groups]: both convolutions' per-token kernel deltas, from h."""
        B, T, _ = h.shape
        return self.kernel_projection(h).reshape(B, T, 2, self.taps, -1)

    def __call__(self, y: mx.array, deltas: mx.array, which: int) -> mx.array:
        # (``[which, ...]`` is a view; a bare ``[which]`` on the first axis is a gather, a kernel on GPUs)
        return block_conv(y, deltas[:, :, which], self.base_kernel[which, ...], self.group_size)


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context enters only through attention K/V. A DFlash2 layer
    also convolves each sublayer's input and output along the block (``SublayerConv``)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.dflash2 is not None and config.dflash2.conv_kernel_size:
            taps, group = config.dflash2.conv_kernel_size, config.dflash2.conv_group_size
            self.attention_conv = SublayerConv(config.hidden_size, taps, group)
            self.mlp_conv = SublayerConv(config.hidden_size, taps, group)

    def __call__(self, x: mx.array, cache: DraftContextCache, mask: Optional[mx.array]) -> mx.array:
        """Decode: one block over the cached context."""
        return self._forward(x, lambda h: self.self_attn(h, cache, mask), x.shape[1])

    def forward_blocks(self, x: mx.array, context: mx.array, anchors: mx.array, sees_context: mx.array,
                       sliding_window: Optional[int] = None, causal: bool = True) -> mx.array:
        """Training: many blocks at once (``DraftAttention.attend_blocks``)."""
        attend = lambda h: self.self_attn.attend_blocks(h, context, anchors, sees_context,  # noqa: E731
                                                        sliding_window, causal)
        return self._forward(x, attend, x.shape[1] // anchors.shape[1])

    def _forward(self, x: mx.array, attend: Callable[[mx.array], mx.array], block_len: int) -> mx.array:
        if "attention_conv" not in self:
            h = x + attend(self.input_layernorm(x))
            return h + self.mlp(self.post_attention_layernorm(h))
        B, N, _ = x.shape
        blocks = lambda t: t.reshape(-1, block_len, t.shape[-1])  # noqa: E731  (a convolution never crosses a block's start)
        flat = lambda t: t.reshape(B, N, -1)  # noqa: E731
        h = blocks(self.input_layernorm(x))
        deltas = self.attention_conv.deltas(h)
        x = x + flat(self.attention_conv(blocks(attend(flat(self.attention_conv(h, deltas, 0)))), deltas, 1))
        h = blocks(self.post_attention_layernorm(x))
        deltas = self.mlp_conv.deltas(h)
        return x + flat(self.mlp_conv(self.mlp(self.mlp_conv(h, deltas, 0)), deltas, 1))


class CandidateSelector(nn.Module):
    """DFlash2's low-rank selector: re-ranks the head's top-k candidates at each block slot by
    the token drafted before it, S[b] = logit[b] + sum_r Pred[prev, r] g[r] Succ[cand[b], r] with
    g = hidden_projection(the slot's hidden state). A zero successor codebook (its
    initialisation) leaves the head's own ranking: v1's drafts."""

    def __init__(self, hidden: int, vocab: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        # (tables read by rows: embeddings, so that a quantized draft stores them in 4/8 bits too)
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.predecessor_codebook.weight = mx.random.normal((vocab, rank)) * 0.02
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook.weight = mx.zeros((vocab, rank))

    def walk(self, hidden: mx.array, logits: mx.array, first_token: mx.array, top_k: int,
             ids: Optional[mx.array] = None, temperature: float = 0.0, key: Optional[mx.array] = None
             ) -> tuple[mx.array, Optional[mx.array]]:
        """Drafts [..., n] for the slots after ``first_token`` ([...], one a sequence; [1] for
        one): at each slot one of the head's top ``top_k`` (``logits`` [..., n, V'] over ``ids``,
        or the whole vocabulary), scored against the token chosen before it; hidden: [..., n, H],
        the slots' final states (leading axes: sequences walked together, as a batch's rows).
        Greedy takes the best score; with a ``temperature`` the candidate is sampled from
        softmax(S / T) (draws from ``key``), and the second result is that distribution on the
        vocabulary [..., n, V] (the q of speculative sampling)."""
        *lead, n, width = logits.shape
        k = min(top_k, width)
        local = top_k_columns(logits, k)
        candidates = local if ids is None else ids[local]  # [..., n, k]
        # Every slot's score for each of its candidates after each token that can precede it (the
        # previous slot's candidates; the first slot's: first_token), in one batched product, so
        # the walk below only looks scores up rather than computing a product per slot.
        first = mx.broadcast_to(first_token.reshape(*lead, 1, 1), (*lead, 1, k))
        previous = mx.concatenate([first, candidates[..., :-1, :]], axis=-2)
        g = self.hidden_projection(hidden)  # [..., n, rank]
        successors = self.successor_codebook(candidates).swapaxes(-1, -2)
        pairs = (self.predecessor_codebook(previous) * g[..., None, :]) @ successors
        scores = mx.take_along_axis(logits, local, axis=-1)[..., None, :] + pairs  # [..., n, predecessor, candidate]
        if temperature <= 0:
            picks = mx.argmax(scores, axis=-1)  # [..., n, k]: each slot's pick after each predecessor
        else:
            # Gumbel-max with one noise draw a slot, shared by its predecessors: only one of them is
            # ever realised, so each slot's pick is a draw from softmax(S / T) after it.
            scores = scores.astype(mx.float32) / temperature
            picks = mx.argmax(scores + mx.random.gumbel((*lead, n, 1, k), key=key), axis=-1)
        rows = follow_picks(picks)
        drafted = mx.take_along_axis(candidates, rows[..., None], axis=-1)[..., 0]
        if temperature <= 0:
            return drafted, None
        before = mx.concatenate([mx.zeros((*lead, 1), rows.dtype), rows[..., :-1]], axis=-1)  # each slot's predecessor
        after = mx.take_along_axis(scores, before[..., None, None], axis=-2)[..., 0, :]  # [..., n, k]
        probs = mx.softmax(after, axis=-1)
        vocab = self.successor_codebook.weight.shape[0]
        return drafted, mx.put_along_axis(mx.zeros((*lead, n, vocab)), candidates, probs, axis=-1)


def top_k_columns(logits: mx.array, k: int, group: int = 16) -> mx.array:
    """The columns of each row's k largest logits ([..., k], in no order). On the CPU, where MLX's
    argpartition over a wide row is slow, from the k groups of ``group`` columns with the largest
    maxima (together they hold every one of the k largest); elsewhere one argpartition (one kernel)."""
    *lead, width = logits.shape
    if on_gpu() or width % group or width < 4 * group * k:
        return mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    groups = mx.argpartition(-logits.reshape(*lead, -1, group).max(axis=-1), k - 1, axis=-1)[..., :k]
    columns = (groups[..., None] * group + mx.arange(group)).reshape(*lead, group * k)
    best = mx.argpartition(-mx.take_along_axis(logits, columns, axis=-1), k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(columns, best, axis=-1)


def follow_picks(picks: mx.array) -> mx.array:
    """The rows [..., n] of a greedy walk in which slot t takes ``picks[..., t, row of slot t - 1]``
    (slot 0 after row 0; ``picks`` [..., n, k]). By pointer doubling: each round composes every
    slot's map with the one ``step`` slots before it, so log2(n) gathers rather than one lookup
    per slot (each a kernel on a GPU)."""
    step = 1
    while step < picks.shape[-2]:
        later = mx.take_along_axis(picks[..., step:, :], picks[..., :-step, :], axis=-1)
        picks = mx.concatenate([picks[..., :step, :], later], axis=-2)
        step *= 2
    return picks[..., 0]


class DFlashDraft(nn.Module):
    """The draft network. ``__call__`` maps block embeddings to final hidden states;
    the caller applies the target's head (the draft has none). A DFlash2 draft adds
    convolutions to its layers and a ``candidate_selector`` over the head's top-k."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        H, K = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(K * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DraftLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        if config.dflash2 is not None:
            self.candidate_selector = CandidateSelector(H, config.vocab_size, config.dflash2.selector_rank)
        self._compiled_pass: Optional[Callable] = None  # (run_block's, traced on first use)
        self._pass_projections: Optional[BlockProjections] = None  # (run_block's, packed on first use)
        self._pass_rowwise: Optional[bool] = None  # (what they were packed for)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def make_cache(self, pad_reads: bool = False) -> list[DraftContextCache]:
        """Per layer: all context, or a sink + sliding window of it (``config.context_window``)
        so that a draft pass costs the same at any context length. Sliding-window layers of
        published drafts keep their own window (their mask counts every position)."""
        return [DraftContextCache(sink, window, pad_reads) for sink, window in self.context_windows()]

    def context_windows(self) -> list[tuple[int, Optional[int]]]:
        """Per layer, the (sink, window) of its context cache ((0, None): all context)."""
        window, sink = self.config.context_window, self.config.context_sink
        return [(sink, window) if window and not self.config.is_sliding(i) else (0, None)
                for i in range(len(self.layers))]

    def scale_embeddings(self, embeddings: mx.array) -> mx.array:
        """The block's token embeddings as the draft takes them (``input_embedding_scale``)."""
        scale = self.config.input_embedding_scale
        return embeddings if scale is None else embeddings * scale

    def scale_logits(self, logits: mx.array) -> mx.array:
        """The head's logits times ``output_multiplier``, tanh-capped at ``final_logit_softcapping``."""
        if self.config.output_multiplier is not None:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * mx.tanh(logits / cap)

    def project_context(self, tapped: mx.array) -> mx.array:
        """Context features C = hidden_norm(fc(concat of tapped target hidden states))."""
        return self.hidden_norm(self.fc(tapped))

    def store_context(self, context: mx.array, cache: list[DraftContextCache],
                      count: Optional[Count] = None) -> None:
        """Append projected context features (the first ``count`` of them: committed tokens
        only) to every layer's cache, through that layer's own k/v projections."""
        memo: dict = {}
        for layer, layer_cache in zip(self.layers, cache):
            layer_cache.add(*layer.self_attn.context_kv(context, layer_cache.position), count, memo)

    def __call__(
        self,
        block_embeddings: mx.array,
        new_context: Optional[mx.array],
        cache: list[DraftContextCache],
    ) -> mx.array:
        """Run one block. ``new_context`` holds projected features of tokens committed
        since the last call; they are stored first (committed context only)."""
        if new_context is not None and new_context.shape[1] > 0:
            self.store_context(new_context, cache)
        h = block_embeddings
        masks: dict[Optional[int], Optional[mx.array]] = {}  # per kind of layer: their caches move in step
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            window = self.config.sliding_window if self.config.is_sliding(i) else None
            if window not in masks:
                masks[window] = layer_cache.block_mask(h.shape[1], window, self.config.causal_windows)
            h = layer(h, layer_cache, masks[window])
        return self.norm(h)

    def run_block(self, block_embeddings: mx.array, cache: list[DraftContextCache], compile: bool = False,
                  pack: bool = False, rowwise: Optional[bool] = None) -> mx.array:
        """A decode pass over ``cache`` (its new context already stored): ``__call__``, with
        ``compile`` under mx.compile (traced again only when a block length or buffer size
        changes), with ``pack`` its projections packed (and ``rowwise``) as compiled target
        blocks compute theirs (``EngineOptions``: compile_draft, pack_draft, rowwise_products)."""
        with self._projections(rowwise) if pack else nullcontext():
            if not compile or any(c.keys is None for c in cache):
                return self(block_embeddings, None, cache)
            return self._compiled(block_embeddings, cache)

    def _projections(self, rowwise: Optional[bool]) -> AbstractContextManager:
        if self._pass_projections is None or self._pass_rowwise != rowwise:
            self._pass_projections, self._pass_rowwise = block_projections(self, rowwise=rowwise), rowwise
        return self._pass_projections.installed()

    def _compiled(self, block_embeddings: mx.array, cache: list[DraftContextCache]) -> mx.array:
        """The pass under mx.compile: each layer's whole context buffer and its length (on the
        device or not) are inputs, so one trace serves every pass of a block length while the
        buffers keep their size."""
        if self._compiled_pass is None:
            windows = self.context_windows()

            def forward(x: mx.array, *state: mx.array) -> mx.array:
                views = [ContextView(*state[4 * i : 4 * i + 4], sink, window) for i, (sink, window) in enumerate(windows)]
                return self(x, None, views)
            self._compiled_pass = mx.compile(forward)
        state = [x for c in cache for x in (c.keys, c.values, device_count(c.length), mx.array(c.dropped))]
        return self._compiled_pass(block_embeddings, *state)

    # The compiled pass holds the weights as constants of its trace (as inputs they cost host
    # time every pass), and the packed projections copies of them, so new weights drop
    # both: training updates them between its held-out evaluations; loading and quantizing go
    # through these too.
    def update(self, *args, **kwargs) -> "DFlashDraft":
        self._compiled_pass = self._pass_projections = None
        return super().update(*args, **kwargs)

    def update_modules(self, *args, **kwargs) -> "DFlashDraft":
        self._compiled_pass = self._pass_projections = None
        return super().update_modules(*args, **kwargs)

    def forward_blocks(self, block_embeddings: mx.array, context: mx.array, anchors: mx.array,
                       sees_context: mx.array) -> mx.array:
        """Training forward: all anchored blocks of a batch in one pass (see ``train.py``)."""
        h = block_embeddings
        for i, layer in enumerate(self.layers):
            window = self.config.sliding_window if self.config.is_sliding(i) else None
            h = layer.forward_blocks(h, context, anchors, sees_context, window, self.config.causal_windows)
        return self.norm(h)


def create_random_draft(
    target_config: dict[str, Any],
    *,
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: Optional[list[int]] = None,
    intermediate_size: Optional[int] = None,
    seed: int = 0,
    dflash2: Optional[DFlash2Config] = None,
) -> DFlashDraft:
    """A freshly initialised draft shaped after the target's layers (for tests and training);
    ``intermediate_size`` narrows its MLPs (default: the target's); with ``dflash2``, a DFlash2
    draft (its convolutions and selector at their identity start)."""
    num_target_layers = target_config["num_hidden_layers"]
    heads = target_config["num_attention_heads"]
    layer_ids = target_layer_ids or default_target_layer_ids(num_target_layers, num_layers)
    config = DraftConfig(
        hidden_size=target_config["hidden_size"],
        intermediate_size=intermediate_size or target_config["intermediate_size"],
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=target_config.get("num_key_value_heads") or heads,
        head_dim=target_config.get("head_dim") or target_config["hidden_size"] // heads,
        rms_norm_eps=target_config.get("rms_norm_eps", 1e-6),
        rope_theta=target_config.get("rope_theta", 1_000_000.0),
        rope_scaling=target_config.get("rope_scaling"),
        vocab_size=target_config["vocab_size"],
        max_position_embeddings=target_config.get("max_position_embeddings", 40960),
        block_size=block_size,
        num_target_layers=num_target_layers,
        mask_token_id=mask_token_id,
        target_layer_ids=layer_ids,
        dflash2=dflash2,
    )
    mx.random.seed(seed)
    draft = DFlashDraft(config)
    mx.eval(draft.parameters())
    return draft


def to_dflash2(draft: DFlashDraft, dflash2: Optional[DFlash2Config] = None) -> DFlashDraft:
    """A DFlash2 draft that proposes exactly what the v1 ``draft`` proposes: its weights, identity
    convolutions and a zero successor codebook (the start of a v2 fine-tune, ``train --init``)."""
    if draft.config.dflash2 is not None:
        return draft
    v2 = DFlashDraft(replace(draft.config, dflash2=dflash2 or DFlash2Config()))
    weights = tree_flatten(draft.parameters())
    v2.load_weights(weights, strict=False)
    # (its new weights in the v1's float dtype: a float32 kernel beside bfloat16 activations
    # would cast them back and forth, operations a loaded v2 draft does not run)
    v2.set_dtype(next(w.dtype for _, w in weights if mx.issubdtype(w.dtype, mx.floating)))
    mx.eval(v2.parameters())
    return v2
