"""Packed projections: one matmul where a layer multiplies one input by several matrices.

An attention layer computes q, k and v from the same input, an MLP its gate and up: five
matmuls a layer. A small model's block on a GPU is bound by the host launching kernels, and a
matmul of a 16-token block is the dearest launch there (SmolLM2-135M on an H200: a verify's launch
took 2.4 ms longer than a step's with as many primitives, ~9 us for each of its 271 matmuls;
``scripts/launch_costs.py``). So the rows of each group's matrices are packed into one matrix,
multiplied once, and the product split: two matmuls a layer fewer for q/k/v, one for gate/up
(the issue's "packed QKV and gate/up projections").

Per model instance, no class patched, and only inside the traced block forward
(``Target``'s compiled blocks): ``PackedProjections.installed()`` swaps each projection for a
``PackedProjection`` while the block is traced; outside it the model runs its own modules, so
mlx-lm's steps (and ours) pay no wrapper. The projections' weights become views into the packed
ones (no extra memory).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
WEIGHTS = ("weight", "scales", "biases", "bias")  # what a (quantized) linear layer may hold
PACK_PROJECTIONS = True  # in compiled blocks (False: separate matmuls there too, to measure the difference)


class _PackedGroup:
    """The packed layer of one group, and its product for the latest input (the group's
    members are called one after the other with the same input array)."""

    def __init__(self, packed: nn.Module):
        self.packed = packed
        self.latest_input: Optional[mx.array] = None
        self.latest_output: Optional[mx.array] = None

    def output(self, x: mx.array) -> mx.array:
        if x is not self.latest_input:
            self.latest_input, self.latest_output = x, self.packed(x)
        return self.latest_output


class PackedProjection(nn.Module):
    """One member of a packed group: its slice of the group's product."""

    def __init__(self, group: _PackedGroup, start: int, end: int):
        super().__init__()
        self.group = group  # a plain object: not part of the parameters
        self.start, self.end = start, end

    def __call__(self, x: mx.array) -> mx.array:
        return self.group.output(x)[..., self.start : self.end]


def _packable(linears: list[nn.Module]) -> bool:
    """Same layer type (plain or quantized alike), input size, bias and quantization."""
    first = linears[0]
    if type(first) not in (nn.Linear, nn.QuantizedLinear) or any(type(x) is not type(first) for x in linears):
        return False
    same = ("group_size", "bits", "mode")
    return all(x.weight.shape[1:] == first.weight.shape[1:] and ("bias" in x) == ("bias" in first)
               and all(getattr(x, a, None) == getattr(first, a, None) for a in same) for x in linears)


class PackedProjections:
    """The packable groups of one model instance, packed once; ``installed()`` puts the packed
    projections in place for the duration of a trace."""

    def __init__(self, model: Optional[nn.Module]):
        self.swaps: list[tuple[nn.Module, str, nn.Module, PackedProjection]] = []  # (parent, name, own, packed)
        for module in model.modules() if model is not None else []:
            for names in GROUPS:
                members = [getattr(module, name, None) for name in names]
                if all(isinstance(m, nn.Module) for m in members) and _packable(members):
                    self._pack(module, names, members)

    def _pack(self, parent: nn.Module, names: tuple[str, ...], linears: list[nn.Module]) -> None:
        packed = copy.copy(linears[0])
        for key in WEIGHTS:
            if key in linears[0]:
                packed[key] = mx.concatenate([x[key] for x in linears], axis=0)
        mx.eval(packed.parameters())
        group = _PackedGroup(packed)
        start = 0
        for name, linear in zip(names, linears):
            end = start + linear.weight.shape[0]
            for key in WEIGHTS:
                if key in linear:
                    linear[key] = packed[key][start:end]  # a view: the memory is the packed layer's
            self.swaps.append((parent, name, linear, PackedProjection(group, start, end)))
            start = end
        mx.eval([linear.parameters() for linear in linears])  # (one group at a time: little extra memory)

    @contextmanager
    def installed(self) -> Iterator[None]:
        for parent, name, _, packed in self.swaps:
            setattr(parent, name, packed)
        try:
            yield
        finally:
            for parent, name, own, _ in self.swaps:
                setattr(parent, name, own)
            for _, _, _, packed in self.swaps:
                packed.group.latest_input = packed.group.latest_output = None


def pack_projections(model: nn.Module) -> PackedProjections:
    """Pack every group of projections of ``model`` that can be (none if ``PACK_PROJECTIONS``
    is off); the model computes as before until ``installed()``."""
    return PackedProjections(model if PACK_PROJECTIONS else None)
