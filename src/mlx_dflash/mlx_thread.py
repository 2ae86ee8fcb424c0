"""The one thread a server runs its model work on.

MLX gives every thread that uses it a default stream of its own, served by a thread of MLX's.
Model calls made from a pool of worker threads left one such stream per pool thread, and the
process aborted at exit ("terminate called without an active exception") while MLX destroyed
them. The server makes every model call on one thread instead, which frees its streams
(``mx.clear_streams``) when the server shuts down. Its batch decoder is built and warmed up there
too: built and warmed on the main thread, it slowed the generations run on this one (GPUs).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import mlx.core as mx

T = TypeVar("T")


class MLXThread:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.closed = False

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the thread, awaited without blocking the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the thread, waited for (before an event loop runs)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Free the thread's MLX streams and end it (calls already queued finish first); again: nothing."""
        if not self.closed:
            self.closed = True
            self._executor.submit(mx.clear_streams).result()
            self._executor.shutdown(wait=True)
