"""Continuous batching: many sequences decoded together, one draft pass and ONE target
forward per cycle for all of them.

Rows join (their prompt prefilled alone, then merged in) and leave between cycles. A cycle:
draft a block for every row, verify the blocks as one [rows, block] batch, accept per row,
roll each row back to its own accepted prefix, commit; on GPUs the next cycle is queued before
this one is read, as in the engine, and the batch keeps a power-of-two number of rows, a
finished row's slot idle until a new row takes it (``EngineOptions.pad_rows``); with
``EngineOptions.join_behind`` a row that joins while a cycle is queued is prefilled behind it,
its first token read after it, and merged into the cycle queued after that one, so the device
does not wait for the host's join (otherwise the queued cycle is read first). Each row keeps
its own length in the caches (``batch_cache.py``), so rows that accepted different counts are
cut back each by its own and the verify runs compiled where the engine's does; targets with
sliding-window layers keep mlx-lm's left-padded batch caches (eager).

Greedy rows and sampled ones (temperature, top-p, top-k, min-p; lossless speculative sampling
per row, ``sampling.py``); one block size for all rows a cycle (fixed, or a ``BlockPolicy``'s); every
target family the engine supports (hybrids: each row's recurrent state rewound to its own
prefix, ``delta_rule.py``) and every draft (v1, and DFlash2, whose selector walks every row's
slots at once; sliding-window layers masked per row). A draft's context window limits what its
passes see, not what the batch stores.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .batch_cache import BatchCache, BatchContext, RowsKVCache, cut_rows, joined, row_cache
from .draft import DFlashDraft
from .engine import prefill
from .errors import DFlashError
from .options import DEFAULT_OPTIONS, EngineOptions
from .policy import BlockPolicy, CycleClock, check_block_size
from .prefix_cache import PrefixCache
from .proposer import greedy_head
from .sampling import SamplingParams, draft_tokens, first_token, verify
from .target import Target, check_compatible


@dataclass
class Row:
    """One sequence in the batch."""

    id: int
    prompt: list[int]
    max_tokens: int
    first: int  # the next block's first token (committed, not yet in the caches)
    length: int  # positions in the caches
    tokens: list[int] = field(default_factory=list)  # committed so far (the prefill's token first)
    reused_prompt_tokens: int = 0  # restored from the prefix cache instead of prefilled
    params: Optional[SamplingParams] = None  # how it samples (None: greedy)
    eos: frozenset = frozenset()  # tokens that end its text
    ended: bool = False  # it committed one of them

    def begin(self, first: int) -> None:
        """Its prefill's token, read: its first output and the next block's first token."""
        self.first, self.tokens, self.ended = first, [first], first in self.eos

    @property
    def remaining(self) -> int:
        """Tokens it may still commit."""
        return self.max_tokens - len(self.tokens)

    @property
    def done(self) -> bool:
        return self.ended or self.remaining <= 0


@dataclass
class Launched:
    """One cycle of every row, queued on the device and not read yet."""

    size: int  # tokens verified a row (1: plain steps)
    choices: mx.array  # [rows, size]: the target's choice after each slot
    accepted: mx.array  # [rows]: drafts each row accepted
    features: mx.array  # the block's tapped target features, the draft's next context
    guess: Optional[mx.array]  # a forecast's drafts (the lead row's), for the policy
    lead: int  # the row whose tokens the policy checks a forecast against (the first one decoding)
    launch_seconds: float  # host time spent building and queueing it
    slots: list[Row]  # the batch's slots it ran (rows may join before it is read)
    timed: bool = True  # False: queued behind a prefill, its cost is not the cycle's
    next_first: Optional[mx.array] = None  # rolled back on the device: each row's next first token


@dataclass
class Joining:
    """A row prefilled behind a queued cycle: its caches and first token, not read yet."""

    row: Row
    cache: list[Any]
    contexts: list[KVCache]
    first: mx.array  # [1]


def batches(params: Optional[SamplingParams]) -> bool:
    """Whether a row sampling with ``params`` can join a batch: greedy, or temperature with
    top-p, top-k and min-p. Seeded requests (the batch's block sizes would change their draws),
    logits processors (they read each row's own history) and match acceptance run alone."""
    return params is None or not params.logits_processors and (
        params.greedy or params.accept == "speculative" and params.seed is None)


class BatchDecoder:
    """Rows decoded together. ``add`` prefills a prompt and returns its ``Row`` (the prefill's
    token is its first output); ``step`` runs one cycle for every row and returns the tokens
    each committed, by row id; a row leaves when it reaches its ``max_tokens`` or on ``remove``."""

    def __init__(self, model: nn.Module, draft: DFlashDraft, block_size: Optional[int] = None,
                 prefix_cache: Optional[PrefixCache] = None, policy: Optional[BlockPolicy] = None,
                 options: EngineOptions = DEFAULT_OPTIONS):
        check_compatible(draft, model)
        self.target = Target(model, draft.config.target_layer_ids, options)
        self.draft = draft
        self.block_size = block_size or draft.block_size
        check_block_size(self.block_size, draft.block_size)
        self.mask_id = draft.config.mask_token_id
        self.draft_vocab, self.draft_head = greedy_head(draft, self.target)
        self.prefix_cache = prefix_cache  # prompts' states kept for later prompts that start with them
        # Each cycle's block size for all rows, from measured speed (``policy.py``; None: full blocks):
        # one forward of many rows costs as much for plain steps as for blocks only on a GPU.
        self.policy = policy
        if policy is not None and policy.max_block != self.block_size:
            raise DFlashError(f"the adaptive policy is for blocks of up to {policy.max_block}, not {self.block_size}")
        self.rows: dict[int, Row] = {}  # the rows decoding
        # The caches' batch order: the rows decoding, and with ``pad_rows`` idle slots (rows that
        # left, or copies): their tokens are drafted and verified and dropped.
        self.slots: list[Row] = []
        self.cache: list[BatchCache] = []
        self.context: list[BatchContext] = []
        self._next_id = 0
        # Where the caches roll back by counts on the device (GPUs), the next cycle is queued
        # before this one is read, as the engine does; a cycle queued when rows join or leave is
        # read at once, its tokens kept for the next ``step`` (which queues a cycle again only once
        # they are given: never a cycle queued while another's tokens wait).
        self.queued: Optional[Launched] = None
        self.landed: dict[int, list[int]] = {}
        # Rows prefilled behind a queued cycle: first their first token is read (after that
        # cycle), then they merge into the batch before the next cycle is queued.
        self.joining: list[Joining] = []  # first token not read
        self.ready: list[Joining] = []  # first token read, not merged
        self.clock = CycleClock()  # (a cycle's cost for the policy, launches queued ahead or not)
        self.block_sizes: Counter[int] = Counter()  # cycles run per block size (``/health``)

    def add(self, prompt: mx.array, max_tokens: int, params: Optional[SamplingParams] = None,
            eos: frozenset = frozenset()) -> Row:
        """Prefill ``prompt`` alone (as ``generate`` does) and merge it into the batch (unless
        the prefill's token, its first output, is all it asked for or one of ``eos``); ``params``:
        how the row samples (None or temperature 0: greedy). The row leaves in the cycle that
        commits its ``max_tokens``-th token or one of ``eos`` (tokens after it in that cycle included).
        With ``join_behind``, while a cycle is queued the prefill is queued behind it and nothing
        is read: the row's ``tokens`` stay empty and the next ``step`` gives its first token (then
        it merges)."""
        if not batches(params):
            raise DFlashError("a batch's rows sample with temperature, top_p, top_k and min_p only: seeded "
                              "requests, logits processors and match acceptance run alone")
        params = None if params is None or params.greedy else params.drawing()  # (a random stream of its own)
        behind = self.queued is not None and self.target.options.join_behind
        if not behind:
            self._land()  # (before the prefill: a queued cycle's roll back reads the target's latest call)
        elif self.queued.next_first is None:  # (its roll back built now, before the prefill, for the same reason)
            self.queued.next_first = self._roll_back(self.queued, self.queued.accepted)
        collector = _ContextCollector(self.draft)
        cache = self.target.make_cache()
        logits, reused = prefill(self.target, collector, prompt, cache, self.target.options.prefill_step,
                                 prefix_cache=self.prefix_cache)
        first = first_token(params, logits[None], prompt)
        row = Row(self._next_id, prompt.tolist(), max_tokens, -1, prompt.size, [], reused, params, eos)
        self._next_id += 1
        if behind:  # (its first token comes from the next ``step``; queued here, the prefill fails here alone)
            mx.async_eval(first, [c.state for c in cache], collector.state)
            self.rows[row.id] = row
            self.joining.append(Joining(row, cache, collector.caches, first))
            return row
        row.begin(int(first.item()))
        if not row.done:
            self.rows[row.id] = row
            self._join(row, cache, collector.caches)
        self.clock = CycleClock()  # (the next cycle's cost is timed from here: not this prefill)
        return row

    def remove(self, row_id: int) -> None:
        """The row leaves the batch (its client went away); a prefix cache keeps its state: a
        chat's next turn resends this prompt and its reply."""
        self._leave([row_id])

    def _leave(self, row_ids: list[int]) -> None:
        """Rows leave together (their tokens of a cycle read early dropped), each row's state
        kept by the prefix cache; their slots are cut from the caches (a queued cycle read first,
        once) or, with ``pad_rows``, left idle."""
        for j in [*self.joining, *self.ready]:
            if j.row.id in row_ids:  # (not merged yet: nothing in the batch's caches)
                del self.rows[j.row.id]
        self.joining = [j for j in self.joining if j.row.id in self.rows]
        self.ready = [j for j in self.ready if j.row.id in self.rows]
        leaving = [r for r in row_ids if r in self.rows]
        if not leaving:
            return
        if self.prefix_cache is not None:
            if not all(isinstance(c, RowsKVCache) for c in self.cache):
                self._land()  # (other caches hold a queued cycle's positions or state: kept as of the read)
            for row_id in leaving:
                self._keep_prefix(self._slot(row_id), self.rows[row_id])
            self.clock = CycleClock()  # (the next cycle's cost is timed from here: not these copies)
        for row_id in leaving:
            self.landed.pop(row_id, None)
            del self.rows[row_id]
        self._fit(len(self.slots))

    def _slot(self, row_id: int) -> int:
        return next(i for i, row in enumerate(self.slots) if row.id == row_id)

    def _fit(self, width: int) -> Optional[mx.array]:
        """Cut or pad the caches' batch to the slots the rows decoding need (``width``: the slots
        before a joining row's): idle slots dropped, or copies of a row added as idle ones.
        Returns the slots kept (None: all, in place)."""
        decoding = [i for i, row in enumerate(self.slots) if row.id in self.rows]
        if not decoding:
            self.slots, self.cache, self.context, self.queued = [], [], [], None
            return None
        size = self._width(len(decoding), width)
        if size == len(self.slots):
            return None
        self._land()
        idle = [i for i, row in enumerate(self.slots) if row.id not in self.rows][: max(size - len(decoding), 0)]
        keep = sorted(decoding + idle)
        copies = size - len(keep)
        self.slots = [self.slots[i] for i in keep] + [
            replace(self.slots[decoding[-1]], id=-1, tokens=[]) for _ in range(copies)]
        index = mx.array(keep + [decoding[-1]] * copies)
        for c in [*self.cache, *(ctx.cache for ctx in self.context)]:
            c.filter(index)
        return index

    def _width(self, decoding: int, width: int) -> int:
        """Slots for ``decoding`` rows in a batch ``width`` wide: as many, or with ``pad_rows`` a
        power of two (the width kept while at most twice the least: fewer shapes to trace)."""
        if not self.target.options.pad_rows:
            return decoding
        least = 1 << (decoding - 1).bit_length()
        return width if least <= width <= 2 * least else least

    def clear(self) -> None:
        """Every row leaves at once, nothing read or kept (after a cycle failed)."""
        self.rows, self.slots, self.cache, self.context = {}, [], [], []
        self.queued, self.landed, self.joining, self.ready = None, {}, [], []

    def _keep_prefix(self, index: int, row: Row) -> None:
        """Store row ``index``'s caches, cut to its committed tokens but the latest (not in them yet)."""
        tokens = row.prompt + row.tokens[:-1]
        caches = [row_cache(c, index, len(tokens), row.length)
                  for c in [*self.cache, *(ctx.cache for ctx in self.context)]]
        if any(c is None for c in caches):
            return
        target, context = caches[: len(self.cache)], caches[len(self.cache) :]
        self.prefix_cache.store(self.target, _ContextCollector(self.draft, context), target, tokens)

    def step(self) -> dict[int, list[int]]:
        """One cycle for every row: draft, verify (one forward), accept, roll back, commit; the
        tokens each row committed, by row id. A cycle read early (rows joined or left while it was
        queued: ``_land``) gives its tokens instead, and queues the next cycle (GPUs). Rows
        prefilled behind the cycle (``join_behind``) get their first token here. The rows that
        finished leave here, in the step that gives their last tokens, never between steps."""
        self.clock.resume()
        if self.landed or not (self.slots or self.ready):
            out, self.landed = self.landed, {}
        else:
            out = self._cycle(queue_next=True)
        out.update(self._read_joining())
        self._leave([r for r, row in self.rows.items() if row.done])
        if self.queued is None and not self.landed and (self.slots or self.ready) and self._queues(self.block_size):
            # (it gave a cycle read early: the device would idle while the caller takes its tokens;
            # never while a leave just read one early, whose tokens the next step gives)
            self.queued = self._launch_from_host()
        self.clock.pause()  # (the caller's time between steps, a server's other work, is not a cycle's cost)
        return out

    def _cycle(self, queue_next: bool) -> dict[int, list[int]]:
        """Read the queued cycle, or launch one and read it; with ``queue_next``, queue the next first
        (with the rows whose first token was read since: they merge before it)."""
        cycle = self.queued or self._launch_from_host()
        self.queued = None
        on_device = self.target.rolls_back_on_device
        if on_device:  # roll back by the counts still on the device, and queue the next cycle
            first = cycle.next_first if cycle.next_first is not None else self._roll_back(cycle, cycle.accepted)
            if queue_next and self._queues(cycle.size):
                untimed = self.joining or self.ready  # (a prefill or a merge runs before it on the device)
                first = self._merge_ready(first)
                self.queued = self._launch(first, self._wanted() - 1, timed=not untimed)
        # Accept: the cycle's one device-to-host read (a forecast's guesses with it).
        choices, accepted = cycle.choices.tolist(), cycle.accepted.tolist()
        if not on_device:
            self._roll_back(cycle, accepted)
        # Commit.
        out: dict[int, list[int]] = {}
        for row, a, c in zip(cycle.slots, accepted, choices):
            row.length += a + 1
            if row.id not in self.rows or row.done:  # (an idle slot; or it finished in the cycle before, read early)
                continue
            committed = c[: a + 1][: row.remaining]
            row.tokens += committed
            row.ended = any(t in row.eos for t in committed)
            row.first = c[a]
            out[row.id] = committed
        self._settle()
        self._record(cycle, out, accepted)
        return out

    def _launch(self, first: mx.array, wanted: int, timed: bool = True) -> Launched:
        """Draft a block after each row's ``first`` ([rows]) and verify all of them in one target
        forward, lazily (queued on the device); the block's size from the policy (``timed``: it
        learns this cycle's cost)."""
        tic = time.perf_counter()
        L, forecast = self._size(wanted)
        drafted, q = self._draft(first, self.block_size if forecast else L)  # [rows, L - 1] (a forecast's: more)
        block = mx.concatenate([first[:, None], drafted[:, : L - 1]], axis=1)
        logits, features = self.target(block, self.cache)
        choices, accepted = self._accept(logits, block, drafted[:, : L - 1], q)
        live = [row.id in self.rows for row in self.slots]
        if not all(live):  # (idle slots accept nothing: they grow a position a cycle, not a block)
            accepted = mx.where(mx.array(live), accepted, 0)
        lead = live.index(True)
        guess = drafted[lead] if forecast else None  # (what plain steps then commit)
        mx.async_eval(choices, accepted, features, *([guess] if forecast else []))
        seconds = time.perf_counter() - tic
        self.clock.add_launch(seconds)
        self.block_sizes[L] += 1
        return Launched(L, choices, accepted, features, guess, self.slots[lead].id, seconds, list(self.slots), timed)

    def _launch_from_host(self) -> Launched:
        """A cycle after the rows' committed tokens, as the host knows them (none queued before it)."""
        self._merge_ready(None)
        return self._launch(mx.array([row.first for row in self.slots], dtype=mx.uint32), self._wanted())

    def _read_joining(self) -> dict[int, list[int]]:
        """The first tokens of the rows prefilled behind the cycle just read (one read for all);
        a row that asked for no more, or began with an EOS, leaves without joining."""
        if not self.joining:
            return {}
        firsts = mx.concatenate([j.first for j in self.joining]).tolist()
        for j, first in zip(self.joining, firsts):
            j.row.begin(first)
            if j.row.done:
                del self.rows[j.row.id]
            else:
                self.ready.append(j)
        out = {j.row.id: list(j.row.tokens) for j in self.joining}
        self.joining = []
        return out

    def _merge_ready(self, first: Optional[mx.array]) -> Optional[mx.array]:
        """Merge the rows whose first token was read; ``first``: the slots' next first tokens on
        the device (None: the host knows them), returned for the slots after the merge."""
        for j in self.ready:
            if first is not None:
                first = mx.concatenate([first, mx.array([j.row.first], dtype=first.dtype)])
            kept = self._join(j.row, j.cache, j.contexts)
            if first is not None and kept is not None:
                first = first[kept]
        if self.ready and first is None:
            self.clock = CycleClock()  # (the next cycle's cost is timed from here: not these merges)
        self.ready = []
        return first

    def _wanted(self) -> int:
        """The most tokens a row still wants."""
        return max(row.remaining for row in self.rows.values())

    def _queues(self, size: int) -> bool:
        """Whether a cycle of up to ``size`` tokens can be queued before the one before it is read
        (or before the caller asks for it): where the options say so (GPUs), and while no row can
        reach its ``max_tokens`` in it (a row leaving then would make the queued cycle be read
        early, unless its slot stays: ``pad_rows``)."""
        options = self.target.options
        return (options.queue_ahead and self.target.rolls_back_on_device
                and (options.pad_rows or min(r.remaining for r in self.rows.values()) > size))

    def _roll_back(self, cycle: Launched, accepted: Union[mx.array, list[int]]) -> mx.array:
        """Cut each row back to its accepted prefix (counts still on the device, or read) and add
        its kept tokens to the draft's context; returns each row's next first token (on the device)."""
        on_device = isinstance(accepted, mx.array)
        counts = accepted if on_device else mx.array(accepted)
        dropped = (cycle.size - 1) - counts
        if cycle.size > 1 and (on_device or any(a < cycle.size - 1 for a in accepted)):
            if self.target.rolls_back_on_device:  # (each row cut by its own count on the device)
                self.target.rollback(self.cache, dropped)
            else:
                for layer_cache in self.cache:
                    cut_rows(layer_cache, [cycle.size - 1 - a for a in accepted])
        context = self.draft.project_context(cycle.features)
        for layer, ctx in zip(self.draft.layers, self.context):
            ctx.cache.update_and_fetch(*layer.self_attn.context_kv(context, ctx.cache.offset))
            ctx.cache.drop(dropped)
        return mx.take_along_axis(cycle.choices, counts[:, None], axis=1)[:, 0]

    def _settle(self) -> None:
        """The counts are read: the caches read no further than the longest row (and a cycle
        queued since)."""
        longest = max(row.length for row in self.slots)
        if self.target.rolls_back_on_device:
            self.target.settle(self.cache, longest + (self.queued.size if self.queued is not None else 0))
        for ctx in self.context:
            ctx.cache.settle(longest)

    def _record(self, cycle: Launched, out: dict[int, list[int]], accepted: list[int]) -> None:
        """The policy learns the cycle's cost (the whole batch's) and every decoding row's acceptance."""
        if self.policy is None:
            return
        seconds = self.clock.cycle_seconds(cycle.launch_seconds)  # (and the next cycle's window starts)
        lead = out.get(cycle.lead)  # (None: it had finished, a cycle read as rows left)
        if lead is None or not cycle.timed:
            return
        if cycle.guess is not None:  # plain steps: the lead row's forecast checked against its tokens
            self.policy.record_cycle(cycle.size, lead, seconds, cycle.guess.tolist())
        else:
            self.policy.record_rows(cycle.size, [a + 1 for row, a in zip(cycle.slots, accepted) if row.id in out],
                                    seconds)
            self.policy.observe(lead)  # (a forecast's later guesses: the lead row's tokens)

    def _land(self) -> None:
        """Read a queued cycle now (rows are about to join or leave); the next ``step`` gives its tokens."""
        if self.queued is not None:
            self.landed = self._cycle(queue_next=False)

    def _size(self, wanted: int) -> tuple[int, bool]:
        """The cycle's block size (every row's) and whether it drafts a forecast beside plain steps."""
        if self.policy is None:
            return min(self.block_size, wanted + 1), False
        # Costs per row count (rounded up to a power of two): on a CPU a block of many rows costs
        # many plain steps, on a GPU about one.
        self.policy.use_costs(1 << (len(self.slots) - 1).bit_length())
        return self.policy.choose(limit=wanted + 1, trees=False), self.policy.wants_forecast

    def _params(self, row: Row) -> Optional[SamplingParams]:
        """How the row in a slot samples (None: greedy, or an idle slot, whose tokens are dropped)."""
        return row.params if row.id in self.rows else None

    def _accept(self, logits: mx.array, block: mx.array, drafted: mx.array, q: dict[int, mx.array]
                ) -> tuple[mx.array, mx.array]:
        """(the target's choice after each slot [rows, L], accepted drafts [rows]): a greedy row
        keeps the drafts equal to the target's argmax; a sampled row accepts by speculative
        sampling against its drafts' distribution ``q``, its bonus token drawn as the engine's."""
        choices = mx.argmax(logits, axis=-1).astype(mx.uint32)
        accepted = mx.cumprod((drafted == choices[:, :-1]).astype(mx.int32), axis=1).sum(axis=1)
        for i, row in enumerate(self.slots):
            params = self._params(row)
            if params is not None:
                n = drafted.shape[1]
                tokens, a = verify(params, logits[i], None, block[i], drafted[i], q[i][:n] if n else None)
                choices[i : i + 1] = tokens.astype(mx.uint32)[None]
                accepted[i : i + 1] = a.astype(mx.int32)
        return choices, accepted

    def _draft(self, first: mx.array, L: int) -> tuple[mx.array, dict[int, mx.array]]:
        """Drafts [rows, L - 1] for the slots after each row's ``first`` (one draft pass): greedy,
        or for a sampled row drawn from the draft's distributions, returned too by row index
        (``q[i]``: [L - 1, V], over the whole vocabulary, as lossless sampling needs)."""
        if L == 1:
            return mx.zeros((first.size, 0), dtype=mx.uint32), {}
        block = mx.concatenate([first[:, None], mx.full((first.size, L - 1), self.mask_id, dtype=mx.uint32)], axis=1)
        h = self.draft.scale_embeddings(self.target.embed(block))
        config = self.draft.config
        masks: dict = {}  # per kind of layer (sink, window, sliding window): their contexts move in step
        for i, (layer, context) in enumerate(zip(self.draft.layers, self.context)):
            sliding = config.sliding_window if config.is_sliding(i) else None
            kind = (context.sink, context.window, sliding)
            if kind not in masks:
                masks[kind] = context.block_mask(L, sliding, config.causal_windows)
            h = layer(h, context, masks[kind])
        hidden = self.draft.norm(h)[:, 1:]
        logits = self.draft.scale_logits(self.draft_head(hidden))
        selector = config.dflash2  # (a DFlash2 draft: its selector picks each slot, every row at once)
        walk = self.draft.candidate_selector.walk if selector is not None else None
        if walk is not None:
            drafted = walk(hidden, logits, first, selector.selector_top_k, self.draft_vocab)[0]
        else:
            drafted = mx.argmax(logits, axis=-1)
            drafted = drafted.astype(mx.uint32) if self.draft_vocab is None else self.draft_vocab[drafted]
        q = {}
        for i, row in enumerate(self.slots):
            params = self._params(row)
            if params is None:
                continue
            full = self.draft.scale_logits(self.target.head(hidden[i]))  # (q must be the drafts' own: the whole head)
            if walk is not None:  # sampled through the selector, as the engine samples a DFlash2 draft
                row_drafts, q[i] = walk(hidden[i], full, first[i : i + 1], selector.selector_top_k, None, params.temp,
                                        params.key())
            else:
                row_drafts, q[i] = draft_tokens(params, full, None, first[i : i + 1])
            drafted[i : i + 1] = row_drafts.astype(mx.uint32)[None]
        return drafted, q

    def _join(self, row: Row, cache: list[Any], contexts: list[KVCache]) -> Optional[mx.array]:
        """Append ``row`` (its prefilled caches) to the batch, then fit the batch's slots (which
        it returns: ``_fit``)."""
        rows = [joined(c) for c in cache]
        context_rows = [RowsKVCache.joined(c) for c in contexts]
        width = len(self.slots)
        if not self.slots:
            self.cache = rows
            self.context = [BatchContext(c, sink, window)
                            for c, (sink, window) in zip(context_rows, self.draft.context_windows())]
        else:
            for mine, new in zip([*self.cache, *(ctx.cache for ctx in self.context)], [*rows, *context_rows]):
                mine.extend(new)
        self.slots.append(row)
        return self._fit(width)


class _ContextCollector:
    """Stands in for a proposer during a row's prefill: the draft's context of the prompt, per
    draft layer a ``KVCache`` of its projected keys and values (what the row brings into the
    batch, and what a prefix cache keeps of it)."""

    def __init__(self, draft: DFlashDraft, caches: Optional[list[KVCache]] = None) -> None:
        self.draft = draft
        self.caches = caches if caches is not None else [KVCache() for _ in draft.layers]

    def add_context(self, features: mx.array, kept=None) -> None:
        context = self.draft.project_context(features)
        for layer, cache in zip(self.draft.layers, self.caches):
            cache.update_and_fetch(*layer.self_attn.context_kv(context, cache.offset))

    @property
    def state(self) -> list:
        return [cache.state for cache in self.caches]

    @property
    def context_key(self) -> tuple:
        return "batch context", id(self.draft)

    def context_caches(self) -> list:
        return self.caches

    def use_context(self, caches: list, positions: int) -> None:
        self.caches = caches


def batch_generate(model: nn.Module, prompts: list[list[int]], draft: DFlashDraft, max_tokens: list[int],
                   block_size: Optional[int] = None, eos: frozenset = frozenset()) -> list[list[int]]:
    """Greedy tokens of every prompt decoded in one batch, each up to its ``max_tokens`` or its
    first EOS (not included); all rows join before the first cycle."""
    decoder = BatchDecoder(model, draft, block_size)
    outputs = []
    for prompt, limit in zip(prompts, max_tokens):
        outputs.append(list(decoder.add(mx.array(prompt, dtype=mx.uint32), limit, eos=eos).tokens))
    while decoder.rows:
        for row, tokens in decoder.step().items():
            outputs[row] += tokens
    return [until_eos(tokens, eos) for tokens in outputs]


def until_eos(tokens: list[int], eos: frozenset) -> list[int]:
    """``tokens`` up to their first EOS, not included (a reply as ``generate`` and the server give it)."""
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]
