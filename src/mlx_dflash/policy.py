"""Adaptive block size: never much slower than plain decoding when the draft is poor.

Each cycle the engine asks for a block size and reports back what it got and how
long the cycle took (when it queues cycles ahead, it asks for the next size before it
reports the current cycle: the policy then decides on what it knew one cycle earlier). The policy estimates, per draft slot k, the chance that slot k
is accepted given that slots 1..k-1 were, and the measured seconds per cycle of
each candidate size (1, 2, 4, 8, ... up to the draft's block); it picks the size with
the most expected tokens per second, E[min(L, b)] / cost(b). Block size 1 is plain
decoding (no draft pass). Where a verify costs the same for 1 or 16 tokens (a GPU)
full blocks win; where it grows with the block (a CPU) a weak draft is best used
with short blocks. While a smaller size wins, the next size up is still tried now
and then (less often each time it loses; a cheaper probe than a full block) so the
policy notices, one size at a time, when the text becomes predictable. A probe runs two
cycles, the second timed: a size whose one timed cycle caught a stall (a new compiled shape
in a batch) would otherwise never be timed again, and one such cycle kept a batch on 8-token
blocks where 16 cost no more. And while blocks win
by little, such a probe runs plain decoding again instead: its cost, timed early in a text, can
be far off later, and a policy that believed the early cost would keep blocks at an acceptance
where plain decoding is much faster.

While plain decoding wins, a probe is a *forecast*: one draft pass beside a plain step,
whose guess is checked slot by slot against the tokens plain decoding then commits, until
it misses. That measures the draft's acceptance for the price of one draft pass (on a GPU a
verify can cost several plain steps, a small draft's pass less than one), and verifies nothing. In the
same way a block shorter than the draft's carries one drafted token past its end, checked
against the block's bonus token when the block is wholly accepted: otherwise a policy on
short blocks would never see the slot after them again, and one early miss there kept it
on 4-token blocks for a whole text (CPU, HumanEval prompt 3: 3.12 s vs 2.20 s with 16).

One policy can serve many generations (the server's and the benchmark's do): costs per
size belong to the machine and the model pair, so they carry over; so does how rarely probes
pay (their back-off), after a text where plain decoding won; the acceptance statistics belong
to one text, start afresh with it and fade as it goes (SLOT_DECAY).
Asked to (``trees``), the policy also weighs trees of drafts (``tree.py``) as sizes past the block:
a tree of B nodes verifies 1 + B tokens, and its expected tokens are what its cycles committed.
Tree probes back off on their own count, carried over texts: whether trees pay is the machine's
and the pair's, and a tree's first cycle in a text is dear (a new compiled shape), so on a GPU
where trees lose, one probe in every short text cost a tenth of the chains' speed. While a tree
is best, the full block is probed now and then: a tree's cycles leave the chain's acceptance as
it was when trees took over, and a text that then loops (whole blocks accepted, far cheaper
than a tree's cycle) otherwise stayed on trees at half the chain's speed.
A new text starts with full blocks (two for a size not timed yet: a size's first cycle is not
timed), or, when plain decoding won the previous text, with a forecast: a useless draft then
costs one draft pass per text instead of a verified block.
"""

from __future__ import annotations

import time
from typing import Hashable, Optional, Sequence, Union

from .errors import DFlashError

