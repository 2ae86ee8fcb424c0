"""A proposer that replays a known continuation with mistakes at chosen places.

It needs no trained weights: tests use it to force every acceptance length,
and the benchmark's scale mode uses it to time the engine at real model sizes
with a chosen acceptance distribution (results labelled "replay").
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from .target import Target

# cycle index -> how many drafted tokens are right before the first wrong one (None: all right)
Schedule = Union[Sequence[Optional[int]], Callable[[int], Optional[int]]]


class ReplayProposer:
    def __init__(self, reference: Sequence[int], block_size: int, schedule: Schedule, vocab_size: int):
        """``reference`` is the full token sequence (prompt + the target's greedy continuation)."""
        self.reference = list(reference)
        self.block_size = block_size
        self.schedule = schedule
        self.vocab_size = vocab_size
        self.layer_ids: list[int] = []  # replay needs no target features

    def start(self, target: Target) -> None:
        self.position = 0  # committed tokens so far
        self.cycle = 0

    def add_context(self, features: mx.array) -> None:
        self.position += features.shape[1]

    def correct_prefix(self, cycle: int) -> Optional[int]:
        if callable(self.schedule):
            return self.schedule(cycle)
        return self.schedule[cycle % len(self.schedule)]

    def propose(self, first_token: mx.array, num_tokens: int) -> mx.array:
        # block slot k (1..) predicts the token at position `position + k`
        start = self.position + 1
        tokens = self.reference[start : start + num_tokens]
        tokens += [0] * (num_tokens - len(tokens))
        wrong_at = self.correct_prefix(self.cycle)
        self.cycle += 1
        if wrong_at is not None and wrong_at < num_tokens:
            tokens[wrong_at] = (tokens[wrong_at] + 1) % self.vocab_size
        return mx.array(tokens, dtype=mx.uint32)
