"""Warm-up: run every path a generation can take once, before the first one is timed.

MLX's CUDA backend compiles each kernel the first time it meets it (tens of kernels for a
DFlash pair, seconds each) and keeps them on disk (``MLX_PTX_CACHE_DIR``, by default
``<temp dir>/mlx/<version>/ptx``); a fresh process still loads them, traces the compiled blocks
and captures their graphs on first use. Without a warm-up all of that lands in the first
generation. A kernel's identity depends on the graph (fused ops, dtypes), not on its sizes, so
one short run of each path suffices: every block size the adaptive policy picks, a plain step
with and without a forecast, forecasts after runs of plain steps (their deferred contexts in
each padded row count: new row counts are new matmul shapes), blocks queued behind blocks, a context long enough that block
attention leaves our CUDA kernel for MLX's (``cuda_attention.MAX_HEADS_TIMES_KEYS``), and
temperature sampling. The warm-up uses caches of its own: no output token depends on it.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .cuda_attention import MAX_HEADS_TIMES_KEYS
from .device import on_cuda
from .draft import DFlashDraft
from .engine import decode_cycles
from .options import DEFAULT_OPTIONS, EngineOptions
from .policy import BlockPolicy, candidate_sizes
from .proposer import MAX_SINGLE_ROWS, Proposer, single_rows
from .sampling import SamplingParams
from .target import Target, context_length

if TYPE_CHECKING:
    from .batch import BatchDecoder

SHORT_PROMPT = 16
REPEATS = 3  # cycles of each size: the first after a read count, then queued behind its own size


class ScriptedSizes:
    """Stands in for ``BlockPolicy``: picks the sizes of ``script`` in turn (1 after it ends);
    a plain step marked 0 carries a forecast; a tree (past ``block_size``) a full block where
    trees cannot run. Passes what each cycle cost on to ``teaches``."""

    def __init__(self, script: list[int], block_size: int, teaches: Optional[BlockPolicy] = None):
        self.script, self.wants_forecast, self.teaches = list(script), False, teaches
        self.block_size, self.sizes = block_size, sorted(set(script))

    def choose(self, limit: Optional[int] = None, trees: bool = True) -> int:
        size = self.script.pop(0) if self.script else 1
        self.wants_forecast = size == 0
        if size > self.block_size and not trees:
            size = self.block_size
        return max(min(size, limit or size), 1)

    def record_cycle(self, block: int, committed: list[int], seconds: Optional[float],
                     guess: Optional[list[int]]) -> None:
        if self.teaches is not None:
            self.teaches.record_cycle(block, committed, seconds, guess)


def adaptive_script(block_size: int, tree_budgets: Sequence[int] = ()) -> list[int]:
    """Each candidate size (trees too), largest first, ``REPEATS`` times; plain steps with a
    forecast and without; then a block again right after plain steps."""
    sizes = [size for size in reversed(candidate_sizes(block_size, tree_budgets)) if size > 1]
    forecast = [0] if block_size > 1 else []  # (blocks of one draft nothing: no forecast either)
    return [size for size in sizes for _ in range(REPEATS)] + forecast + [1, 1, block_size, block_size]


def long_prompt_length(target: Target, proposer: Proposer) -> int:
    """A context past which every block's attention (the target's and the draft's) takes MLX's
    kernels instead of ours (0: no such switch on this backend)."""
    if not on_cuda():
        return 0
    heads = [target.args.num_attention_heads]
    draft = getattr(proposer, "draft", None)
    if draft is not None:
        heads.append(draft.config.num_attention_heads)
    return MAX_HEADS_TIMES_KEYS // min(heads) + 1


def run_path(target: Target, proposer: Proposer, prompt_length: int, block_size: int,
             sampling: Optional[SamplingParams] = None, script: Optional[list[int]] = None,
             teaches: Optional[BlockPolicy] = None, tree_budget: Optional[int] = None) -> list[int]:
    """Decode after a made-up prompt: ``REPEATS`` blocks of ``block_size`` (trees of
    ``tree_budget``), or the sizes of ``script`` (see ``ScriptedSizes``); returns the sizes of the cycles run."""
    prompt = (mx.arange(prompt_length) * 7919 + 11) % target.vocab_size  # any ids will do
    policy = ScriptedSizes(script, block_size, teaches) if script is not None else None
    cycles = len(script) if script is not None else REPEATS
    max_tokens = 1 + (cycles + 1) * max([block_size, *(script or [])])  # (never the limit: the script's sizes stay whole)
    stream = decode_cycles(target, proposer, prompt.astype(mx.uint32), max_tokens, block_size, sampling, policy,
                           tree_budget=tree_budget)
    return [cycle.block_size for cycle in itertools.islice(stream, cycles + 1)][1:]  # (after the prefill's token)


def run_deferred_contexts(target: Target, proposer: Proposer, block_size: int) -> None:
    """Runs of plain steps, then a draft: the single-token contexts they deferred are stored in
    each padded row count (``proposer.single_rows``) and the draft pass reads a context that
    grows past a few 256-position buffers, as forecasts after plain steps do."""
    prompt = (mx.arange(SHORT_PROMPT) * 7919 + 11).astype(mx.uint32) % target.vocab_size
    proposer.start(target)
    _, features = target(prompt[None], target.make_cache(), prompt=True)
    proposer.add_context(features)
    for rows in sorted({single_rows(n) for n in range(1, MAX_SINGLE_ROWS + 1)}):
        for _ in range(rows):
            proposer.add_context(features[:, :1])
        mx.eval(proposer.propose(prompt[:1], block_size - 1))


def warm_up_batch(decoder: "BatchDecoder") -> None:
    """A few cycles of a two-row batch (rows of two lengths, one leaving before the other), as
    the server runs its batch: on a GPU its kernels are then built before the first request.
    Its policy learns the costs; nothing goes into its prefix cache."""
    kept, decoder.prefix_cache = decoder.prefix_cache, None
    try:
        for length, max_tokens in ((SHORT_PROMPT, 3 * decoder.block_size), (SHORT_PROMPT // 2, decoder.block_size)):
            decoder.add((mx.arange(length) * 7919 + 11).astype(mx.uint32) % decoder.target.vocab_size, max_tokens)
        while decoder.rows:
            decoder.step()
    finally:
        decoder.prefix_cache = kept


def warm_up(model: nn.Module, draft: Union[DFlashDraft, Proposer], block_size: Optional[int] = None,
            options: EngineOptions = DEFAULT_OPTIONS, sampling: bool = True,
            policy: Optional[BlockPolicy] = None, tree_budget: Optional[int] = None) -> float:
    """Run each path of a generation with ``draft`` once (``sampling``: temperature sampling
    too; the ``policy``'s trees, or fixed blocks' trees of ``tree_budget``); returns the seconds it
    took. A ``policy`` then learns what each block size costs,
    from a second pass over them (its kernels built by the first): its first text need not
    spend full blocks on learning them, which a useless draft pays for."""
    from .generate import make_proposer

    tic = time.perf_counter()
    target, proposer = make_proposer(model, draft, options)
    block_size = block_size or proposer.block_size
    trees = [size - 1 for size in policy.sizes if size > block_size] if policy is not None else []
    room = (context_length(model) or 1 << 30) - 1
    short = min(SHORT_PROMPT, room // 2)
    run_path(target, proposer, short, block_size, script=adaptive_script(block_size, trees))
    run_path(target, proposer, short, block_size)  # fixed blocks
    if tree_budget:
        run_path(target, proposer, short, block_size, tree_budget=tree_budget)  # fixed blocks' trees
    run_path(target, proposer, short, 1)  # plain steps, no policy
    if block_size > 1:
        run_deferred_contexts(target, proposer, block_size)
    longest = long_prompt_length(target, proposer)
    long_trees = [1 + budget for budget in trees]  # (a tree's verify switches kernels there too: its own shapes)
    if longest and longest + 2 * max([block_size, *long_trees, 1 + (tree_budget or 0)]) < room:
        run_path(target, proposer, longest, block_size, script=[block_size, block_size, 0, 1, block_size, *long_trees])
        if tree_budget:
            run_path(target, proposer, longest, block_size, tree_budget=tree_budget)
    if sampling and hasattr(proposer, "draft_logits"):
        temperature = SamplingParams(temp=1.0)
        run_path(target, proposer, short, block_size, sampling=temperature)
        run_path(target, proposer, short, 1, sampling=temperature)
    if policy is not None:
        run_path(target, proposer, short, block_size, script=adaptive_script(block_size, trees), teaches=policy)
    mx.synchronize()
    return time.perf_counter() - tic
