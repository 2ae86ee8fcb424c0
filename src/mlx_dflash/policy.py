"""Adaptive block size: never much slower than plain decoding when the draft is poor.

Each cycle the engine asks for a block size and reports back what it got and how
long the cycle took. The policy estimates, per draft slot k, the chance that slot k
is accepted given that slots 1..k-1 were, and the measured seconds per cycle of
each candidate size (1, 2, 4, 8, ... up to the draft's block); it picks the size with
the most expected tokens per second, E[min(L, b)] / cost(b). Block size 1 is plain
decoding (no draft pass). Where a verify costs the same for 1 or 16 tokens (a GPU)
full blocks win; where it grows with the block (a CPU) a weak draft is best used
with short blocks. While a smaller size wins, the next size up is still tried now
and then (less often each time it loses; a cheaper probe than a full block) so the
policy notices, one size at a time, when the text becomes predictable.

One policy can serve many generations (the server's and the benchmark's do): costs per
size belong to the machine and the model pair, so they carry over, and so does how rarely
probes pay (their back-off); a new text starts with one full block to learn its acceptance
(two for a policy that has not timed that size yet), not with exploration; the acceptance
statistics belong to one text and start afresh.
"""

from __future__ import annotations

PROBE_START = 16  # cycles between probes, doubled after each losing probe
PROBE_MAX = 256
WARMUP_CYCLES = 2  # full blocks first (the first is not timed), to learn the text's acceptance


def candidate_sizes(max_block: int) -> list[int]:
    """Plain decoding, the powers of two below the draft's block, and the block itself."""
    sizes, size = [], 1
    while size < max_block:
        sizes.append(size)
        size *= 2
    return sizes + [max_block]


class BlockPolicy:
    def __init__(self, max_block: int):
        self.max_block = max_block
        self.sizes = candidate_sizes(max_block)
        self.seconds: dict[int, float] = {}  # block size -> moving average seconds per cycle
        self.samples: dict[int, int] = {}  # block size -> cycles seen (the first is not timed)
        self.probe_every = PROBE_START
        self.start_text()

    def start_text(self) -> None:
        """A new generation: forget the acceptance seen so far, keep the measured costs and
        the probes' back-off."""
        self.slot_checked = [0] * self.max_block  # slot k: cycles whose slots 1..k-1 were all accepted
        self.slot_accepted = [0] * self.max_block
        self.cycles = 0
        self.since_probe = 0
        self.probing: int | None = None  # the size being probed, one above the best

    def expected_tokens(self, block: int) -> float:
        """E[min(L, block)]: the bonus token plus each drafted slot times P(it and all before it)."""
        expected, reach = 1.0, 1.0
        for k in range(1, block):
            checked = self.slot_checked[k]
            reach *= self.slot_accepted[k] / checked if checked else 1.0  # unseen slots: optimistic
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

    def choose(self, limit: int | None = None) -> int:
        """The next block size, at most ``limit`` (the tokens still wanted): every block is
        then a whole candidate size whose cost can be learned, also in short generations."""
        sizes = [size for size in self.sizes if limit is None or size <= limit]
        largest = sizes[-1]
        if largest == 1:
            return 1
        warmup = 1 if largest in self.seconds else WARMUP_CYCLES  # the first cycle of a size is not timed
        if self.cycles < warmup or not any(size > 1 for size in self.seconds):
            return largest  # warm-up: the largest block that fits, until one drafting size is timed
        if 1 not in self.seconds:
            return 1
        best = self.best(sizes)
        best_rate = self.rate(best)
        untimed = [size for size in sizes if size not in self.seconds and self.worth_timing(size, best_rate)]
        if untimed:
            return untimed[0]
        if best == largest:
            return best
        self.since_probe += 1
        if self.since_probe >= self.probe_every:  # a smaller size is winning: look one size up now and then
            self.since_probe = 0
            self.probing = sizes[sizes.index(best) + 1]
            return self.probing
        return best

    def record(self, block: int, acceptance: int, seconds: float) -> None:
        """One finished cycle: its block size (possibly cut short by max_tokens), a + 1, wall time."""
        self.cycles += 1
        accepted = acceptance - 1
        for k in range(1, accepted + 1):
            self.slot_checked[k] += 1
            self.slot_accepted[k] += 1
        if accepted + 1 < block:  # the first rejected slot
            self.slot_checked[accepted + 1] += 1
        if block not in self.sizes:  # a block of another size (a caller's own limit): no cost to learn
            return
        self.samples[block] = self.samples.get(block, 0) + 1
        # A size's first cycle carries one-off costs (CPU, SmolLM2: 142 ms for the first plain
        # step vs ~80); such outliers steered the policy wrong for a dozen cycles, so it is not timed.
        if self.samples[block] > 1:
            old = self.seconds.get(block)
            self.seconds[block] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if block == self.probing:  # a probe lost: look less often; it won: it is the new best
            self.probing = None
            won = self.best(self.sizes) >= block
            self.probe_every = PROBE_START if won else min(2 * self.probe_every, PROBE_MAX)
