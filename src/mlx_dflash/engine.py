"""The DFlash decode cycle: draft, verify, accept, roll back, commit.

Read ``decode_cycles`` top to bottom: it is the whole algorithm. The pieces it calls:
``BlockRunner.launch`` drafts and verifies one block (lazily: queued on the device),
``BlockRunner.keep`` rolls the caches back to the accepted prefix, ``sampling.py`` decides
what is accepted when sampling, and ``policy.py`` picks each block's size from measured speed.

One device-to-host read per cycle: the target's choices (which also give the accept count); a
tree (``tree.py``) adds one, of the draft's top candidates, to build it on the host, except where
cycles are queued ahead: there trees are built, walked and rolled back on the device too.
Where every cache of the target can be cut by a count still on the device (KV and Gated
DeltaNet caches), greedy decoding rolls back, extends the draft's context and picks the next
block's first token on the device, and queues the next cycle before it reads this one's count
(``EngineOptions.queue_ahead``): the host builds a cycle's graph while the device runs the
previous one, as mlx-lm's own decode loop does for single tokens; the first block is queued
behind the prefill (``first_block``).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .distributed import from_rank_zero, shared_seed
from .errors import DFlashError
from .policy import BlockPolicy, CycleClock
from .prefix_cache import PrefixCache
from .proposer import Proposer
from .sampling import SamplingParams, first_token, node_choices, sample_drafts, verify
from .target import Target
from .tree import DEVICE_RANKS, DraftTree, device_candidates, device_tree, draft_tree

ProgressCallback = Callable[[int, int], None]  # (prompt tokens processed, prompt tokens)


@dataclass
class Cycle:
    """Tokens committed by one step: the prefill's first token, or a verified block."""

    tokens: list[int]
    acceptance_length: Optional[int]  # a + 1 for a verify cycle; None for the prefill token
    block_size: int = 0  # tokens verified (1: a plain step); 0 for the prefill token
    launch_seconds: float = 0.0  # host time spent building and queueing the cycle's graphs
    reused_prompt_tokens: int = 0  # the prefill's: prompt tokens restored from a prefix cache


@dataclass
class Block:
    """One launched cycle, still on the device: a verified block, or a plain step."""

    tokens: mx.array  # the target's choice after each slot: accepted drafts, then the bonus token
    accepted: Optional[mx.array]  # how many drafts were accepted ([1]); None: a plain greedy step keeps its token
    features: mx.array  # the tapped target features of the block, the draft's next context
    guess: Optional[mx.array]  # drafts past the verified ones, for the policy to check (policy.py)
    launch_seconds: float  # host time spent building and queueing it
    tree: Optional[DraftTree] = None  # a tree's verify: ``tokens`` is the target's choice after each node
    path: Optional[list[int]] = None  # the tree's accepted nodes, once walked
    # A tree walked on the device: its nodes, the accepted path first (``tokens``, ``features``
    # and ``accepted`` then read as a chain's: the path's drafts, then the bonus token).
    order: Optional[mx.array] = None

    @property
    def size(self) -> int:
        return self.tokens.size


def prefill(target: Target, proposer: Proposer, prompt: mx.array, cache: list[Any], step: int,
            progress: Optional[ProgressCallback] = None, prefix_cache: Optional[PrefixCache] = None
            ) -> tuple[mx.array, int]:
    """Run the prompt through the target as mlx-lm's ``generate_step`` does: all but its last
    token in chunks of ``step``, then the last token alone; return that token's logits. (The
    same calls give the same kernels: a token's logits from a one-row pass and from the last
    row of a chunk differ in their last bits, enough to flip a bf16 near-tie on a GPU.)
    A ``prefix_cache`` first restores the longest stored start of the prompt, and keeps the
    state before the last token for later prompts where the caches cannot be cut back (key/value
    caches are kept with the reply, at the end: ``decode_cycles``); also returns how many tokens
    it restored. After a restore into key/value caches the rest (its last chunk and the last
    token together) runs as one block, with the verify's attention: the restored keys and values
    already differ from a cold prefill's in their last bits (a reply's came from verifies), and one
    pass instead of a chunk and a step is most of what a chat's next turn waits for."""
    ids = prompt.tolist()  # (checked on the host: a device read would wait for work queued before, a batch's cycle)
    if (highest := max(ids)) >= target.vocab_size:  # (past the embedding table: a read outside it)
        raise DFlashError(f"the prompt holds token id {highest}, outside the target's vocabulary "
                          f"(0..{target.vocab_size - 1})")
    head = ids[:-1] if prefix_cache is not None else []
    reused = prefix_cache.resume(target, proposer, cache, head) if prefix_cache is not None else 0
    rest = prompt.size - 1 - reused  # tokens before the last still to run
    as_block = reused > 0 and rest > 0 and all(isinstance(c, KVCache) for c in cache)
    last_chunk = (rest - 1) % step + 1 if as_block else 0  # (run with the last token)
    tail = 1 + last_chunk  # tokens run in the last pass
    for start in range(reused, prompt.size - tail, step):
        end = min(start + step, prompt.size - tail)
        _, features = target(prompt[None, start:end], cache, prompt=True)
        proposer.add_context(features)
        # (the draft's context is prompt work; the last chunk is not waited for: the last pass queues behind it)
        (mx.async_eval if end == prompt.size - tail else mx.eval)([c.state for c in cache], proposer.state)
        if progress is not None:
            progress(end, prompt.size)
    if prefix_cache is not None and reused < len(head):
        prefix_cache.store_prompt(target, proposer, cache, head)
    logits, features = target(prompt[None, -tail:], cache, eager=True)
    proposer.add_context(features)
    return logits[0, -1], reused


