"""The DFlash draft model and its checkpoint I/O.

A draft is a handful of pre-norm Qwen3 decoder layers with no embedding and no
head: it borrows the target's. It fills a block ``[x, MASK, ..., MASK]`` in one
non-causal forward pass, conditioned on the target's hidden states through "KV
injection": every layer projects the context features with its own k/v
projections and prepends them to the block's keys and values.

The on-disk format is the published one (``config.json`` + ``*.safetensors``
with no key prefix), so drafts trained elsewhere load here and drafts saved
here load in SGLang and vLLM.
"""

from __future__ import annotations

import json
import operator
import os
import tempfile
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.rope_utils import initialize_rope

from .cpu_kernels import attention, rope, swiglu
from .device import on_apple_gpu, on_gpu
from .errors import DFlashError
from .projections import BlockProjections, block_projections
from .rollback import Count, device_count, read_length, reserve, shared_count

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DRAFT_VOCAB_FILE = "draft_vocab.json"


def default_target_layer_ids(num_target_layers: int, num_draft_inputs: int) -> list[int]:
    """Target layers tapped when a checkpoint does not list them (the reference rule).

    One tap: the middle layer. Otherwise evenly spread from layer 1 to layer L-3,
    e.g. L=36, K=5 -> [1, 9, 17, 25, 33].
    """
    if num_draft_inputs == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + j * span / (num_draft_inputs - 1)) for j in range(num_draft_inputs)]


POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                 "num_target_layers", "num_key_value_heads", "head_dim", "max_position_embeddings", "block_size",
                 "sliding_window")
POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_config_values(raw: dict, dflash: dict) -> None:
    """One line naming the first field of a draft config that a model cannot be built from."""
    for key in POSITIVE_INTS:
        value = raw.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            raise DFlashError(f"draft config.json: {key} must be a positive integer, got {value!r}")
    for key in POSITIVE_NUMBERS:
        value = raw.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
            raise DFlashError(f"draft config.json: {key} must be a positive number, got {value!r}")
    heads, kv_heads = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    if heads % kv_heads:
        raise DFlashError(f"draft config.json: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if not raw.get("head_dim") and raw["hidden_size"] % heads:
        raise DFlashError(f"draft config.json: hidden_size ({raw['hidden_size']}) is not a multiple of "
                          f"num_attention_heads ({heads}) and no head_dim is given")
    if not _is_int(dflash["mask_token_id"]) or dflash["mask_token_id"] < 0:
        raise DFlashError(f"draft config.json: dflash_config.mask_token_id must be a token id, got "
                          f"{dflash['mask_token_id']!r}")
    ids = dflash.get("target_layer_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(_is_int(i) and i >= 0 for i in ids)):
        raise DFlashError(f"draft config.json: dflash_config.target_layer_ids must be a list of layer indices, got {ids!r}")
    for key in ("context_window", "context_sink"):
        if dflash.get(key) is not None and not (_is_int(dflash[key]) and dflash[key] >= 0):
            raise DFlashError(f"draft config.json: dflash_config.{key} must be a count, got {dflash[key]!r}")
    types = raw.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == raw["num_hidden_layers"]):
        raise DFlashError("draft config.json: layer_types must list one type per layer")
    for key in ("rope_scaling",):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise DFlashError(f"draft config.json: {key} must be an object")


@dataclass
class DraftConfig:
    """The fields of a published draft ``config.json`` that the model uses."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    rope_scaling: Optional[dict] = None
    layer_types: Optional[list[str]] = None
    sliding_window: Optional[int] = None
    # Draft context window (our extension, in dflash_config): attend to the first
    # ``context_sink`` and the last ``context_window`` committed positions only. None: all.
    context_window: Optional[int] = None
    context_sink: int = 4
    # Draft vocabulary (our extension, in draft_vocab.json): the token ids greedy drafts are
    # chosen from, e.g. the 8,192 most frequent in the training responses. None: all.
    draft_vocab: Optional[list[int]] = None
    extra: dict = field(default_factory=dict)  # unknown fields, written back on save

    @classmethod
    def from_dict(cls, raw: dict) -> "DraftConfig":
        if not isinstance(raw, dict):
            raise DFlashError(f"draft config.json must hold a JSON object, not a {type(raw).__name__}")
        raw = dict(raw)
        dflash = raw.pop("dflash_config", None) or {}
        if not isinstance(dflash, dict):
            raise DFlashError("draft config.json: dflash_config must be an object")
        required = [
            "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "vocab_size", "num_target_layers",
        ]
        missing = [k for k in required if k not in raw]
        if "mask_token_id" not in dflash:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise DFlashError(f"draft config.json lacks {', '.join(missing)}")
        _check_config_values(raw, dflash)
        heads = raw["num_attention_heads"]
        layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(
            raw["num_target_layers"], raw["num_hidden_layers"]
        )
        known = {
            "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "vocab_size", "max_position_embeddings", "block_size",
            "num_target_layers", "rope_scaling", "layer_types", "sliding_window",
        }
        return cls(
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 1_000_000.0),
            vocab_size=raw["vocab_size"],
            max_position_embeddings=raw.get("max_position_embeddings", 40960),
            block_size=raw.get("block_size", 16),
            num_target_layers=raw["num_target_layers"],
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in layer_ids],
            rope_scaling=raw.get("rope_scaling"),
            layer_types=raw.get("layer_types"),
            sliding_window=raw.get("sliding_window"),
            context_window=dflash.get("context_window"),
            context_sink=dflash.get("context_sink", 4),
            extra={k: v for k, v in raw.items() if k not in known},
        )

    def to_dict(self) -> dict:
        out = dict(self.extra)
        out.update(
            {
                "architectures": ["DFlashDraftModel"],
                "model_type": out.get("model_type", "qwen3"),
                "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim,
                "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling,
                "vocab_size": self.vocab_size,
                "max_position_embeddings": self.max_position_embeddings,
                "block_size": self.block_size,
                "num_target_layers": self.num_target_layers,
                "dflash_config": {
                    "mask_token_id": self.mask_token_id,
                    "target_layer_ids": self.target_layer_ids,
                },
            }
        )
        if self.context_window is not None:
            out["dflash_config"].update(context_window=self.context_window, context_sink=self.context_sink)
        if self.layer_types is not None:
            out["layer_types"] = self.layer_types
            out["sliding_window"] = self.sliding_window
        return out

    def is_sliding(self, layer_index: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer_index] == "sliding_attention"


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

    def attend_blocks(self, x: mx.array, context: mx.array, anchors: mx.array, sees_context: mx.array) -> mx.array:
        """Training: all A blocks of each sequence in one pass.

        x [B, A*bs, H] holds A blocks; block i sits at positions anchors[:, i] + (0..bs-1).
        sees_context [B, A, T]: which context positions block i may see (those before its anchor).
        A block also sees itself (bidirectionally) and never another block, so block-to-block
        scores are computed per block ([bs, bs]) instead of masking an [A*bs, A*bs] matrix.
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
        ctx_scores = mx.where(visible, ctx_scores, mx.array(-1e9, ctx_scores.dtype))
        own_scores = (q @ k[:, :, None].swapaxes(-1, -2)).reshape(B, kv, rep, N, bs)  # [.., N, bs]
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


def block_mask(cache: "DraftContextCache", block_len: int, sliding_window: Optional[int]) -> Optional[mx.array]:
    """Which of [context ; block] keys each block query sees ([L, context read + L]; None: all):
    non-causal, or causal and windowed in a sliding-window layer, which stores every position
    (storage index = position) and sees the last ``sliding_window`` positions up to its own."""
    visible = cache.visible()
    if visible is None and sliding_window is None:
        return None
    n_context, start = cache.read_size(), cache.position
    context = mx.ones((n_context,), dtype=mx.bool_) if visible is None else visible
    context = mx.broadcast_to(context[None], (block_len, n_context))
    own = mx.ones((block_len, block_len), dtype=mx.bool_)
    if sliding_window is not None:
        q = mx.arange(block_len)[:, None]
        k = mx.arange(block_len)[None]
        context = context & ((start + q) - mx.arange(n_context)[None] < sliding_window)
        own = (k <= q) & (q - k < sliding_window)
    return mx.concatenate([context, own], axis=1)


COMPACT_SLACK = 64  # a windowed cache drops its middle once it holds this many positions too many

# A decode pass of the draft under mx.compile, as the target's blocks run (target.COMPILE_BLOCKS):
# the host replays a traced graph instead of running the layers' Python, and elementwise ops
# fuse. Each layer's whole context buffer and its length (on the device or not) are inputs, so
# one trace serves every pass of a block length while the buffers keep their size; a new trace
# costs host time once per block length and buffer size (256 positions). Off: not shown faster
# (H200: 2.01 against 2.37 ms a pass queued, but bench A/Bs within the host's spread; this CPU: a
# pass launched as fast either way; BENCHMARKS.md, sixteenth and seventeenth sessions).
# None: on GPUs; tests set it on the CPU.
COMPILE_PASSES: Optional[bool] = False
# A decode pass on GPUs computes its projections as the target's compiled blocks do
# (``projections.py``): q/k/v and gate/up packed into one product each, and (small drafts) row by
# row, MLX's gemv kernel instead of a cuBLAS matmul of a block's rows, the dearest launch on MLX's
# CUDA backend (H200 A/B: 2.80x / 2.81x against 2.70x / 2.65x unpacked; BENCHMARKS.md, twenty-second
# session). Not on the CPU, where packing measured no gain (fourth session). None: on GPUs.
PACK_PASSES: Optional[bool] = None


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

    def __init__(self, sink: int = 0, window: Optional[int] = None):
        self.sink, self.window = sink, window
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
        """How many stored positions a draft pass reads. On GPUs the whole buffer, masked, as a
        verify reads the target's (``rollback.read_length``): a key length that changes every
        cycle costs new kernels on MLX's CUDA backend."""
        return read_length(self.bound) if self.bound else 0

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


class DraftMLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context enters only through attention K/V."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x: mx.array, cache: DraftContextCache, mask: Optional[mx.array]) -> mx.array:
        """Decode: one block over the cached context."""
        h = x + self.self_attn(self.input_layernorm(x), cache, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_blocks(self, x: mx.array, context: mx.array, anchors: mx.array, sees_context: mx.array) -> mx.array:
        """Training: many blocks at once (``DraftAttention.attend_blocks``)."""
        h = x + self.self_attn.attend_blocks(self.input_layernorm(x), context, anchors, sees_context)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The draft network. ``__call__`` maps block embeddings to final hidden states;
    the caller applies the target's head (the draft has none)."""

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        H, K = config.hidden_size, len(config.target_layer_ids)
        self.fc = nn.Linear(K * H, H, bias=False)
        self.hidden_norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self.layers = [DraftLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(H, eps=config.rms_norm_eps)
        self._compiled_pass: Optional[Callable] = None  # (run_block's, traced on first use)
        self._pass_projections: Optional[BlockProjections] = None  # (run_block's, packed on first use)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def make_cache(self) -> list[DraftContextCache]:
        """Per layer: all context, or a sink + sliding window of it (``config.context_window``)
        so that a draft pass costs the same at any context length. Sliding-window layers of
        published drafts keep their own window (their mask counts every position)."""
        return [DraftContextCache(sink, window) for sink, window in self._context_windows()]

    def _context_windows(self) -> list[tuple[int, Optional[int]]]:
        """Per layer, the (sink, window) of its context cache ((0, None): all context)."""
        window, sink = self.config.context_window, self.config.context_sink
        return [(sink, window) if window and not self.config.is_sliding(i) else (0, None)
                for i in range(len(self.layers))]

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
                masks[window] = block_mask(layer_cache, h.shape[1], window)
            h = layer(h, layer_cache, masks[window])
        return self.norm(h)

    def run_block(self, block_embeddings: mx.array, cache: list[DraftContextCache]) -> mx.array:
        """A decode pass over ``cache`` (its new context already stored): ``__call__``, compiled
        where ``COMPILE_PASSES`` says; traced again only when a block length or buffer size changes;
        with packed projections where ``PACK_PASSES`` says."""
        with self._projections():
            return self._run_block(block_embeddings, cache)

    def _projections(self) -> AbstractContextManager:
        if not (on_gpu() if PACK_PASSES is None else PACK_PASSES):
            return nullcontext()
        if self._pass_projections is None:
            self._pass_projections = block_projections(self)
        return self._pass_projections.installed()

    def _run_block(self, block_embeddings: mx.array, cache: list[DraftContextCache]) -> mx.array:
        wanted = on_gpu() if COMPILE_PASSES is None else COMPILE_PASSES
        if not wanted or any(c.keys is None for c in cache):
            return self(block_embeddings, None, cache)
        if self._compiled_pass is None:
            windows = self._context_windows()

            def forward(x: mx.array, *state: mx.array) -> mx.array:
                views = [ContextView(*state[4 * i : 4 * i + 4], sink, window) for i, (sink, window) in enumerate(windows)]
                return self(x, None, views)
            self._compiled_pass = mx.compile(forward)
        state = [x for c in cache for x in (c.keys, c.values, device_count(c.length), mx.array(c.dropped))]
        return self._compiled_pass(block_embeddings, *state)

    # The compiled pass holds the weights as constants of its trace (as inputs they cost ~0.4 ms
    # of host time a pass, here), and the packed projections copies of them, so new weights drop
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
        if self.config.layer_types and "sliding_attention" in self.config.layer_types:
            raise DFlashError("training drafts with sliding-window layers is not supported")
        h = block_embeddings
        for layer in self.layers:
            h = layer.forward_blocks(h, context, anchors, sees_context)
        return self.norm(h)


# ---------------------------------------------------------------------------
# Checkpoint I/O


def _resolve_path(path_or_repo: str) -> Path:
    """A local folder, or a Hugging Face repo id resolved the way mlx-lm does."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if path_or_repo.count("/") != 1 or path_or_repo.startswith((".", "/", "~")):
        raise DFlashError(f"draft not found: {path_or_repo}")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_repo, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as exc:  # offline, unknown repo, auth: all one message for the user
        raise DFlashError(f"draft {path_or_repo!r} is not a local folder and could not be fetched: {exc}") from None


def load_draft(path_or_repo: str, dtype: Optional[mx.Dtype] = None) -> DFlashDraft:
    """Load a draft in the published format; every failure is a one-line DFlashError."""
    path = _resolve_path(path_or_repo)
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise DFlashError(f"{path} has no {CONFIG_FILE}: not a DFlash draft folder")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{config_path} is not valid JSON: {exc}") from None
    config = DraftConfig.from_dict(raw)
    config.draft_vocab = _read_draft_vocab(path, config.vocab_size)
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise DFlashError(f"{path} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in weight_files:
        try:
            weights.update(mx.load(str(file)))
        except Exception as exc:
            raise DFlashError(f"cannot read draft weights {file}: {exc}") from None
    draft = DFlashDraft(config)
    quantization = raw.get("quantization")
    if quantization:
        quantize_draft(draft, quantization["bits"], quantization["group_size"])
    try:
        draft.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise DFlashError(f"draft weights in {path} do not match its config: {exc}") from None
    if quantization and dtype is not None and not on_apple_gpu():
        return dequantize_draft(draft, dtype)
    if dtype is not None and not quantization:
        draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft


def dequantize_draft(draft: DFlashDraft, dtype: mx.Dtype) -> DFlashDraft:
    """A float copy of a quantized draft: the file stays small, the compute stays fast. Used
    everywhere but on Apple GPUs. On the CPU MLX's quantized matmul on a 16-token block is ~3x
    slower than float32 BLAS. On CUDA, MLX 0.32 compiles a quantized-matmul kernel (NVRTC) the
    first time it meets each class of row counts (<= 16, 17-32, more): blocks use the first,
    prompts mostly the last, and the middle one first turns up mid-generation (the draft's
    context catching up after a run of plain steps in adaptive mode): a 15-20 s stall on an
    H200 (BENCHMARKS.md, eighth session); expanded, the ninth session's 8 adaptive runs took
    0.20-0.81 s each, no stall. There the bf16 form of the same draft measured within
    noise of the 8-bit one (1.09x vs 1.11x over plain decoding with fixed blocks, 1.05x vs 1.01x
    adaptive; seventh session)."""
    weights = dict(tree_flatten(draft.parameters()))
    for name, module in draft.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            for part in ("weight", "scales", "biases"):
                weights.pop(f"{name}.{part}", None)
            weights[f"{name}.weight"] = mx.dequantize(module.weight, module.scales, module.biases,
                                                      module.group_size, module.bits)
    extra = {k: v for k, v in draft.config.extra.items() if k != "quantization"}
    plain = DFlashDraft(replace(draft.config, extra=extra))
    plain.load_weights(list(weights.items()), strict=True)
    plain.set_dtype(dtype)
    mx.eval(plain.parameters())
    return plain


def is_quantized(draft: DFlashDraft) -> bool:
    return any(isinstance(m, nn.QuantizedLinear) for _, m in draft.named_modules())


def quantize_draft(draft: DFlashDraft, bits: int, group_size: int = 64) -> None:
    """Quantize the draft's linear layers in place (its norms stay in float)."""
    if is_quantized(draft):
        raise DFlashError("this draft is already quantized")
    nn.quantize(draft, group_size=group_size, bits=bits)
    draft.config.extra["quantization"] = {"group_size": group_size, "bits": bits}


def save_draft(draft: DFlashDraft, path: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in the published layout."""
    path = Path(path)
    vocab_file = path / DRAFT_VOCAB_FILE
    if draft.config.draft_vocab:
        check_draft_vocab(draft.config.draft_vocab, draft.config.vocab_size, vocab_file)
    path.mkdir(parents=True, exist_ok=True)
    # each file is written beside the folder and moved in whole: an interrupted save (or one
    # over the draft it was loaded from) never leaves a half-written file
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}-") as tmp:
        staged = Path(tmp)
        mx.save_safetensors(str(staged / WEIGHTS_FILE), dict(tree_flatten(draft.parameters())),
                            metadata={"format": "mlx"})
        (staged / CONFIG_FILE).write_text(json.dumps(draft.config.to_dict(), indent=2) + "\n")
        if draft.config.draft_vocab:
            (staged / DRAFT_VOCAB_FILE).write_text(json.dumps(draft.config.draft_vocab) + "\n")
        elif vocab_file.exists():
            vocab_file.unlink()
        for file in staged.iterdir():
            os.replace(file, path / file.name)
    return path


def _read_draft_vocab(path: Path, vocab_size: int) -> Optional[list[int]]:
    file = path / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DFlashError(f"{file} is not valid JSON: {exc}") from None
    check_draft_vocab(ids, vocab_size, file)
    return ids


def check_draft_vocab(ids, vocab_size: int, file: Path) -> None:
    """The one rule for a draft vocabulary, on reading and on writing it."""
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
            and len(set(ids)) == len(ids)):
        raise DFlashError(f"{file} must be a non-empty list of distinct token ids in 0..{vocab_size - 1}"
                          " (token ids of this draft's target)")


def create_random_draft(
    target_config: dict[str, Any],
    *,
    num_layers: int = 5,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: Optional[list[int]] = None,
    seed: int = 0,
) -> DFlashDraft:
    """A freshly initialised draft shaped after the target's layers (for tests and training)."""
    num_target_layers = target_config["num_hidden_layers"]
    heads = target_config["num_attention_heads"]
    layer_ids = target_layer_ids or default_target_layer_ids(num_target_layers, num_layers)
    config = DraftConfig(
        hidden_size=target_config["hidden_size"],
        intermediate_size=target_config["intermediate_size"],
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
    )
    mx.random.seed(seed)
    draft = DFlashDraft(config)
    mx.eval(draft.parameters())
    return draft
