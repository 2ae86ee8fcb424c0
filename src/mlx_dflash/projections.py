"""How a compiled block computes its projections: packed, and one row at a time.

A small model's block on a GPU is bound by the host launching kernels, and on MLX's CUDA backend
the dearest launch there is a matmul of several rows: cuBLAS, captured into a child graph per call
(``tools/launch_costs.py`` shows it). Two changes, both only inside the traced
block forward (``Target``'s compiled blocks), per model instance, no class patched:

- **Packed**: an attention layer computes q, k and v from one input, an MLP its gate and up, a
  Gated DeltaNet mixer its four (Qwen3.5) or two (Qwen3-Next) input projections. Each group's
  matrices are packed into one (the members' weights become views of it: no extra memory),
  multiplied once and the product split: three matmuls a layer fewer (Qwen3.5: four).
- **Row by row** (``EngineOptions.rowwise_products``; by default on GPUs, for models up to ``ROWWISE_MAX_BYTES``):
  ``x @ W.T`` as ``W @ x[..., None]``, a batch of matrix-vector products with the weight
  broadcast, which MLX runs as its own gemv kernel (one graph node, no cuBLAS), the kernel of
  mlx-lm's one-token step: each row's product is then the step's bit for bit, so fewer bf16
  near-ties are decided differently from mlx-lm's steps (and small float32 models verify faster:
  docs/performance.md). It reads each weight once per row, so larger models and the CPU keep
  one matmul.

Outside a trace the model runs its own modules, so mlx-lm's steps (and ours) pay nothing.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from functools import partial
from itertools import accumulate
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from .device import on_gpu

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"),
          ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # a Qwen3.5 Gated DeltaNet's inputs
          ("in_proj_qkvz", "in_proj_ba"))  # Qwen3-Next's
WEIGHTS = ("weight", "scales", "biases", "bias")  # what a (quantized) linear layer may hold
# Row by row, a block reads each weight once per row where it does not stay in the GPU's cache.
# For a model of at most this many bytes of plain weights that is device time hidden under the
# host's launches; a larger model would turn its verify bandwidth-bound, so by default only GPUs
# and models up to this size run row by row (the default pair's float32 target, 513 MiB, included).
ROWWISE_MAX_BYTES = 768 * 2**20


def rowwise_product(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` as one matrix-vector product per row of ``x`` (MLX's gemv kernel)."""
    return mx.matmul(weight, x[..., None])[..., 0]


def project(layer: nn.Module, x: mx.array, rowwise: bool) -> mx.array:
    """``layer(x)``, row by row where ``rowwise`` and the layer is a plain linear one."""
    if not (rowwise and type(layer) is nn.Linear):
        return layer(x)
    y = rowwise_product(x, layer.weight)
    return y + layer.bias if "bias" in layer else y


class _PackedGroup:
    """The packed layer of one group, and its product for the latest input (the group's
    members are called one after the other with the same input array)."""

    def __init__(self, packed: nn.Module, rowwise: bool):
        self.packed, self.rowwise = packed, rowwise
        self.latest_input: Optional[mx.array] = None
        self.latest_output: Optional[mx.array] = None

    def output(self, x: mx.array) -> mx.array:
        if x is not self.latest_input:
            self.latest_input, self.latest_output = x, project(self.packed, x, self.rowwise)
        return self.latest_output


class PackedProjection(nn.Module):
    """One member of a packed group: its slice of the group's product."""

    def __init__(self, group: _PackedGroup, start: int, end: int):
        super().__init__()
        self.group = group  # a plain object: not part of the parameters
        self.start, self.end = start, end

    def __call__(self, x: mx.array) -> mx.array:
        return self.group.output(x)[..., self.start : self.end]


class RowwiseProjection(nn.Module):
    """A plain linear layer computed row by row (``rowwise_product``)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.product = partial(project, linear, rowwise=True)  # a plain attribute: the weights stay the model's

    def __call__(self, x: mx.array) -> mx.array:
        return self.product(x)


Swap = tuple[nn.Module, str, nn.Module, nn.Module]  # (parent, child's name, its own module, the one installed)


@contextmanager
def swapped(swaps: list[Swap]) -> Iterator[None]:
    """Each parent's child replaced by the installed module for the duration, then its own again."""
    for parent, name, _, replacement in swaps:
        setattr(parent, name, replacement)
    try:
        yield
    finally:
        for parent, name, own, _ in swaps:
            setattr(parent, name, own)


