"""The server's batch: requests decoded together (continuous batching, ``batch.py``).

Requests wait in ``pending``; before each cycle the worker merges them into the batch (each
prompt prefilled alone) and drops the rows whose client went away or whose text ended at a stop
string, then runs one cycle for all rows and hands each request its committed tokens; a row
that reached an EOS or its ``max_tokens`` in that cycle leaves at once. The cycles run back to
back on the server's model thread while it holds the server's lock, and the handlers take their
tokens meanwhile on the event loop; when someone else waits for the lock (a generation outside
the batch: a seeded request, or one that came alone) the batch gives it a turn after the cycle
in progress, so that generation's cycles run between the batch's.

The event loop and the model thread share one interpreter: every piece a handler streams (its
text decoded, a chunk formatted and written) is time the model thread, building a cycle's graphs,
may wait for. With ``stream_interval`` a request's tokens of the cycles that end within that many
seconds of its last piece go out together: a busy batch hands each client fewer, larger pieces.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

import mlx.core as mx

from .batch import BatchDecoder
from .generate import StreamResponse, TextStream
from .mlx_thread import MLXThread, ModelLock
from .sampling import SamplingParams

# Off (a piece a cycle) until pieces shared out over a stream interval are shown to serve faster
# (docs/performance.md).
DEFAULT_STREAM_INTERVAL = 0.0


@dataclass
class BatchRequest:
    prompt: list[int]
    max_tokens: int
    text: TextStream
    sampling: Optional[SamplingParams] = None  # None: greedy
    tokens: asyncio.Queue = field(default_factory=asyncio.Queue)  # committed tokens per cycle; None: the end
    row: Optional[int] = None
    reused_prompt_tokens: int = 0
    leaving: bool = False  # a stop string ended its text or its client went away: drop the row next cycle
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # its end (None) or an error is queued
    held: list = field(default_factory=list)  # that end, taken from the queue early (``BatchWorker._piece``)

    def give(self, item: object) -> None:
        """Queue a cycle's committed tokens, or the end (None), or an error (on the event loop)."""
        self.tokens.put_nowait(item)
        if not isinstance(item, list):
            self.ended.set()


