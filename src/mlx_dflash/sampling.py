"""Lossless sampling for DFlash: speculative accept/reject on the draft's distribution.

The draft drafts every block position in one pass, so each position k has its own
distribution q_k (after the same logits processors, top-k/top-p/min-p filters and
temperature as the target's p_k; the filters are mlx-lm's own). Token d_k is kept
with probability min(1, p_k(d_k) / q_k(d_k)); at the first rejection the bonus token
is drawn from normalize(max(0, p_k - q_k)); when all are kept, from the next p. The
emitted tokens are then distributed exactly as the target's own sampling.

``accept="match"`` is the scheme of earlier MLX engines, kept for comparison: greedy
drafts accepted only when equal to a token sampled from p (also exact, but it
accepts less). Temperature 0 is plain greedy verification.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import DFlashError

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
MAX_SEED = 2**64 - 1


class Draws:
    """One generation's random stream: MLX keys split off its own key, one per draw, from its
    seed (or from Python's ``random``). Not MLX's global random state: generations that run in
    turns (the server's) would draw from each other's, and used from worker threads it aborted
    the process at exit."""

    def __init__(self, seed: Optional[int] = None) -> None:
        self.key = mx.random.key(random.getrandbits(63) if seed is None else seed)

    def next(self) -> mx.array:
        self.key, key = mx.random.split(self.key)
        return key


@dataclass
class SamplingParams:
    """mlx-lm's names: temp, top_p, top_k, min_p, min_tokens_to_keep; plus a seed."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: Optional[int] = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    accept: str = "speculative"  # or "match"
    draws: Optional[Draws] = field(default=None, repr=False, compare=False)  # a generation's (``drawing``)

    def __post_init__(self) -> None:
        # (written as "not in range" so that NaN fails too)
        if not 0 <= self.temp <= 100:
            raise DFlashError(f"temperature must be in [0, 100], got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise DFlashError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.top_k or not 0 <= self.min_p <= 1:
            raise DFlashError(f"top_k must be >= 0 and min_p in [0, 1], got {self.top_k}, {self.min_p}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise DFlashError(f"seed must be in 0..{MAX_SEED} (MLX's random seed is 64-bit unsigned), got {self.seed}")
        if self.accept not in ("speculative", "match"):
            raise DFlashError(f"accept must be 'speculative' or 'match', got {self.accept!r}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def drawing(self, seed: Optional[int] = None) -> "SamplingParams":
        """These parameters with a random stream of their own (one per generation), from
        ``seed``, else their own seed, else a fresh one."""
        return replace(self, draws=Draws(self.seed if seed is None else seed))

    def key(self) -> mx.array:
        """A fresh key of this generation's stream (``drawing``)."""
        if self.draws is None:
            raise RuntimeError("sampling parameters draw only within a generation (SamplingParams.drawing)")
        return self.draws.next()

    def process(self, logits: mx.array, history: mx.array, block: mx.array) -> mx.array:
        """Apply the logits processors row by row; row j sees history + block[:j + 1]."""
        if not self.logits_processors:
            return logits
        rows = [self.process_row(logits[j : j + 1], mx.concatenate([history, block[: j + 1]]))
                for j in range(logits.shape[0])]
        return mx.concatenate(rows, axis=0)

    def process_row(self, row: mx.array, tokens: mx.array) -> mx.array:
        for processor in self.logits_processors:
            row = processor(tokens, row)
        return row

    def probabilities(self, logits: mx.array) -> mx.array:
        """The sampling distribution mlx-lm's sampler draws from (filters, then temperature)."""
        logprobs = logits.astype(mx.float32)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs / self.temp, axis=-1)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    return mx.random.categorical(mx.log(probs), key=key).astype(mx.uint32)


def matching_prefix(drafted: mx.array, choice: mx.array) -> mx.array:
    """a = how many drafted tokens equal the target's choice at the slot before them ([1])."""
    return mx.cumprod((drafted == choice[:-1]).astype(mx.int32)).sum(keepdims=True)


def first_token(params: Optional[SamplingParams], logits: mx.array, prompt: mx.array) -> mx.array:
    """The token after the prompt ([1]) from the prefill's last logits [1, V]."""
    if params is not None:
        logits = params.process_row(logits, prompt)
    if params is None or params.greedy:
        return mx.argmax(logits[0], keepdims=True).astype(mx.uint32)
    return sample(params.probabilities(logits), params.key())


def draft_tokens(params: SamplingParams, logits: mx.array, history: mx.array, first: mx.array) -> tuple:
    """Drafted tokens [n] and their distributions q [n, V] (None when drafted greedily)."""
    if params.greedy or params.accept == "match":
        # greedy drafts see history + first only (not each other): that can only change what is
        # proposed, never what is emitted, since verification processes the real block
        processed = params.process(logits, history, first)
        return mx.argmax(processed, axis=-1).astype(mx.uint32), None
    if not params.logits_processors:  # every position at once
        q = params.probabilities(logits)
        return sample(q, params.key()), q
    drafted, qs = [], []  # processors see the drafted prefix: sample position by position
    for j in range(logits.shape[0]):
        q = params.probabilities(params.process_row(logits[j : j + 1], mx.concatenate([history, first, *drafted])))
        qs.append(q)
        drafted.append(sample(q, params.key()))
    return mx.concatenate(drafted), mx.concatenate(qs, axis=0)


def sample_drafts(params: SamplingParams, proposer, first: mx.array, n: int, history: Optional[mx.array],
                  vocab_size: int) -> tuple[mx.array, Optional[mx.array]]:
    """``n`` drafted tokens after ``first`` and their distributions q [n, V] (None: drafted
    greedily). A proposer without distributions (a replay) is certain: its q is one-hot."""
    if n == 0:
        return first[:0], None
    if getattr(proposer, "selects", False) and not params.greedy and params.accept == "speculative":
        return proposer.sample(first, n, params.temp, params.key())  # a DFlash2 draft samples through its selector
    if hasattr(proposer, "draft_logits"):
        return draft_tokens(params, proposer.draft_logits(first, n), history, first)
    drafted = proposer.propose(first, n).astype(mx.uint32)
    if params.greedy or params.accept == "match":
        return drafted, None
    return drafted, (mx.arange(vocab_size)[None] == drafted[:, None]).astype(mx.float32)


def verify(params: Optional[SamplingParams], logits: mx.array, history: Optional[mx.array], block: mx.array,
           drafted: mx.array, q: Optional[mx.array]) -> tuple[mx.array, mx.array]:
    """(tokens [bs], a): the first a + 1 tokens are committed (a accepted drafts + bonus).
    ``params=None`` is plain greedy: the target's own choice after each slot."""
    processed = logits if params is None else params.process(logits, history, block)
    if params is None or params.greedy:
        choice = mx.argmax(processed, axis=-1)
        return choice, matching_prefix(drafted, choice)
    p = params.probabilities(processed)
    if q is None:  # exact match against a sample of the target
        choice = sample(p, params.key())
        return choice, matching_prefix(drafted, choice)
    return speculative_accept(p, q, drafted, params.key())


def node_choices(params: Optional[SamplingParams], logits: mx.array) -> mx.array:
    """The target's own choice after each node of a tree [n]: its argmax, or a sample of its
    distribution (every kept token is then the target's own draw: no rejection sampling)."""
    if params is None or params.greedy:
        return mx.argmax(logits, axis=-1)
    return sample(params.probabilities(logits), params.key())


def speculative_accept(p: mx.array, q: mx.array, drafted: mx.array, key: mx.array,
                       uniform: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """Standard speculative sampling over one block, entirely on the device.

    p [bs, V]: target distributions (row j predicts the token after block position j);
    q [bs-1, V]: draft distributions of drafted [bs-1] (drafted[j] follows position j).
    ``key``: the draws' key; ``uniform`` [bs-1]: the acceptance draws in [0, 1) (default: from ``key``).
    Returns (tokens [bs], a): drafted[:a] then the bonus token at index a.
    """
    n = drafted.shape[0]
    rows = mx.arange(n)
    p_d = p[rows, drafted] if n else mx.zeros((0,))
    q_d = q[rows, drafted] if n else mx.zeros((0,))
    uniform_key, bonus_key = mx.random.split(key)
    u = mx.random.uniform(shape=(n,), key=uniform_key) if uniform is None else uniform
    keep = u * q_d < p_d  # u < p/q without dividing by zero
    a = mx.cumprod(keep.astype(mx.int32)).sum(keepdims=True)
    residual = mx.maximum(p[:n] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:n])  # p == q: never rejected
    bonus_if = sample(mx.concatenate([residual, p[n:]], axis=0), bonus_key)  # [bs]: the bonus if a == j
    tokens = mx.where(mx.arange(n + 1) == a, bonus_if, mx.concatenate([drafted, bonus_if[:1]]))
    return tokens, a