PROBE_START = 16  # cycles between probes, doubled after each losing probe
PROBE_MAX = 256
WARMUP_CYCLES = 2  # full blocks first (the first is not timed), to learn the text's acceptance
# A plain step's cost may have drifted this much since it was last timed (warm-up early in a text):
# while blocks win by less, a probe runs plain decoding again to re-time it.
RETIME_MARGIN = 1.5
RETIME_STEPS = 3  # such a probe's plain steps: the switch (not timed) and two timed ones
PROBE_STEPS = 2  # a probe's cycles of the size up: the switch (not timed) and one timed
# Each cycle the acceptance statistics fade by this factor (a memory of ~50 cycles): a text
# that turns poor after a long predictable stretch (an answer that ended, `bench --no-eos`)
# otherwise kept blocks for as long as its good start outweighed the poor cycles since
# (the value chosen with tools/policy_simulation.py --slot-decay: docs/performance.md).
SLOT_DECAY = 0.98
# A timed cycle dearer than this times its size's believed cost counts as that much: stalls of a
# few times a step (the machine's hiccups, grown buffers) come often on a GPU, and a few of them
# made plain decoding look dearer than useless full blocks for a whole text. A lasting change
# still gets through, by up to 10% a cycle.
SPIKE_CAP = 1.5
# A cycle during whose window the caller kept the tokens for more than this share of it is not
# timed: the wait was other work (a server runs its batch's cycles between a lone generation's),
# not the cycle's cost, and a few such cycles taught a lone generation's policy to shun blocks.
AWAY_SHARE = 0.5
# The trees a policy asked for trees (``trees=True``) may verify instead of a full block (budgets:
# drafted nodes). A tree costs more to verify than the block's chain and commits at least about
# what the chain does; probed like a larger block, one budget up at a time. Off by default: on the
# pairs measured so far trees lose (docs/trees.md), and probing them costs a chain's speed.
TREE_BUDGETS = (32, 64)
MAX_TREE_BUDGET = 1024


def candidate_sizes(max_block: int, tree_budgets: Sequence[int] = ()) -> list[int]:
    """Plain decoding, the powers of two below the draft's block, the block itself, then the
    trees: a tree of B drafted nodes verifies 1 + B tokens (``tree.py``)."""
    sizes, size = [], 1
    while size < max_block:
        sizes.append(size)
        size *= 2
    return sizes + [max_block] + [1 + budget for budget in sorted(set(tree_budgets))]


def tree_budgets(trees: Union[bool, int]) -> tuple[int, ...]:
    """The tree budgets a policy may pick: ``TREE_BUDGETS`` (True), none (False), or one."""
    if isinstance(trees, bool):
        return TREE_BUDGETS if trees else ()
    return (trees,)


def fixed_tree_budget(trees: Union[bool, int]) -> Optional[int]:
    """The budget of ``trees`` when it names one (fixed blocks then verify trees of it)."""
    return None if isinstance(trees, bool) else trees


def check_block_size(block_size: int, draft_block: int) -> None:
    """A block drafts at most the draft's own block."""
    if not 1 <= block_size <= draft_block:
        raise DFlashError(f"block size must be in 1..{draft_block} (the draft's), got {block_size}")


def check_tree_budget(budget: int, max_block: int, fixed: bool = False) -> None:
    """A policy weighs trees of at least a block's nodes (sizes past the block); fixed blocks
    verify trees of any budget."""
    if not 1 <= budget <= MAX_TREE_BUDGET:  # (no setting takes it: no hint at --no-adaptive)
        raise DFlashError(f"a tree budget must be in 1..{MAX_TREE_BUDGET}, got {budget}")
    if not fixed and budget < max_block:
        raise DFlashError(f"the adaptive policy's tree budgets must be in {max_block}..{MAX_TREE_BUDGET} (at least "
                          f"the block size; smaller trees run with fixed blocks: --no-adaptive), got {budget}")


class Backoff:
    """When to probe again: every ``every`` cycles, doubled after each probe that lost (up to
    PROBE_MAX), back to PROBE_START after one that won."""

    def __init__(self) -> None:
        self.every, self.since = PROBE_START, 0

    def tick(self, free: bool = True) -> bool:
        """One more cycle; True (and a fresh count) when a probe is due and ``free`` (nothing under way)."""
        self.since += 1
        due = free and self.since >= self.every
        self.since = 0 if due else self.since
        return due

    def settle(self, won: bool) -> None:
        self.every = PROBE_START if won else min(2 * self.every, PROBE_MAX)


