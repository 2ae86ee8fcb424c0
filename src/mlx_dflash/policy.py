"""Adaptive block size: never much slower than plain decoding when the draft is poor.

Each cycle the engine asks for a block size and reports back what it got and how
long the cycle took. The policy keeps the acceptance-length histogram of full
blocks and the measured seconds per cycle of each block size it has used, and
picks the size with the most expected tokens per second: E[min(L, b)] / cost(b).
Block size 1 is plain decoding (no draft pass). While plain decoding wins, a full
block is still tried now and then (probing less often each time it loses) so the
policy notices when the text becomes predictable.
"""

from __future__ import annotations

PROBE_START = 16  # cycles between probes, doubled after each losing probe
PROBE_MAX = 256
WARMUP_CYCLES = 4  # full blocks first, to learn the draft's acceptance


class BlockPolicy:
    def __init__(self, max_block: int):
        self.max_block = max_block
        self.histogram = [0] * (max_block + 1)  # acceptance lengths seen with full blocks
        self.seconds: dict[int, float] = {}  # block size -> moving average seconds per cycle
        self.samples: dict[int, int] = {}  # block size -> cycles seen (the first is not timed)
        self.cycles = 0
        self.probe_every = PROBE_START
        self.since_probe = 0

    def expected_tokens(self, block: int) -> float:
        total = sum(self.histogram)
        if not total:
            return float(block)
        return sum(count * min(length, block) for length, count in enumerate(self.histogram)) / total

    def rate(self, block: int) -> float:
        return self.expected_tokens(block) / self.seconds[block]

    def choose(self) -> int:
        if self.max_block == 1:
            return 1
        if self.cycles < WARMUP_CYCLES or self.max_block not in self.seconds:
            return self.max_block
        if 1 not in self.seconds:
            return 1
        if self.rate(self.max_block) >= self.rate(1):
            return self.max_block
        self.since_probe += 1
        if self.since_probe >= self.probe_every:  # plain decoding is winning: look again now and then
            self.since_probe = 0
            return self.max_block
        return 1

    def record(self, block: int, acceptance: int, seconds: float) -> None:
        """One finished cycle: its block size (possibly cut short by max_tokens), a + 1, wall time."""
        self.cycles += 1
        self.samples[block] = self.samples.get(block, 0) + 1
        # A size's first cycle carries one-off costs (CPU, SmolLM2: 19 ms for the first 16-block
        # vs ~200 steady, 142 ms for the first plain step vs ~80); such outliers steered the
        # policy wrong for a dozen cycles, so it is not timed.
        if self.samples[block] > 1:
            old = self.seconds.get(block)
            self.seconds[block] = seconds if old is None else 0.8 * old + 0.2 * seconds
        if block == self.max_block:
            self.histogram[acceptance] += 1
            if 1 in self.seconds and self.rate(self.max_block) < self.rate(1):
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
            else:
                self.probe_every = PROBE_START