class BlockRunner:
    """Drafts and verifies blocks against one target cache, and rolls it back."""

    def __init__(self, target: Target, proposer: Proposer, cache: list[Any], block_size: int,
                 sampling: Optional[SamplingParams], policy: Optional[BlockPolicy], history: list[int],
                 tree_budget: Optional[int] = None):
        self.target, self.proposer, self.cache = target, proposer, cache
        self.block_size, self.sampling, self.policy = block_size, sampling, policy
        self.history = history  # committed tokens before the current block (logits processors read it)
        self.clock = CycleClock()
        processors = sampling is not None and bool(sampling.logits_processors)
        # Plain steps need no accept count to pick their next input, so the next one can be queued
        # before this one is read; blocks too where the target rolls back by a count on the device
        # (greedy only: sampling reads its random draws' outcome on the host). Not with logits
        # processors, which read the history on the host.
        self.queue_steps = not processors
        self.queue_blocks = sampling is None and target.rolls_back_on_device and target.options.queue_ahead
        # Trees (a policy's sizes past the block, or fixed blocks' trees of any budget: tree.py) where the
        # target, the proposer and the sampling allow them; built on the device and queued ahead as
        # blocks are, where blocks are.
        self.trees = target.verifies_trees and hasattr(proposer, "candidate_logits") and not processors and block_size > 1
        self.tree_budget = tree_budget if self.trees and policy is None else None  # (fixed blocks' trees)
        self.trees_on_device = self.trees and self.queue_blocks and target.builds_trees_on_device

    def tree_on_device(self, budget: int) -> bool:
        """Whether a tree of ``budget`` nodes is built and walked on the device."""
        return self.trees_on_device and budget <= device_candidates(self.block_size - 1, DEVICE_RANKS)

    def is_tree(self, size: int) -> bool:
        """Whether a cycle of ``size`` verifies a tree: a policy's past the block, or fixed trees."""
        return size > self.block_size or size > 1 and self.tree_budget is not None

    def queues(self, size: int) -> bool:
        """Whether a cycle of ``size`` can be queued before the current one's count is read."""
        return size == 1 or self.queue_blocks and (not self.is_tree(size) or self.tree_on_device(size - 1))

    def next_size(self, wanted: int) -> tuple[int, bool]:
        """The next block's size (at most ``wanted`` tokens) and whether it carries a forecast."""
        if self.policy is None:
            if self.tree_budget is not None and wanted > 1:  # (a generation's end cuts what it commits)
                return 1 + self.tree_budget, False
            return min(self.block_size, wanted), False
        return self.policy.choose(limit=wanted, trees=self.trees), self.policy.wants_forecast

    def launch(self, first: mx.array, size: int, forecast: bool = False) -> Block:
        """Draft ``size - 1`` tokens after ``first`` and verify the block in one target pass, lazily
        (queued on the device); a tree (``is_tree``) has ``size - 1`` nodes. With a
        policy a short greedy block drafts one token more, and with ``forecast`` a plain step
        drafts a full block beside it: guesses for the policy."""
        tic = time.perf_counter()
        n, guess, accepted = size - 1, None, None
        if self.is_tree(size):
            return self._launch_device_tree(first, n, tic) if self.tree_on_device(n) else self._launch_tree(first, n, tic)
        if n == 0 and self.sampling is None:  # a plain greedy step, in as few ops as mlx-lm's
            logits, features = self.target(first[None], self.cache)
            tokens = mx.argmax(logits[0], axis=-1)
        else:
            history = self._history()
            drafted, q, guess = self._draft(first, n, history)
            block = mx.concatenate([first, drafted])
            logits, features = self.target(block[None], self.cache)
            tokens, accepted = verify(self.sampling, logits[0], history, block, drafted, q)
        if forecast:
            guess = self.proposer.propose(first, self.block_size - 1)
        mx.async_eval(tokens, features, *(x for x in (accepted, guess) if x is not None))
        seconds = time.perf_counter() - tic
        self.clock.add_launch(seconds)
        return Block(tokens, accepted, features, guess, seconds)

    def _launch_tree(self, first: mx.array, budget: int, tic: float) -> Block:
        """Draft a full block's slots after ``first``, grow the tree of ``budget`` nodes from
        their distributions (the host reads each slot's top candidates), verify it in one pass."""
        logits, columns = self.proposer.candidate_logits(first, self.block_size - 1)
        tree = draft_tree(first.item(), logits, budget, columns)
        logits, features = self.target.verify_tree(tree, self.cache)
        choices = node_choices(self.sampling, logits[0])
        mx.async_eval(choices, features)
        seconds = time.perf_counter() - tic
        self.clock.add_launch(seconds)
        return Block(choices, None, features, None, seconds, tree=tree)

    def _launch_device_tree(self, first: mx.array, budget: int, tic: float) -> Block:
        """``_launch_tree`` without a host read (greedy): the tree built and walked on the device,
        its nodes reordered with the accepted path first."""
        logits, columns = self.proposer.candidate_logits(first, self.block_size - 1)
        tree = device_tree(first, logits, budget, columns)
        logits, features = self.target.verify_device_tree(tree, self.cache)
        choices = mx.argmax(logits[0], axis=-1)
        order, accepted = tree.walk(choices)
        tokens, features = choices[order], features[:, order]
        mx.async_eval(tokens, accepted, features)
        seconds = time.perf_counter() - tic
        self.clock.add_launch(seconds)
        return Block(tokens, accepted, features, None, seconds, order=order)

    def read(self, block: Block) -> list[int]:
        """The cycle's one device-to-host read: the committed tokens, accepted drafts then the
        bonus token (a tree's: walked on the host along the target's choices)."""
        if block.tree is not None:
            block.path, bonus = block.tree.walk(block.tokens.tolist())
            return [block.tree.tokens[node] for node in block.path[1:]] + [bonus]
        a = 0 if block.accepted is None else block.accepted.item()
        return block.tokens.tolist()[: a + 1]

    def _draft(self, first: mx.array, n: int, history: Optional[mx.array]
               ) -> tuple[mx.array, Optional[mx.array], Optional[mx.array]]:
        """(drafted tokens, their distributions q or None, guesses past them or None)."""
        if self.sampling is not None:
            return (*sample_drafts(self.sampling, self.proposer, first, n, history, self.target.vocab_size), None)
        peek = self.policy is not None and n + 1 < self.block_size  # one slot past a short block
        drafted = self.proposer.propose(first, n + peek).astype(mx.uint32)
        return drafted[:n], None, drafted[n:] if peek else None

    def _history(self) -> Optional[mx.array]:
        """The committed tokens as an array, where logits processors read them."""
        if self.sampling is None or not self.sampling.logits_processors:
            return None
        return mx.array(self.history, dtype=mx.uint32)

    def keep(self, block: Block, a: Union[int, mx.array]) -> mx.array:
        """Roll back to ``a`` accepted drafts (read, or still on the device): drop the rejected
        drafts from the caches (the bonus is not cached yet), add the kept tokens' context;
        return the next block's first token, the bonus ([1])."""
        if block.tree is not None:  # the walked path's nodes, moved together
            self.target.keep_path(self.cache, block.path, block.size)
            self.proposer.add_context(block.features[:, mx.array(block.path)])
            return block.tokens[block.path[-1] : block.path[-1] + 1]
        if block.accepted is None:  # a plain greedy step keeps its token
            self.proposer.add_context(block.features)
            return block.tokens
        if block.order is not None:  # a tree walked on the device: its path moved first, then cut as a chain
            self.target.move_path(self.cache, block.order, self.block_size)
        self.target.rollback(self.cache, block.size - 1 - a)
        self.proposer.add_context(block.features, a + 1)
        return block.tokens[a : a + 1] if isinstance(a, int) else block.tokens[a.reshape(1)]

    def settle(self, in_context: int, queued: Optional[Block]) -> None:
        """The count is read: with blocks queued ahead, attention and the draft read no further
        than the ``in_context`` committed tokens (and a block queued since)."""
        if not self.queue_blocks:
            return
        exact = queued is None or queued.accepted is None  # (a queued plain step keeps its token)
        self.target.settle(self.cache, in_context + (queued.size if queued is not None else 0), exact)
        self.proposer.settle(in_context)

    def hand_over(self, cycle: Cycle) -> Iterator[Cycle]:
        """Give ``cycle`` to the caller: the time it keeps it is not the next cycle's cost."""
        self.clock.pause()
        yield cycle
        self.clock.resume()

    def record(self, block: Block, committed: list[int]) -> None:
        """The policy learns the cycle's cost and acceptance (and checks its guesses)."""
        if self.policy is not None:
            seconds = self.clock.cycle_seconds(block.launch_seconds)
            if self.target.group is not None:  # a sharded target: every process decides on process 0's clock
                seconds = from_rank_zero(seconds, self.target.group)
            guess = block.guess.tolist() if block.guess is not None else None
            self.policy.record_cycle(block.size, committed, seconds, guess)


