"""Attention, SwiGLU and RoPE of a block on the CPU: an exponential that vectorizes, shared tables.

MLX's CPU backend on x86 computes ``exp`` one element at a time (its SIMD layer has no x86
vectors there; each element calls libm's ``fmaf`` six times, ~25 ns). A one-token step barely
notices, but a block multiplies the exponentials of attention (heads x block x keys) and of
SiLU (block x intermediate size) by its length, until they are a large share of a verify
(docs/performance.md).

``exp`` below is MLX's own polynomial (2**f on [-1/2, 1/2], degree 6, the same coefficients,
times 2**n made from exponent bits) written as elementwise ops, which ``mx.compile`` fuses into
loops the C++ compiler vectorizes: several times faster than ``mx.exp``, within 2 ulp of it (no fused
multiply-add).

``rope`` gives ``nn.RoPE``'s numbers bit for bit, with the angles' tables made once per forward
instead of once per layer (MLX's CPU RoPE rebuilds them on every call: ~9 ms of a 30-layer
forward, at any length).

Blocks of a float32 target on the CPU run mlx-lm's own attention and MLP code with its
``scaled_dot_product_attention`` and ``swiglu`` bound to the versions here, and ``rope`` in
place of its ``nn.RoPE`` modules, per module instance (``BlockKernels``; no class or module of
mlx-lm is patched), the way ``projections.py`` swaps projections. One-token steps and prompts
keep mlx-lm's code and numbers, with ``rope`` alone (its numbers are the module's); the draft
calls ``attention``, ``swiglu`` and ``rope`` directly.

On CUDA the same binding gives a block's attention to ``cuda_attention`` (one kernel launch
instead of MLX's five a layer) and leaves everything else to MLX's own GPU kernels.
"""

from __future__ import annotations

import inspect
import threading
import types
from contextlib import AbstractContextManager
from functools import lru_cache, partial
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from . import cuda_attention
from .device import on_cuda, on_gpu
from .projections import Swap, swapped

LOG2_E = 1.4426950408889634
# MLX's coefficients of 2**f on [-1/2, 1/2] (mlx/backend/cpu/simd/math.h), highest degree first
EXP2_POLYNOMIAL = (1.535336188319500e-4, 1.339887440266574e-3, 9.618437357674640e-3, 5.550332471162809e-2,
                   2.402264791363012e-1, 6.931472028550421e-1, 1.0)
ROUNDING = 12582912.0  # 1.5 * 2**23: t + ROUNDING - ROUNDING rounds t to an integer (|t| < 2**22)
LOWEST, HIGHEST = -87.0, 88.0  # exp(x) for x below LOWEST is 0 here (MLX: below -88); above HIGHEST, clipped


@partial(mx.compile, shapeless=True)
def _exp_parts(x: mx.array, shift: mx.array) -> tuple[mx.array, mx.array]:
    """exp(x - shift) = 2**t = 2**f * 2**n, t = n + f: (the polynomial's 2**f, the bits of 2**n)."""
    t = mx.clip(x - shift, LOWEST, HIGHEST) * LOG2_E
    n = (t + ROUNDING) - ROUNDING
    f = t - n
    power = EXP2_POLYNOMIAL[0]
    for c in EXP2_POLYNOMIAL[1:]:
        power = power * f + c
    return power, (n.astype(mx.int32) + 127) * (1 << 23)


@partial(mx.compile, shapeless=True)
def _times_power_of_two(power: mx.array, two_to_n: mx.array, x: mx.array, shift: mx.array) -> mx.array:
    return mx.where(x - shift < LOWEST, 0.0, power * two_to_n)


@mx.custom_function
def shifted_exp(x: mx.array, shift: mx.array) -> mx.array:
    """``mx.exp(x - shift)`` of float32 ``x`` (``shift`` broadcasts to it), vectorized (see the
    module's docstring), the subtraction inside its loops: a softmax's shifted scores are never
    written out. -inf gives 0."""
    power, bits = _exp_parts(x, shift)
    return _times_power_of_two(power, bits.view(mx.float32), x, shift)  # (a view: the bits, read as floats)


@shifted_exp.vjp
def _shifted_exp_vjp(primals: tuple, cotangent: mx.array, output: mx.array) -> tuple[mx.array, mx.array]:
    # (MLX has no gradient for a view: a draft trained on the CPU needs this)
    grad = cotangent * output
    shift = primals[1]
    lead = grad.ndim - shift.ndim  # (the axes ``shift`` was broadcast over, summed back)
    axes = [*range(lead), *(lead + i for i, n in enumerate(shift.shape) if n == 1 and grad.shape[lead + i] != 1)]
    return grad, -grad.sum(axis=axes, keepdims=True).reshape(shift.shape)


def exp(x: mx.array) -> mx.array:
    """``mx.exp`` of float32 ``x``, vectorized. -inf gives 0."""
    return shifted_exp(x, mx.array(0.0, dtype=x.dtype))


