"""Admission control of one ingress replica: at most ``max_concurrent`` requests run, at most ``max_queued`` wait;
the next one is refused at once (``Overloaded`` -> HTTP 503 / gRPC RESOURCE_EXHAUSTED), so overload never hangs.

    admission = Admission(max_concurrent=64, max_queued=64)
    async with admission.slot():        # raises Overloaded when full; waits in FIFO order otherwise
        ...run the request...

HTTP and gRPC share one ``Admission`` per replica. Not thread-safe: use it from the replica's event loop.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager


class Overloaded(RuntimeError):
    """Every slot is taken and the queue is full."""


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int) -> None:
        if max_concurrent < 1 or max_queued < 0:
            raise ValueError(f"max_concurrent must be >= 1 and max_queued >= 0, got {max_concurrent}, {max_queued}")
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self.running = 0
        self._waiters: list[asyncio.Future] = []  # FIFO

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def slot(self):
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self.running < self.max_concurrent and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Overloaded(f"server busy: {self.running} requests running and {len(self._waiters)} queued "
                             f"(max_concurrent_requests={self.max_concurrent}, "
                             f"max_queued_requests={self.max_queued})")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # resolved by _release, which hands its slot over (running stays counted)
        except BaseException:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._release()  # the slot was handed to us as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.pop(0)
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
