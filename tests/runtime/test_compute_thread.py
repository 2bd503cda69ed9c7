"""The process's compute thread (runtime/engine/compute_thread.py): calls run there in order and hand back their
result or exception, attached steppers are stepped while busy with the calls run between their steps, and a stepper
that crashes is dropped and told while the thread goes on."""

from __future__ import annotations

import threading

import pytest

from specula.runtime.engine.compute_thread import ComputeThread, compute_thread


@pytest.fixture
def compute():
    t = ComputeThread(name="test-compute")
    yield t
    t.stop()


class Stepper:
    """Busy for ``steps`` steps; records each step and the thread it ran on; step ``submit_at`` queues a call."""

    def __init__(self, compute: ComputeThread, steps: int, submit_at: int = -1, fail_at: int = -1) -> None:
        self.compute, self.left, self.submit_at, self.fail_at = compute, steps, submit_at, fail_at
        self.log: list = []
        self.threads: set[str] = set()
        self.done = threading.Event()
        self.crash: BaseException | None = None

    def busy(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        i = len([e for e in self.log if e[0] == "step"])
        self.threads.add(threading.current_thread().name)
        if i == self.fail_at:
            raise RuntimeError("bug in step")
        self.log.append(("step", i))
        if i == self.submit_at:
            self.compute.submit(self.log.append, ("call", i))
        self.left -= 1
        if self.left == 0:
            self.done.set()

    def crashed(self, exc: BaseException) -> None:
        self.crash = exc
        self.done.set()


def test_calls_run_on_the_thread_in_order_and_hand_back_results_and_exceptions(compute):
    order = []
    futures = [compute.submit(lambda i=i: order.append((i, threading.current_thread().name)) or i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == list(range(5))
    assert order == [(i, "test-compute") for i in range(5)]
    with pytest.raises(ZeroDivisionError):
        compute.call(lambda: 1 / 0)
    assert compute.call(lambda: compute.is_current()) is True  # the thread goes on after a failed call
    assert not compute.is_current()
    assert compute.call(lambda: compute.call(lambda: 7)) == 7  # a call made on the thread runs at once


def test_a_busy_stepper_is_stepped_with_queued_calls_run_between_its_steps(compute):
    s = Stepper(compute, steps=5, submit_at=2)
    compute.attach(s)
    assert s.done.wait(10)
    assert s.log == [("step", 0), ("step", 1), ("step", 2), ("call", 2), ("step", 3), ("step", 4)]
    assert s.threads == {"test-compute"}
    assert compute.call(lambda: "idle then awake") == "idle then awake"  # asleep when nothing is busy, not stuck
    s.done.clear()

    def busy_again():
        s.left = 2

    compute.call(busy_again)  # a call that makes the stepper busy wakes the stepping
    assert s.done.wait(10)
    assert s.log[-2:] == [("step", 5), ("step", 6)] and s.left == 0
    compute.detach(s)
    assert s not in compute.call(lambda: list(compute._steppers))


def test_a_stepper_that_raises_is_dropped_and_told_and_the_thread_goes_on(compute):
    bad, good = Stepper(compute, steps=10, fail_at=1), Stepper(compute, steps=3)
    compute.attach(bad)
    compute.attach(good)
    assert bad.done.wait(10) and good.done.wait(10)
    assert isinstance(bad.crash, RuntimeError) and str(bad.crash) == "bug in step"
    assert bad.log == [("step", 0)] and bad.left == 9  # never stepped again
    assert good.log == [("step", i) for i in range(3)]
    assert compute.call(lambda: 42) == 42


def test_a_stopped_thread_refuses_calls_and_the_process_gets_a_new_shared_one():
    t = ComputeThread(name="to-stop")
    gate = threading.Event()
    t.submit(gate.wait, 10)  # holds the thread while more is queued
    before = t.submit(lambda: "before the stop")
    t._calls.put(None)  # the stop marker, then a call queued behind it: failed, not left waiting
    behind = t.submit(lambda: "behind the stop")
    gate.set()
    assert before.result(timeout=10) == "before the stop"
    with pytest.raises(RuntimeError, match="not running"):
        behind.result(timeout=10)
    t.stop()
    assert not t.is_alive()
    with pytest.raises(RuntimeError, match="not running"):
        t.submit(lambda: 1).result(timeout=5)
    shared = compute_thread()
    assert shared is compute_thread() and shared.is_alive()
    assert shared.call(threading.current_thread).name == "specula-compute"


def test_every_bench_command_runs_on_the_compute_thread():
    """``specula bench ...`` runs its command on the process's compute thread, so a benchmark's in-process engines
    share one OpenMP pool with any verifier it starts (the served replica's situation)."""
    import argparse

    from specula.cli import bench

    parser = argparse.ArgumentParser()
    bench.register(parser.add_subparsers())
    commands = parser._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0].choices
    assert set(commands) == {"target", "spec", "report", "distributed", "outcomes", "reference", "served"}
    for name, sub in commands.items():
        func = sub.get_default("func")
        assert func.__wrapped__.__name__ == f"run_{name}", name  # on_compute_thread's wrapper
    ran = []
    wrapped = bench.on_compute_thread(lambda args: ran.append((args, threading.current_thread().name)) or 3)
    assert wrapped("a") == 3 and ran == [("a", "specula-compute")]


def test_acall_awaits_the_call_on_the_thread_without_blocking_the_event_loop(compute):
    import asyncio

    gate = threading.Event()

    async def main():
        waiting = asyncio.ensure_future(compute.acall(lambda: (gate.wait(10), threading.current_thread().name)[1]))
        await asyncio.sleep(0.01)  # the loop runs on while the call waits on the thread
        assert not waiting.done()
        gate.set()
        return await waiting

    assert asyncio.run(main()) == "test-compute"
