"""``ComputeThread``: the one thread of a serving process that runs torch's parallel work.

Why one: torch's CPU kernels run on OpenMP, and each thread that enters a parallel region gets a pool of worker
threads of its own. Once a process holds more pool threads than it has cores (a model loaded on the replica's
constructor thread, then decoded on a loop thread: two pools of two on a 2-core machine), GNU OpenMP stops
spinning between regions and parks its workers on a futex, so every one of a forward's hundreds of regions pays a
wake-up. Measured on 2 cores (``reports/2026-12-06h-one-compute-thread-linux-x86_64-2c/``): a verify forward over
five tokens took 13 ms on a second thread against 8 ms when every torch call of the process ran on one thread.

So a serving process builds its models and decodes on this thread. Engines ``attach`` a stepper (an object with
``busy()`` and ``step()``): while any is busy the thread steps it, running submitted calls between steps; when none
is, it sleeps until a call comes::

    compute = compute_thread()                     # the process's, started on first use
    target = compute.call(load_target, path)       # runs there; the caller waits (or gets the exception)
    fut = compute.submit(fn, *args)                # a concurrent.futures.Future
    result = await compute.acall(fn, *args)        # from an event loop
    compute.attach(engine)                         # engine.step() runs there while engine.busy()

torch's thread count is per thread under OpenMP: ``torch.set_num_threads`` takes effect here only when called here
(``VerifierEngine.from_config`` does, through the replica's settings).

A stepper whose ``step`` raises is detached and its ``crashed(exc)`` called there; a submitted call never blocks on
another submitted call (they run in order), so a call must not wait for work that needs this thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading

log = logging.getLogger(__name__)


class ComputeThread:
    """A daemon thread that runs submitted calls in order and steps attached engines between them."""

    def __init__(self, name: str = "specula-compute") -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, args, kwargs, future) | None (stop)
        self._steppers: list = []  # only touched on the thread
        self._stopped = False  # set under _lock once the stop is taken: later calls are refused, never lost
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------- callers' side

    def is_current(self) -> bool:
        """True on this thread (a call made here runs at once instead of queueing behind itself)."""
        return threading.current_thread() is self._thread

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)``; its Future gets the result or the exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self._stopped and self._thread.is_alive():
                self._calls.put((fn, args, kwargs, fut))
                return fut
        fut.set_exception(RuntimeError("the compute thread is not running"))
        return fut

    def call(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on this thread, waited for; raises what it raised."""
        if self.is_current():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    async def acall(self, fn, *args, **kwargs):
        """``call`` for an event loop: awaits the result without blocking the loop."""
        import asyncio

        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    def attach(self, stepper) -> None:
        """Step ``stepper`` (``busy() -> bool``, ``step()``, ``crashed(exc)``) whenever it is busy."""
        self.call(self._steppers.append, stepper)

    def detach(self, stepper) -> None:
        """Stop stepping ``stepper`` (nothing if it is not attached)."""
        self.call(self._remove, stepper)

    def stop(self, timeout: float = 30.0) -> None:
        """End the thread after the calls queued before this one (for tests; a process's thread lives with it)."""
        self._calls.put(None)
        if not self.is_current():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------- the thread

    def _remove(self, stepper) -> None:
        if stepper in self._steppers:
            self._steppers.remove(stepper)

    def turn(self, block: bool = False) -> None:
        """On this thread: every call queued so far, then one step of each busy stepper. ``block``: when nothing is
        busy, wait for a call first. A caller already on the thread (a benchmark driving a verifier from here)
        turns it itself while it waits for its answer."""
        if not self.is_current():
            raise RuntimeError("turn() runs on the compute thread only")
        busy = any(self._guard(s, s.busy) for s in list(self._steppers))
        try:  # asleep until a call comes when nothing is busy and block; else only what is queued already
            item = self._calls.get(block=block and not busy)
            while item is not None:  # every call queued so far runs before the next step
                self._do(*item)
                item = self._calls.get_nowait()
            self._take_stop()
            return
        except queue.Empty:
            pass
        for s in list(self._steppers):
            if s in self._steppers and self._guard(s, s.busy):
                self._guard(s, s.step)

    def _take_stop(self) -> None:
        """The stop marker came: refuse new calls, and fail those queued behind the marker (nobody waits forever)."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[3].set_running_or_notify_cancel():
                item[3].set_exception(RuntimeError("the compute thread is not running"))

    def _run(self) -> None:
        while not self._stopped:
            self.turn(block=True)

    @staticmethod
    def _do(fn, args, kwargs, fut) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # the caller gets it; the thread goes on
            fut.set_exception(e)

    def _guard(self, stepper, method):
        """``method()`` of ``stepper``; if it raises (a bug in the stepper itself), the stepper is dropped and told
        (``crashed``) and the thread goes on; then False."""
        try:
            return method()
        except BaseException as e:
            self._remove(stepper)
            log.exception("compute thread: %r crashed", stepper)
            try:
                stepper.crashed(e)
            except Exception:
                log.exception("compute thread: %r failed to clean up", stepper)
            return False


_shared: ComputeThread | None = None
_shared_lock = threading.Lock()


def compute_thread() -> ComputeThread:
    """This process's compute thread (started on first use; a new one if the last was stopped)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.is_alive():
            _shared = ComputeThread()
        return _shared
