"""The one thread a server runs its model work on, and the lock that gives out turns on it.

MLX gives every thread that uses it a default stream of its own, served by a thread of MLX's.
Model calls made from a pool of worker threads left one such stream per pool thread, and the
process aborted at exit ("terminate called without an active exception") while MLX destroyed
them. The server makes every model call on one thread instead, which frees its streams
(``mx.clear_streams``) when the server shuts down. Its batch decoder is built and warmed up there
too: built and warmed on the main thread, it slowed the generations run on this one (GPUs).

A generation runs its cycles back to back there (``pump``) while nobody waits for a turn: a
cycle's host work starts as soon as the one before is read, not after a round trip through the
event loop, which hands the tokens over meanwhile.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterator, Optional, TypeVar

import mlx.core as mx

T = TypeVar("T")


class ModelLock:
    """An asyncio lock (waiters served in arrival order) that counts its waiters, so work
    running on the model thread can tell that someone wants a turn."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()
        self.waiting = 0  # (read from the model thread: an int, read whole)

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        self.waiting += 1
        try:
            await self._lock.acquire()
        finally:
            self.waiting -= 1
        try:
            yield
        finally:
            self._lock.release()


class _Paused:
    """The end of one ``pump``: ``go_on`` said stop (or the caller left)."""


class MLXThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.closed = False
        self.started = time.perf_counter()
        self.busy_seconds = 0.0  # spent running calls (waits for the device included): the rest it sat idle

    def _timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        tic = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy_seconds += time.perf_counter() - tic

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread, waited for (before an event loop runs)."""
        return self._executor.submit(self._timed, fn, *args, **kwargs).result()

    def stats(self) -> dict:
        """Seconds since the thread started, and of them spent running calls (``/health``: over a
        stretch of streaming, a busy share well under 1 means the model waited for the event loop);
        and the interpreter's switch interval: how long the thread may wait for the lock the event
        loop holds before the loop is made to let go."""
        return {"up_s": round(time.perf_counter() - self.started, 4), "busy_s": round(self.busy_seconds, 4),
                "switch_interval_s": sys.getswitchinterval()}

    async def pump(self, items: Iterator[T], go_on: Callable[[], bool]) -> AsyncIterator[Optional[T]]:
        """``items``' next items, made one after another on the thread and each handed over as
        it is made, until ``go_on()`` (asked on the thread after each item) is false; then None
        if ``items`` ran out. An error of ``items`` is raised here. Leaving early (``aclose``)
        stops the thread after the item in progress; that item is lost."""
        loop, handed = asyncio.get_running_loop(), asyncio.Queue()
        stop = threading.Event()

        def produce() -> None:
            try:
                while True:
                    item = next(items, None)
                    loop.call_soon_threadsafe(handed.put_nowait, item)
                    if item is None or stop.is_set() or not go_on():
                        break
            except Exception as exc:  # (handed over, raised by the caller)
                loop.call_soon_threadsafe(handed.put_nowait, exc)
            loop.call_soon_threadsafe(handed.put_nowait, _Paused)

        self._executor.submit(self._timed, produce)
        try:
            while (item := await handed.get()) is not _Paused:
                if isinstance(item, Exception):
                    raise item
                yield item
                if item is None:
                    return
        finally:
            stop.set()

    def close(self) -> None:
        """Free the thread's MLX streams and end it (calls already queued finish first); again: nothing."""
        if not self.closed:
            self.closed = True
            self._executor.submit(mx.clear_streams).result()
            self._executor.shutdown(wait=True)