def _packable(linears: list[nn.Module]) -> bool:
    """Same layer type (plain or quantized alike), input size, bias and quantization."""
    first = linears[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not type(first) for x in linears):
        return False
    same = ("group_size", "bits", "mode")
    return all(x.weight.shape[1:] == first.weight.shape[1:] and ("bias" in x) == ("bias" in first)
               and all(getattr(x, a, None) == getattr(first, a, None) for a in same) for x in linears)


class BlockProjections:
    """One model instance's projections as a compiled block computes them: the packable groups
    packed once; ``installed()`` puts the packed (and row-by-row) projections in place for the
    duration of a trace. ``packed``: the model's packed layers by (parent module, group), shared
    with its other ``BlockProjections`` (packing again would keep a second copy of the weights)."""

    def __init__(self, model: nn.Module, pack: bool, rowwise: bool, packed: Optional[dict] = None):
        self.packed = {} if packed is None else packed
        self.swaps: list[Swap] = []
        self.embeddings: list[nn.Embedding] = []  # tied heads: ``as_linear`` row by row
        grouped = set()
        for module in model.modules():
            for names in GROUPS if pack else ():
                members = [getattr(module, name, None) for name in names]
                if all(isinstance(m, nn.Module) for m in members) and _packable(members):
                    self._pack(module, names, members, rowwise)
                    grouped.update(id(m) for m in members)
        for module in model.modules() if rowwise else ():
            for name, child in module.children().items():
                if type(child) is nn.Linear and id(child) not in grouped:
                    self.swaps.append((module, name, child, RowwiseProjection(child)))
            if type(module) is nn.Embedding:
                self.embeddings.append(module)

    def _pack(self, parent: nn.Module, names: tuple[str, ...], linears: list[nn.Module], rowwise: bool) -> None:
        ends = list(accumulate(linear.weight.shape[0] for linear in linears))
        bounds = list(zip([0, *ends[:-1]], ends))  # each member's rows of the packed layer
        key = (id(parent), names)
        if key not in self.packed:
            packed = copy.copy(linears[0])
            for name in WEIGHTS:
                if name in linears[0]:
                    packed[name] = mx.concatenate([x[name] for x in linears], axis=0)
            mx.eval(packed.parameters())
            for linear, (start, end) in zip(linears, bounds):
                for name in WEIGHTS:
                    if name in linear:
                        linear[name] = packed[name][start:end]  # a view: the memory is the packed layer's
            mx.eval([linear.parameters() for linear in linears])  # (one group at a time: little extra memory)
            self.packed[key] = packed
        group = _PackedGroup(self.packed[key], rowwise)
        for name, linear, (start, end) in zip(names, linears, bounds):
            self.swaps.append((parent, name, linear, PackedProjection(group, start, end)))

    @contextmanager
    def installed(self) -> Iterator[None]:
        for embedding in self.embeddings:
            embedding.as_linear = lambda x, weight=embedding.weight: rowwise_product(x, weight)
        try:
            with swapped(self.swaps):
                yield
        finally:
            for embedding in self.embeddings:
                del embedding.as_linear  # (the instance attribute: the class's method again)
            for _, _, _, replacement in self.swaps:
                if isinstance(replacement, PackedProjection):
                    replacement.group.latest_input = replacement.group.latest_output = None


def plain_weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's unquantized linear and embedding weights: what row-by-row products
    would read once per row."""
    return sum(m.weight.nbytes for m in model.modules() if type(m) in (nn.Linear, nn.Embedding))


def block_projections(model: nn.Module, pack: bool = True, rowwise: Optional[bool] = None,
                      packed: Optional[dict] = None) -> BlockProjections:
    """``model``'s projections for compiled blocks: ``pack``ed (reusing ``packed``, its layers
    packed before), and ``rowwise`` (None: on GPUs, for models of up to ROWWISE_MAX_BYTES); the
    model computes as before until ``installed()``."""
    if rowwise is None:
        rowwise = on_gpu() and plain_weight_bytes(model) <= ROWWISE_MAX_BYTES
    return BlockProjections(model, pack=pack, rowwise=rowwise, packed=packed)