class BatchWorker:
    """Runs the batch's cycles while it has rows or requests waiting (at most ``max_rows`` rows)."""

    def __init__(self, decoder: BatchDecoder, lock: ModelLock, thread: MLXThread, max_rows: int,
                 stream_interval: float = DEFAULT_STREAM_INTERVAL):
        self.decoder, self.lock, self.thread, self.max_rows = decoder, lock, thread, max_rows
        self.stream_interval = stream_interval  # seconds a request's tokens may wait to go out together
        self.pending: list[BatchRequest] = []
        self.active: dict[int, BatchRequest] = {}
        self.task: Optional[asyncio.Task] = None
        self.cycles = self.peak_rows = 0  # (``/health``)
        self.moved_in = 0  # generations moved in from the single-sequence engine (texts that came with tokens)

    @property
    def busy(self) -> bool:
        """Rows in the batch or requests waiting to join it."""
        return bool(self.pending or self.active)

    async def stream(self, request: BatchRequest, disconnected) -> AsyncIterator[StreamResponse]:
        """``request``'s responses, one per cycle it took part in; stops when ``disconnected()``.
        A text that holds tokens already (a generation moved in) goes on after them; the decode
        rate is of the tokens made here."""
        self.pending.append(request)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        tic, verifies, earlier, sent = time.perf_counter(), 0, len(request.text.tokens), None
        self.moved_in += earlier > 0
        try:
            while not await disconnected():
                committed, cycles = await self._piece(request, sent)
                if committed is None:
                    return
                if isinstance(committed, Exception):  # (the batch failed: every request in it fails)
                    raise committed
                segment, new = request.text.add(committed)
                if sent is None:  # (the prefill's token, alone)
                    prefill_s, tic, cycles = time.perf_counter() - tic, time.perf_counter(), 0
                verifies += cycles
                sent = time.perf_counter()
                elapsed = sent - tic
                yield StreamResponse(segment, new, len(committed) if cycles else None, verifies, len(request.prompt),
                                     prefill_s, len(request.text.tokens),
                                     max(len(request.text.tokens) - earlier - 1, 0) / elapsed if elapsed > 0 else 0.0,
                                     request.text.finish_reason, request.reused_prompt_tokens, cycles)
                if request.text.finish_reason:
                    return
        finally:
            request.leaving = True

    async def _piece(self, request: BatchRequest, since: Optional[float]) -> tuple[object, int]:
        """(``request``'s next item: committed tokens, None at its end, or an error; how many
        cycles' tokens it holds). With ``stream_interval``, the tokens of the cycles that end
        until that many seconds after ``since`` (its last piece; None: none yet, the first goes
        alone) come together; its end does not wait."""
        item = request.held.pop() if request.held else await request.tokens.get()
        if not isinstance(item, list) or self.stream_interval <= 0 or since is None:
            return item, 1
        left = since + self.stream_interval - time.perf_counter()
        if left > 0 and not request.ended.is_set():
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(request.ended.wait(), left)
        tokens, cycles = list(item), 1
        while not request.tokens.empty():
            item = request.tokens.get_nowait()
            if not isinstance(item, list):
                request.held.append(item)
                break
            tokens.extend(item)
            cycles += 1
        return tokens, cycles

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.pending or self.active:
            try:
                async with self.lock.turn():
                    await self.thread.run(self._cycles, loop)
            except Exception as exc:  # the requests in the batch get the error; the batch starts afresh
                for request in [*self.active.values(), *self.pending]:
                    request.give(exc)
                self.decoder.clear()
                self.active, self.pending = {}, []
            await asyncio.sleep(0)  # (let handlers read their tokens and new requests arrive)

    def _cycles(self, loop: asyncio.AbstractEventLoop) -> None:
        """Cycles back to back (on the model thread) while the batch has work and nobody waits
        for the lock."""
        while self.busy:
            self._cycle(loop)
            if self.lock.waiting:
                return

    def stats(self) -> dict:
        return {"rows": len(self.active), "waiting": len(self.pending), "cycles": self.cycles,
                "peak_rows": self.peak_rows, "moved_in": self.moved_in,
                "block_sizes": dict(sorted(self.decoder.block_sizes.items()))}

    def _cycle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Join waiting requests, drop leaving rows, run one cycle (on the server's model thread).
        Requests get their tokens (None: their end) or their error at once."""

        def send(request: BatchRequest, tokens: object) -> None:
            loop.call_soon_threadsafe(request.give, tokens)

        while self.pending and len(self.active) < self.max_rows:
            request = self.pending.pop(0)
            if request.leaving:
                continue
            try:
                row = self.decoder.add(mx.array(request.prompt, dtype=mx.uint32), request.max_tokens, request.sampling,
                                       frozenset(request.text.eos))
            except Exception as exc:  # (its prefill failed: it fails alone, the batch goes on)
                send(request, exc)
                continue
            request.row, request.reused_prompt_tokens = row.id, row.reused_prompt_tokens
            if row.tokens:  # (else prefilled behind a queued cycle: its first token comes with the next step's)
                send(request, list(row.tokens))
            if request.row in self.decoder.rows:
                self.active[request.row] = request
            else:
                send(request, None)
        for row, request in list(self.active.items()):
            if request.leaving:
                self.decoder.remove(row)
                del self.active[row]
        if not self.active:
            return
        self.cycles, self.peak_rows = self.cycles + 1, max(self.peak_rows, len(self.active))
        for row, committed in self.decoder.step().items():
            # A row that reached its max_tokens or an EOS left in this cycle, and leaves the worker
            # before its client hears: a request that comes next then finds the batch empty and runs alone.
            left = row not in self.decoder.rows
            request = self.active.pop(row) if left else self.active[row]
            for item in [committed, None] if left else [committed]:
                send(request, item)