class BlockPolicy:
    def __init__(self, max_block: int, slot_decay: float = SLOT_DECAY, tree_budgets: Sequence[int] = ()):
        self.slot_decay = slot_decay  # how fast acceptance statistics fade (1.0: never)
        self.max_block = max_block
        for budget in tree_budgets:
            check_tree_budget(budget, max_block)
        self.sizes = candidate_sizes(max_block, tree_budgets if max_block > 1 else ())
        self.seconds: dict[int, float] = {}  # block size -> moving average seconds per cycle
        self.samples: dict[int, int] = {}  # block size -> cycles seen
        self.cost_key: Hashable = None  # whose costs those are (``use_costs``)
        self.cost_tables: dict[Hashable, tuple[dict[int, float], dict[int, int]]] = {}  # the other keys'
        # (block, acceptance, seconds, forecast) of each recorded cycle, when a caller sets a list
        # here (the benchmark, per generation: what the policy saw, to explain what it chose)
        self.history: list[tuple[int, float, float, bool]] | None = None  # (a batch: its rows' mean acceptance)
        self.probes = Backoff()  # probes of the next chain size up
        self.tree_probes = Backoff()  # of the next tree up: kept across texts
        self.chain_probes = Backoff()  # of the full block while a tree is best
        self.wants_forecast = False  # set by ``choose``: draft a forecast beside this plain step
        self.start_text()

    def start_text(self) -> None:
        """A new generation: forget the acceptance seen so far, keep the measured costs and
        whether plain decoding won the latest text, and if it did, the probes' back-off."""
        self.plain_won = getattr(self, "cycles", 0) > 0 and 1 in self.seconds and self.best(self.sizes) == 1
        if not self.plain_won:  # a draft that won lands on sizes it may outgrow: probe as often as at first
            self.probes.every = PROBE_START
        self.previous_block: int | None = None  # the latest cycle's size (a text's first cycle is not timed)
        self.timed_previous: int | None = None  # the latest cycle's size if that cycle was timed
        self.slot_checked = [0] * self.max_block  # slot k: cycles whose slots 1..k-1 were all accepted
        self.slot_accepted = [0] * self.max_block
        self.tree_tokens: dict[int, tuple[float, float]] = {}  # tree size -> (tokens committed, cycles), fading
        self.cycles = 0  # cycles recorded
        self.chosen = 0  # sizes chosen: one ahead of ``cycles`` when the engine queues the next cycle early
        self.probes.since = 0
        self.probing: int | None = None  # the size being probed: one above the best, 1 (a re-time), the block
        self.probe_from = 0  # the best size when the probe began
        self.probe_clock = self.probes  # the back-off the probe's outcome settles
        self.repeats = 0  # cycles of the probed size still to run after the probe's first
        # Re-times back off on their own, per text: the probes' back-off can carry over from a
        # text where plain decoding won, and kept a re-time from ever coming in the next one.
        self.retimes = Backoff()
        self.forecasting = False  # a forecast was asked for and is not settled yet
        self.forecast_is_probe = False
        self.guess: list[int] | None = None  # the forecast's tokens, once drafted
        self.guess_checked = 0
        self.guess_from = 1  # the block slot its first token guesses

    def use_costs(self, key: Hashable) -> None:
        """Keep measured costs apart per ``key`` from now on: a batch's cycle of 16 rows costs
        another multiple of a plain step than a cycle of 2 (``batch.py`` keys them by rows). A key
        met before gets its costs back; a new one times its sizes afresh. Acceptance is shared."""
        if key == self.cost_key:
            return
        self.cost_tables[self.cost_key] = (self.seconds, self.samples)
        self.seconds, self.samples = self.cost_tables.pop(key, ({}, {}))
        self.cost_key, self.previous_block, self.timed_previous = key, None, None  # (no steady cycle across keys)
        # A probe or forecast under way is judged against the costs it was chosen by: dropped
        # (the new key's table may not have a timed size to judge it against).
        self.probing, self.repeats, self.forecasting, self.forecast_is_probe, self.guess = None, 0, False, False, None

    def costs(self) -> dict[Hashable, tuple[dict[int, float], dict[int, int]]]:
        """Every key's measured costs: (seconds a cycle, cycles seen) per size, the current key's included."""
        return {**self.cost_tables, self.cost_key: (self.seconds, self.samples)}

    def expected_tokens(self, block: int) -> float:
        """E[min(L, block)]: the bonus token plus each drafted slot times P(it and all before it).
        A slot not checked yet counts as likely as the deepest slot checked (none checked: certain);
        taken as certain, slots past a forecast's first hit kept a weak draft on full blocks until
        slot 1's misses outweighed 15 certain slots. A tree: the tokens its cycles committed on
        average (before any: a full block's)."""
        if block > self.max_block:
            tokens, cycles = self.tree_tokens.get(block, (0.0, 0.0))
            return tokens / cycles if cycles else self.expected_tokens(self.max_block)
        expected, reach, rate = 1.0, 1.0, 1.0
        for k in range(1, block):
            checked = self.slot_checked[k]
            if checked:
                rate = self.slot_accepted[k] / checked
            reach *= rate
            expected += reach
        return expected

    def rate(self, block: int) -> float:
        return self.expected_tokens(block) / self.seconds[block]

    def best(self, sizes: list[int]) -> int:
        """The fastest timed size among ``sizes`` (ties: the smaller block, listed first)."""
        return max((size for size in sizes if size in self.seconds), key=self.rate)

    def worth_timing(self, block: int, best_rate: float) -> bool:
        """A cycle of any size costs at least a plain step, so a size whose expected tokens
        per plain step cannot beat the best rate so far is never tried (a useless draft
        then costs no exploration beyond the warm-up)."""
        return self.expected_tokens(block) / self.seconds[1] > best_rate

    def choose(self, limit: int | None = None, trees: bool = True) -> int:
        """The next block size, at most ``limit`` (the tokens still wanted): every block is
        then a whole candidate size whose cost can be learned, also in short generations.
        A tree (a size past the block) where ``trees`` and a full block fits.
        Sets ``wants_forecast`` when the plain step it picks should carry a forecast."""
        self.wants_forecast = False
        size = self._choose(limit, trees)
        self.chosen += 1
        if size > 1 and self.forecasting:  # blocks measure the acceptance themselves
            self._settle_forecast()
        return size

    def _choose(self, limit: int | None, trees: bool) -> int:
        room = self.max_block if limit is None else min(limit, self.max_block)
        largest = max(size for size in self.sizes if size <= room)  # (a text starts with chains)
        sizes = [size for size in self.sizes if size <= largest or trees and largest == self.max_block]
        if largest == 1 or (self.forecasting and self.guess_checked == 0):
            return 1  # (a forecast's first slot decides whether blocks are worth a try)
        if self.chosen == 0 and self.plain_won and largest in self.seconds:
            return self._forecast(probe=False)  # a new text after a poor one: its acceptance, cheaply
        warmup = 1 if largest in self.seconds else WARMUP_CYCLES  # the first cycle of a size is not timed
        if self.chosen < warmup or not any(size > 1 for size in self.seconds):
            return largest  # warm-up: the largest block that fits, until one drafting size is timed
        if 1 not in self.seconds:
            return 1
        if self.repeats:
            self.repeats -= 1
            if self.probing in sizes:
                return self.probing
        best = self.best(sizes)
        best_rate = self.rate(best)
        untimed = [size for size in sizes if size not in self.seconds and self.worth_timing(size, best_rate)]
        if untimed:
            return untimed[0]
        if best > 1 and RETIME_MARGIN * self.rate(1) > best_rate:  # plain decoding may be cheaper now
            if self.retimes.tick(free=not self.forecasting):
                return self._probe(1, RETIME_STEPS, self.retimes, best)
        if best > self.max_block and self.chain_probes.tick(free=not self.forecasting):
            return self._probe(self.max_block, PROBE_STEPS, self.chain_probes, best)
        if best == sizes[-1]:
            return best
        up = sizes[sizes.index(best) + 1]
        probes = self.tree_probes if up > self.max_block else self.probes
        if probes.tick(free=not self.forecasting):  # look one size up now and then
            if best == 1:
                return self._forecast(probe=True)
            return self._probe(up, PROBE_STEPS, probes, best)
        return best

    def _probe(self, size: int, steps: int, clock: Backoff, best: int) -> int:
        """Run ``size`` for ``steps`` cycles (the first not timed); its outcome settles ``clock``."""
        self.probing, self.repeats, self.probe_clock, self.probe_from = size, steps - 1, clock, best
        return size

    def _forecast(self, probe: bool) -> int:
        self.wants_forecast = self.forecasting = True
        self.forecast_is_probe = probe
        self.guess, self.guess_checked = None, 0
        return 1

    def start_forecast(self, guess: list[int], first_slot: int = 1) -> None:
        """The draft's guesses at the coming tokens, the first for slot ``first_slot`` of a
        block: a forecast's (slot 1: the token its plain step commits), or the one token a
        draft proposed past a block it got wholly accepted (that block's bonus token), so that
        a policy on short blocks still learns the slot after them."""
        self.guess, self.guess_checked, self.guess_from = guess, 0, first_slot

    def observe(self, committed: list[int]) -> None:
        """Tokens a cycle committed: the next slots of a forecast, checked against them."""
        for token in committed:
            if self.guess is None:
                return
            hit = token == self.guess[self.guess_checked]
            slot = self.guess_from + self.guess_checked
            self.guess_checked += 1
            self.slot_checked[slot] += 1
            self.slot_accepted[slot] += hit
            if not hit or self.guess_checked == len(self.guess):
                self._settle_forecast()

    def _settle_forecast(self) -> None:
        self.forecasting, self.guess = False, None
        if self.forecast_is_probe:  # like a probe's: it lost, look less often; it won, blocks win
            won = self.best(self.sizes) > 1
            self.probes.settle(won)
            self.forecast_is_probe = False

    def record_cycle(self, block: int, committed: list[int], seconds: Optional[float],
                     guess: Optional[list[int]]) -> None:
        """One finished cycle of ``block`` tokens that committed ``committed`` (its accepted
        drafts and the bonus token) in ``seconds`` (None: not timed); ``guess``: what its draft proposed past
        the verified tokens (a forecast beside a plain step, or one token past a short block),
        checked against the tokens still to come."""
        forecast = guess is not None and block == 1  # (its time holds a draft pass)
        self.record(block, len(committed), seconds, forecast=forecast)
        if guess is not None and len(committed) == block:  # the guesses start after this cycle's last token
            self.start_forecast(guess, first_slot=block)
            self.observe(committed[-1:])
        else:
            self.observe(committed)

    def record(self, block: int, acceptance: int, seconds: Optional[float], forecast: bool = False) -> None:
        """One finished cycle: its block size (possibly cut short by max_tokens), a + 1, wall
        time; ``forecast``: it also drafted a forecast, so its time is not its size's."""
        self.record_rows(block, [acceptance], seconds, forecast)

    def record_rows(self, block: int, acceptances: list[int], seconds: Optional[float], forecast: bool = False
                    ) -> None:
        """One finished cycle of a batch: every row's a + 1 (the acceptance the policy expects is
        the rows' mean: one cost buys them all), the cycle's wall time."""
        self.cycles += 1
        if self.history is not None:
            mean = acceptances[0] if len(acceptances) == 1 else sum(acceptances) / len(acceptances)
            self.history.append((block, mean, seconds, forecast))
        self.slot_checked = [n * self.slot_decay for n in self.slot_checked]
        self.slot_accepted = [n * self.slot_decay for n in self.slot_accepted]
        self.tree_tokens = {size: (t * self.slot_decay, c * self.slot_decay) for size, (t, c) in self.tree_tokens.items()}
        for acceptance in acceptances:
            self._count_slots(block, acceptance)
        self._time(block, seconds, forecast)

    def _count_slots(self, block: int, acceptance: int) -> None:
        """A cycle's drafts: each slot up to the first rejected one checked, those before it accepted."""
        accepted = acceptance - 1
        if block > self.max_block:  # a tree: its slots are not the chain's
            tokens, cycles = self.tree_tokens.get(block, (0.0, 0.0))
            self.tree_tokens[block] = (tokens + acceptance, cycles + 1)
            return
        for k in range(1, accepted + 1):
            self.slot_checked[k] += 1
            self.slot_accepted[k] += 1
        if accepted + 1 < block:  # the first rejected slot
            self.slot_checked[accepted + 1] += 1

    def _time(self, block: int, seconds: Optional[float], forecast: bool) -> None:
        """A cycle's wall time: its size's cost, where it is that size's steady cost."""
        steady, self.previous_block = self.previous_block == block, block
        if block not in self.sizes:  # a block of another size (a caller's own limit): no cost to learn
            return
        self.samples[block] = self.samples.get(block, 0) + 1
        # Only a cycle after one of its own size is timed: a size's steady cost. The first cycle
        # of a size carries one-off costs, and so does a switch: on a GPU the plain step queued
        # behind a block is built before the block's count is read, so it takes the masked
        # attention path. Charged to plain decoding, that kept it looking as dear as blocks
        # (tools/policy_simulation.py --switch-cost shows the effect).
        # A size run again after others may cost less now than when it was timed (warm-up
        # costs), so the first steady cycle of a run that is cheaper than believed is believed
        # at once. Dearer cycles only move the
        # average a little: one-off costs (a new compiled trace when the key buffers grow, the
        # machine's hiccups) only ever make a cycle dearer.
        timed = steady and not forecast and seconds is not None
        if timed:
            old = self.seconds.get(block)
            fresh = old is None or (self.timed_previous != block and seconds < old)
            self.seconds[block] = seconds if fresh else 0.8 * old + 0.2 * min(seconds, SPIKE_CAP * old)
        self.timed_previous = block if timed else None
        if block == self.probing and steady:  # a probe lost: look less often; it won: it is the new best
            self.probing, best = None, self.best(self.sizes)
            self.probe_clock.settle(best <= block if block < self.probe_from else best >= block)