def first_block(runner: BlockRunner, first: mx.array, max_tokens: int) -> Optional[Block]:
    """The first block, queued behind the prefill before its first token is read, where blocks
    queue ahead, as mlx-lm queues its second step before reading its first token: decoding then
    starts with a cycle in flight (its graph built before the first token, not after it). None
    elsewhere: launched after the read."""
    if not runner.queue_blocks or max_tokens < 2:
        return None
    mx.async_eval(first)  # (so that reading it waits for the prefill, not for the block too)
    return runner.launch(first, *runner.next_size(max_tokens - 1))


def decode_cycles(
    target: Target,
    proposer: Proposer,
    prompt: mx.array,
    max_tokens: int,
    block_size: int,
    sampling: Optional[SamplingParams] = None,
    policy: Optional[BlockPolicy] = None,
    prompt_progress: Optional[ProgressCallback] = None,
    tree_budget: Optional[int] = None,
    prefix_cache: Optional[PrefixCache] = None,
) -> Iterator[Cycle]:
    """DFlash decoding; yields committed tokens cycle by cycle, at most ``max_tokens``.

    ``sampling=None`` is plain greedy; otherwise see ``sampling.py`` (lossless sampling).
    ``policy`` picks each cycle's block size (up to ``block_size``) from measured speed.
    ``tree_budget``: verify trees of that many drafted nodes instead of chains (``tree.py``).
    ``prefix_cache``: prefill only what follows the longest stored start of the prompt.
    """
    cache = target.make_cache()
    proposer.start(target)
    if sampling is not None:  # (a random stream of its own; a sharded target's: every process draws alike)
        shared = target.group is not None and sampling.seed is None
        sampling = sampling.drawing(shared_seed(target.group) if shared else None)
    logits, reused = prefill(target, proposer, prompt, cache, target.options.prefill_step, prompt_progress,
                             prefix_cache)
    first = first_token(sampling, logits[None], prompt)  # [1]
    runner = BlockRunner(target, proposer, cache, block_size, sampling, policy, prompt.tolist(), tree_budget)
    block = first_block(runner, first, max_tokens)
    latest, emitted = first.item(), 1
    runner.clock.restart()  # (the first cycle's window starts at this read, as later ones do)
    exact = block is None  # whether the caches hold just the committed tokens (but the latest)
    try:
        yield from runner.hand_over(Cycle([latest], None, reused_prompt_tokens=reused))
        if block is None and emitted < max_tokens:
            block, exact = runner.launch(first, *runner.next_size(max_tokens - emitted)), False
        while block is not None:
            # Roll back before the read where the device knows the count, and queue the next cycle.
            queued = choice = None
            on_device = block.tree is None and (block.size == 1 or runner.queue_blocks)
            if on_device:
                first = runner.keep(block, 0 if block.size == 1 else block.accepted[0])
                if (runner.queue_blocks or runner.queue_steps) and emitted + 1 < max_tokens:
                    choice = runner.next_size(max_tokens - emitted - 1)
                    queued = runner.launch(first, *choice) if runner.queues(choice[0]) else None
            # Accept: the cycle's one device-to-host read. (Sliced on the host: reading a slice would
            # wait for everything queued before it, the next cycle included.)
            committed = runner.read(block)
            a = len(committed) - 1
            runner.record(block, committed)
            if not on_device:  # roll back by the count just read
                first = runner.keep(block, a)
            # Commit (a block queued ahead may pass the end).
            committed = committed[: max_tokens - emitted]
            runner.history += [latest] + committed[:-1]
            emitted, latest = emitted + len(committed), committed[-1]
            runner.settle(prompt.size + emitted - 1, queued)  # (every committed token but the latest is in context)
            cycle = Cycle(committed, min(a + 1, len(committed)), block.size, block.launch_seconds)
            if emitted >= max_tokens:
                block, exact = None, queued is None and len(committed) == a + 1
            else:
                block, exact = queued or runner.launch(first, *(choice or runner.next_size(max_tokens - emitted))), False
            yield from runner.hand_over(cycle)
    finally:  # (also when the caller stops early: a stop string, a client gone; not after an error)
        if prefix_cache is not None and sys.exc_info()[0] in (None, GeneratorExit):
            prefix_cache.store(target, proposer, cache, runner.history, exact)