@partial(mx.compile, shapeless=True)
def _silu_times(gate: mx.array, exp_minus_gate: mx.array, x: mx.array) -> mx.array:
    return gate * (1.0 / (1.0 + exp_minus_gate)) * x  # MLX's sigmoid: 1 / (1 + exp(-x))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x`` (mlx-lm's ``swiglu``); on the CPU in float32 with ``exp``."""
    if not _vectorized_exp_pays(gate):
        return mlx_lm_swiglu(gate, x)
    return _silu_times(gate, exp(-gate), x)


def logsumexp(x: mx.array) -> mx.array:
    """``mx.logsumexp(x, axis=-1, keepdims=True)``; on the CPU in float32 with ``exp`` (a tree's
    log-probabilities over a whole vocabulary, one row per draft slot)."""
    if not _cpu_float32(x.dtype):
        return mx.logsumexp(x, axis=-1, keepdims=True)
    top = x.max(axis=-1, keepdims=True)
    return top + mx.log(shifted_exp(x, top).sum(axis=-1, keepdims=True))


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Union[None, str, mx.array]) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` (no sinks); on the CPU in float32 with ``exp``;
    a block's queries on CUDA in one launch (``cuda_attention``).

    The query heads sharing a key head are stacked into one matrix (one product per key head),
    and the softmax is normalised after its product with the values (a [queries, head_dim]
    division instead of [queries, keys])."""
    if cuda_attention.fits(queries, keys, values, mask):
        return cuda_attention.block_attention(queries, keys, values, scale, mask)
    if not _vectorized_exp_pays(queries) or (isinstance(mask, mx.array) and mask.ndim not in (2, 4)):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    B, n_heads, L, D = queries.shape
    n_kv_heads, S = keys.shape[1], keys.shape[2]
    repeats = n_heads // n_kv_heads
    q = (queries * scale).reshape(B, n_kv_heads, repeats * L, D)  # rows: (query head, position)
    scores = q @ keys.swapaxes(-1, -2)  # [B, kv heads, repeats * L, S]
    if isinstance(mask, str):  # "causal": the block's queries are the last L positions
        mask = _causal_mask(L, S, repeats, threading.get_ident())
    elif mask is not None:
        if mask.ndim == 4:  # [B or 1, heads or 1, L, S]: the stacked heads' layout
            mask = mx.broadcast_to(mask, (mask.shape[0], n_heads, L, S))
            mask = mask.reshape(mask.shape[0], n_kv_heads, repeats * L, S)
        elif repeats > 1:
            mask = mx.tile(mask, (repeats, 1))
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = shifted_exp(scores, scores.max(axis=-1, keepdims=True))
    out = (weights @ values) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(B, n_heads, L, D)


@lru_cache(maxsize=4)
def _causal_mask(length: int, keys: int, repeats: int, thread: int) -> mx.array:
    """[repeats * length, keys]: the last ``length`` positions' causal mask, once per query
    head sharing a key head (made once for all the layers of a forward; kept per thread, as
    ``rope``'s tables are: it is built lazily on its thread's stream)."""
    return mx.tile(mx.arange(keys - length, keys)[:, None] >= mx.arange(keys)[None], (repeats, 1))


def rope(module: nn.Module, x: mx.array, offset: Union[int, mx.array] = 0) -> mx.array:
    """``module(x, offset=offset)``, the same numbers; for an ``nn.RoPE`` on the CPU in float32
    its angles' cosines and sines are made once per (offset, length) instead of once per call.

    MLX's CPU RoPE builds its tables from positions, exp, cos and sin on every call (~190 us, a
    30-layer model calls it 60 times a forward, at any length); the layers of one forward share
    their positions. The tables are MLX's own: its RoPE of (1, 0) pairs."""
    if not (_cpu_float32(x.dtype) and type(module) is nn.RoPE and not module.traditional
            and module.dims == x.shape[-1] and isinstance(offset, int)):
        return module(x, offset=offset)
    # (kept per thread: a table is built lazily on its thread's stream, which no other thread has)
    return _rotate(x, _rotations(module.dims, module.base, module.scale, offset, x.shape[-2], threading.get_ident()))


def rope_at_depths(module: nn.Module, x: mx.array, offset: Union[int, mx.array], depths: list[int]
                   ) -> Optional[mx.array]:
    """A tree's nodes (``x`` [B, heads, nodes, dims]) rotated by an ``nn.RoPE`` at positions
    ``offset + depths``, from ``rope``'s tables (rows gathered by depth); None where ``rope``'s
    tables do not apply (the caller then rotates each node at its own offset)."""
    if not (_cpu_float32(x.dtype) and type(module) is nn.RoPE and not module.traditional
            and module.dims == x.shape[-1] and isinstance(offset, int)):
        return None
    table = _rotations(module.dims, module.base, module.scale, offset, max(depths) + 1, threading.get_ident())
    return _rotate(x, table[mx.array(depths)])


@lru_cache(maxsize=8)
def _rotations(dims: int, base: float, scale: float, offset: int, length: int, thread: int) -> mx.array:
    """[length, dims]: the cosines, then the sines, of RoPE's angles at positions offset, ...,
    as MLX computes them (rotating x1 = 1, x2 = 0 gives x1 * cos - x2 * sin, x1 * sin + x2 * cos)."""
    half = dims // 2
    unit = mx.concatenate([mx.ones((1, 1, length, half)), mx.zeros((1, 1, length, half))], axis=-1)
    return mx.fast.rope(unit, dims, traditional=False, base=base, scale=scale, offset=offset)[0, 0]


@mx.compile
def _rotate(x: mx.array, rotations: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    cos, sin = rotations[:, :half], rotations[:, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)  # MLX's order


def _cpu_float32(dtype: mx.Dtype) -> bool:
    """Where this module's functions apply: the CPU (on GPUs MLX's own kernels are the fast
    ones) in float32 (in half precision the polynomial would lose digits)."""
    return not on_gpu() and dtype == mx.float32


def _vectorized_exp_pays(x: mx.array) -> bool:
    """The CPU in float32, and a block."""
    return _cpu_float32(x.dtype) and x.shape[-2] > 1


def _block_sdpa(queries, keys, values, cache, scale: float, mask, sinks=None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` with ``attention`` where it applies (not for
    attention sinks or quantized caches)."""
    if sinks is not None or hasattr(cache, "bits"):
        return mlx_lm_base.scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)
    return attention(queries, keys, values, scale, mask)


REBOUND = {"scaled_dot_product_attention": _block_sdpa, "swiglu": swiglu}  # mlx-lm's name -> ours
MLX_LM_FUNCTIONS = {"scaled_dot_product_attention": mlx_lm_base.scaled_dot_product_attention, "swiglu": mlx_lm_swiglu}


def _same_parameters(name: str) -> bool:
    """Whether mlx-lm's function still takes the parameters ours does (a later mlx-lm that
    changed them keeps its own: its modules would call ours with what ours does not know)."""
    theirs = inspect.signature(MLX_LM_FUNCTIONS[name]).parameters
    return list(theirs) == list(inspect.signature(REBOUND[name]).parameters)


class ReboundModule(nn.Module):
    """One module instance called through its class's own ``__call__``, whose global names in
    ``REBOUND`` resolve to our functions."""

    def __init__(self, module: nn.Module, call: Callable):
        super().__init__()
        self.call = partial(call, module)  # a plain attribute: the weights stay the module's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # (a parent may read its child's attributes; they are the module's)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.call.args[0], name)


def _block_call(module: nn.Module, functions: tuple[str, ...], tables: bool) -> Optional[Callable]:
    """What a block calls in the module's place: for an ``nn.RoPE``, ``rope`` (with ``tables``);
    else the module's ``__call__`` with our functions for those of ``functions`` (``REBOUND``
    names) it reads as globals where they are mlx-lm's (its model files import them by name);
    None for a module with neither."""
    if type(module) is nn.RoPE:
        return rope if tables else None
    call = type(module).__call__
    code = getattr(call, "__code__", None)
    if code is None:
        return None
    ours = [name for name in functions if name in code.co_names
            and call.__globals__.get(name) is MLX_LM_FUNCTIONS[name] and _same_parameters(name)]
    if not ours:
        return None
    namespace = dict(call.__globals__)
    namespace.update((name, REBOUND[name]) for name in ours)
    rebound = types.FunctionType(code, namespace, call.__name__, call.__defaults__, call.__closure__)
    rebound.__kwdefaults__ = call.__kwdefaults__
    return rebound


class BlockKernels:
    """The attention and MLP modules of one model instance that call mlx-lm's
    ``scaled_dot_product_attention`` or ``swiglu`` (those of ``functions``), and with ``tables``
    its ``nn.RoPE`` modules; ``installed()`` puts rebound copies (and ``rope``) in their places
    for the duration of a block's forward; ``exact()`` only ``rope``, whose numbers are the
    module's own, for any other forward."""

    def __init__(self, model: nn.Module, functions: tuple[str, ...] = tuple(REBOUND), tables: bool = True):
        self.swaps: list[Swap] = []
        for parent in model.modules():
            for name, child in parent.children().items():
                call = _block_call(child, functions, tables) if isinstance(child, nn.Module) else None
                if call is not None:
                    self.swaps.append((parent, name, child, ReboundModule(child, call)))
        self.rope_swaps = [swap for swap in self.swaps if type(swap[2]) is nn.RoPE]

    def installed(self) -> AbstractContextManager:
        return swapped(self.swaps)

    def exact(self) -> AbstractContextManager:
        return swapped(self.rope_swaps)


def block_kernels(model: nn.Module, dtype: mx.Dtype) -> Optional[BlockKernels]:
    """``BlockKernels`` for a float32 model on the CPU; on CUDA for its blocks' attention alone
    (``cuda_attention``); else None (its own code is the fast one)."""
    if _cpu_float32(dtype):
        return BlockKernels(model)
    if on_cuda():
        return BlockKernels(model, functions=("scaled_dot_product_attention",), tables=False)
    return None