class CycleClock:
    """A cycle's cost for the policy: the window from the previous host sync to its own, with
    the launches in it swapped for the cycle's own launch. A window holds the wait for this
    cycle and a launch: this cycle's, or, when the next cycle is queued ahead, the next one's
    (on a GPU most of the window: the host is the bottleneck, so a plain step followed by a
    block would be charged the block's launch, and the block a plain step's). A launch is
    graph building and, on the CPU, most of the run (there ``mx.async_eval`` of a large graph
    returns only near its end). The time the caller keeps the tokens (``pause`` to ``resume``)
    is in the window too: a window that is mostly that is not timed."""

    def __init__(self) -> None:
        self.synced = time.perf_counter()
        self.launched = 0.0  # host seconds of the launches since the latest sync
        self.away = 0.0  # seconds the caller kept the tokens since the latest sync
        self.paused: Optional[float] = None

    def restart(self) -> None:
        """Start a window now, with no launch in it (the first cycle's, at the prefill's read)."""
        self.synced, self.launched, self.away = time.perf_counter(), 0.0, 0.0

    def add_launch(self, seconds: float) -> None:
        self.launched += seconds

    def pause(self) -> None:
        """The tokens go to the caller (a generator yields them)."""
        self.paused = time.perf_counter()

    def resume(self) -> None:
        """The caller asks for the next cycle."""
        if self.paused is not None:
            self.away += time.perf_counter() - self.paused
            self.paused = None

    def cycle_seconds(self, own_launch: float) -> Optional[float]:
        """The cycle just read (its launch took ``own_launch``); starts the next window. None:
        not timed (the caller kept the tokens for most of the window)."""
        now = time.perf_counter()
        window, away = now - self.synced, self.away
        if self.paused is not None:  # (read while the caller has it: a batch's queued cycle read as rows join)
            away, self.paused = away + now - self.paused, now
        seconds = window - self.launched + own_launch
        self.synced, self.launched, self.away = now, 0.0, 0.0
        return None if away > AWAY_SHARE * window else seconds
