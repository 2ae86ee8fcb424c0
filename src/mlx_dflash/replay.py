"""A proposer that replays a known continuation with mistakes at chosen places.

It needs no trained weights: tests use it to force every acceptance length,
and the benchmark's scale mode uses it to time the engine at real model sizes
with a chosen acceptance distribution (results labelled "replay").
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from .errors import DFlashError
from .proposer import DFlashProposer
from .target import Target

# cycle index -> how many drafted tokens are right before the first wrong one (None: all right)
Schedule = Union[Sequence[Optional[int]], Callable[[int], Optional[int]]]


class ReplayProposer:
    def __init__(self, reference: Sequence[int], block_size: int, schedule: Schedule, vocab_size: int,
                 cost_of: Optional[DFlashProposer] = None):
        """``reference`` is the full token sequence (prompt + the target's greedy continuation).

        ``cost_of``: a DFlash proposer (random weights will do) that runs on every cycle and whose
        output is discarded, so that timings include a real draft's cost.
        """
        self.reference = list(reference)
        self.block_size = block_size
        self.schedule = schedule
        self.vocab_size = vocab_size
        self.cost_of = cost_of
        self.layer_ids: list[int] = cost_of.layer_ids if cost_of else []  # plain replay needs no features

    def start(self, target: Target) -> None:
        self.position: Union[int, mx.array] = 0  # committed tokens so far (on the device after a count it has not read)
        self.cycle = 0
        # the reference on the device and a 0 that every slot past its end reads (``propose``)
        self.tokens = mx.array(self.reference + [0], dtype=mx.uint32)
        if self.cost_of:
            self.cost_of.start(target)

    def add_context(self, features: mx.array, kept: Union[None, int, mx.array] = None) -> None:
        self.position = self.position + (features.shape[1] if kept is None else kept)
        if self.cost_of:
            self.cost_of.add_context(features, kept)

    def settle(self, positions: int) -> None:
        self.position = positions
        if self.cost_of:
            self.cost_of.settle(positions)

    @property
    def state(self) -> list:
        return self.cost_of.state if self.cost_of else []

    @property
    def context_key(self) -> int:
        return id(self)

    def context_caches(self) -> list:
        return self.cost_of.context_caches() if self.cost_of else []

    def use_context(self, caches: list, positions: int) -> None:
        self.position = positions
        if self.cost_of:
            self.cost_of.use_context(caches, positions)

    def correct_prefix(self, cycle: int) -> Optional[int]:
        if callable(self.schedule):
            return self.schedule(cycle)
        return self.schedule[cycle % len(self.schedule)]

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        # block slot k (1..) predicts the token at position `position + k`
        slots = mx.arange(num_tokens)
        at = mx.minimum(self.position + 1 + slots, self.tokens.size - 1)
        proposal = self.tokens[at]
        wrong_at = self.correct_prefix(self.cycle)
        self.cycle += 1
        if wrong_at is not None and wrong_at < num_tokens:
            proposal = mx.where(slots == wrong_at, (proposal + 1) % self.vocab_size, proposal)
        if self.cost_of:  # computed (it is an input), then ignored
            proposal = mx.where(mx.array(True), proposal, self.cost_of.propose(first_token, num_tokens))
        return proposal


def replay_methods(draft, means: Sequence[float], vocab_size: int) -> dict:
    """The benchmark's replay methods: per mean acceptance, fixed blocks and the adaptive policy,
    each a factory(reference) -> ReplayProposer, with ``draft``'s pass run every cycle for its cost."""
    size = draft.block_size
    return {f"dflash_replay_mean{m}{policy}": partial(ReplayProposer, block_size=size, vocab_size=vocab_size,
                                                       schedule=geometric_schedule(m, size), cost_of=DFlashProposer(draft))
            for m in means for policy in ("", "_adaptive")}


def geometric_schedule(mean_acceptance: float, block_size: int, seed: int = 0) -> Callable[[int], Optional[int]]:
    """Each drafted slot is right with probability p (p chosen so the mean acceptance
    length, capped at ``block_size``, is ``mean_acceptance``); the first wrong slot ends it."""
    if not 1 <= mean_acceptance <= block_size:
        raise DFlashError(f"a replay's mean acceptance must be in 1..{block_size} (the block size), "
                          f"got {mean_acceptance}")

    def expected(p: float) -> float:
        return 1 + sum(p**k for k in range(1, block_size))

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < mean_acceptance else (lo, mid)
    p = lo
    rng = np.random.default_rng(seed)

    def correct_prefix(cycle: int) -> Optional[int]:
        run = 0
        while run < block_size - 1 and rng.random() < p:
            run += 1
        return None if run == block_size - 1 else run

    return correct_prefix
