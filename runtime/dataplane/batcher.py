"""``DraftBatcher``: one thread owns a replica's drafter and runs the calls of all its sessions as batched calls.

Every session (one gRPC stream, one request, served on its own thread) hands its drafter calls to the batcher and
waits for the answer; the worker takes whatever is pending, groups it, and calls the drafter once per group::

    session s0: propose([s0], 4) -+                         +-> row 0 -> s0's Proposal
    session s1: propose([s1], 4) -+-> drafter.propose([s0, s1, s2], 4) -> row 1 -> s1's Proposal
    session s2: propose([s2], 4) -+                         +-> row 2 -> s2's Proposal
    session s3: observe([v3])    ---> drafter.observe([v3])                       (same pass, its own group)

Groups, in this order per pass: release (frees memory first), begin, observe, observe_ahead, propose (by n),
branch (the overlap's rejection outcomes, ``Predraft``), extend (by n; the overlap's drafting ahead, so several
sessions drafting ahead share one forward too), grow (the same for every open chain of a row at once). Each
session has at most one call in flight (it waits for the answer), so the order between groups never reorders one
request's calls, and rows of one call are different requests, whose drafter state is independent: a session's
calls mean what they meant alone. Proposals are put first on the critical path: a pass runs proposes before the
speculative extends.

Why a row's answer does not change when batched. The drafters batch rows internally (one forward over all rows)
and draw each sampled row's tokens from that request's own generator (``torch.Generator`` per request, seeded from
the request's seed: text_lm, eagle, msd, flash, aasd, ensemble, massv / caption / pooled through text_lm, random),
each row consuming only its own draws (``runtime.sampling.draw_uniforms``), so a seeded request drafts the same
tokens alone or batched; greedy rows are argmaxes (up to floating-point differences of a padded batched forward,
which, like any drafter difference, cannot change the output: the verifier decides). What batching does change:
an unseeded request's seed comes from the drafter's own seeder in begin order, and concurrent begins come in no
fixed order (already so without batching). A greedy row batched with sampled rows gets one-hot q rows from some
drafters where alone it gets ``q=None``; that is the same law (the verifiers read None as one-hot), and the split
below turns an all-one-hot row back into ``q=None`` so the wire carries what it would alone.

Window and size: with ``wait_ms`` 0 a pass takes what is pending right now (calls arriving while the drafter runs
wait for the next pass, so batches form by themselves under load); ``wait_ms`` > 0 holds a pass open that long
after its first call (or until ``max_batch_size`` calls are pending) to gather more. A group larger than
``max_batch_size`` rows runs as several calls.

Errors: a drafter exception fails exactly the calls whose rows were in the failing drafter call (their sessions
end with an Error frame and decode alone on the verifier side); other groups of the same pass, and later passes,
go on. A failed batched ``release`` is retried one call at a time, so one bad row does not leak the others' state.
Without a running worker (before ``start``, after ``stop``) calls run on the caller's thread under a lock: the old
one-at-a-time path, which also lets sessions that outlive ``stop`` free their state.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from specula.drafters.protocol import Proposal, supports_lockstep, supports_lookahead, supports_predraft

log = logging.getLogger(__name__)

OPS = ("release", "begin", "observe", "observe_ahead", "propose", "branch", "extend", "grow")  # the order of a pass
_ROWS = ("propose", "extend")  # answered with Proposal rows
_STOP = object()


class _Call:
    """One session's drafter call: ``rows`` (request ids, contexts or verdicts), waiting for its answer."""

    __slots__ = ("op", "rows", "n", "done", "result", "error")

    def __init__(self, op: str, rows: Sequence, n: int) -> None:
        self.op, self.rows, self.n = op, list(rows), n
        self.done = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def finish(self, result=None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class DraftBatcher:
    """Runs drafter calls from many threads as batched calls on one worker thread.

    Args:
        drafter: the replica's drafter (``specula.drafters.Drafter``; ``extend`` / ``observe_ahead`` when it drafts
            ahead); only the worker calls it while the worker runs.
        max_batch_size: most rows in one drafter call (>= 1).
        wait_ms: how long a pass waits after its first call for more (0 = take what is pending now).
        on_call: optional ``f(op, n_rows)`` after each drafter call (tests and metrics count batches with it).
        compute: a ``ComputeThread`` (runtime/engine/compute_thread.py) to be the worker, e.g. the one the drafter
            was built on, so all of the replica's torch work stays on one thread; default: a thread of its own.
    """

    def __init__(self, drafter, *, max_batch_size: int = 64, wait_ms: float = 0.0, on_call=None,
                 compute=None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if wait_ms < 0:
            raise ValueError(f"wait_ms must be >= 0, got {wait_ms}")
        self.drafter, self.max_batch_size, self.wait_s = drafter, int(max_batch_size), float(wait_ms) / 1e3
        self.on_call = on_call
        self._q: queue.Queue = queue.Queue()
        self._state = threading.Lock()  # running <-> stopped, against submissions
        self._drafter_lock = threading.Lock()  # the worker's pass, or an inline call
        self._thread: threading.Thread | None = None
        self._compute, self._worker = compute, None  # the worker as a call on ``compute``: its Future
        self._running = False
        self.calls = 0  # drafter calls made (all ops)
        self.rows = 0  # rows they carried

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        with self._state:
            if self._running:
                return
            self._running = True
            if self._compute is not None:  # the worker occupies that thread until stop
                self._worker = self._compute.submit(self._work)
                return
            self._thread = threading.Thread(target=self._work, daemon=True, name="drafter-batcher")
            self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Finish what is queued, then stop the worker; later calls run inline."""
        with self._state:
            if not self._running:
                return
            self._running = False
            self._q.put(_STOP)
            thread, worker = self._thread, self._worker
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if worker is not None and not self._compute.is_current():
            concurrent.futures.wait([worker], timeout)

    @property
    def running(self) -> bool:
        return self._running

    def pending(self, op: str | None = None) -> int:
        """Calls waiting for the worker (of kind ``op``, or all); a snapshot: other threads go on adding."""
        with self._q.mutex:
            return sum(1 for c in self._q.queue if isinstance(c, _Call) and (op is None or c.op == op))

    # ------------------------------------------------------------------------------------------- the protocol

    def begin(self, contexts: Sequence) -> None:
        self._submit("begin", contexts)

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        return self._submit("propose", request_ids, int(gamma))

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        return self._submit("extend", request_ids, int(n))

    def observe(self, verdicts: Sequence) -> None:
        self._submit("observe", verdicts)

    def observe_ahead(self, verdicts: Sequence) -> None:
        self._submit("observe_ahead", verdicts)

    def release(self, request_ids: Sequence[str]) -> None:
        self._submit("release", request_ids)

    def branch(self, rows: Sequence[tuple[str, int]]) -> list:
        return self._submit("branch", rows)

    def grow(self, request_ids: Sequence[str]) -> list:
        return self._submit("grow", request_ids)

    # ------------------------------------------------------------------------------------------- internals

    def _submit(self, op: str, rows: Sequence, n: int = 0):
        call = _Call(op, rows, n)
        with self._state:
            queued = self._running
            if queued:
                self._q.put(call)
        if not queued:  # no worker: the caller's thread, one call at a time
            with self._drafter_lock:
                self._run([call])
        else:
            call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _work(self) -> None:
        stop = False
        while not stop:
            first = self._q.get()
            if first is _STOP:
                break
            calls = [first]
            deadline = time.monotonic() + self.wait_s
            while True:  # what is pending now, or within the window
                try:
                    left = deadline - time.monotonic()
                    item = self._q.get(timeout=left) if left > 0 and len(calls) < self.max_batch_size \
                        else self._q.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stop = True
                    break
                calls.append(item)
            with self._drafter_lock:
                self._pass(calls)

    def _pass(self, calls: list[_Call]) -> None:
        try:
            groups: dict[tuple[str, int], list[_Call]] = {}
            for c in calls:
                groups.setdefault((c.op, c.n), []).append(c)
            for key in sorted(groups, key=lambda k: (OPS.index(k[0]), k[1])):
                group = groups[key]
                for chunk in _chunks(group, self.max_batch_size):
                    self._run(chunk)
        except BaseException as e:  # never leave a session waiting, whatever happened here
            for c in calls:
                if not c.done.is_set():
                    c.finish(error=RuntimeError(f"drafter worker failed: {type(e).__name__}: {e}"))
            log.exception("drafter batcher pass failed")

    def _run(self, calls: list[_Call]) -> None:
        """One drafter call for ``calls`` (same op and n); answers each, or fails each with the drafter's error."""
        op, n = calls[0].op, calls[0].n
        rows = [r for c in calls for r in c.rows]
        try:
            fn = getattr(self.drafter, op)
            out = fn(rows, n) if op in _ROWS else fn(rows)
            self.calls += 1
            self.rows += len(rows)
            if self.on_call is not None:
                self.on_call(op, len(rows))
        except Exception as e:
            if op == "release" and len(calls) > 1:  # free what can be freed: one call at a time
                for c in calls:
                    self._run([c])
                return
            for c in calls:
                c.finish(error=e)
            return
        if op in ("branch", "grow"):  # one answer per row
            if not isinstance(out, list) or len(out) != len(rows):
                err = RuntimeError(f"drafter {op} answered {out!r} for {len(rows)} rows")
                for c in calls:
                    c.finish(error=err)
                return
            lo = 0
            for c in calls:
                c.finish(out[lo:lo + len(c.rows)])
                lo += len(c.rows)
            return
        if op not in _ROWS:
            for c in calls:
                c.finish()
            return
        if len(out.counts) != len(rows):
            err = RuntimeError(f"drafter {op} answered {len(out.counts)} rows for {len(rows)} requests")
            for c in calls:
                c.finish(error=err)
            return
        lo = 0
        for c in calls:
            hi = lo + len(c.rows)
            c.finish(_rows(out, lo, hi) if len(calls) > 1 else out)
            lo = hi


def _chunks(group: list[_Call], size: int) -> list[list[_Call]]:
    """Calls packed into chunks of at most ``size`` rows (a call is never split; a bigger one runs alone)."""
    out: list[list[_Call]] = []
    cur: list[_Call] = []
    rows = 0
    for c in group:
        if cur and rows + len(c.rows) > size:
            out.append(cur)
            cur, rows = [], 0
        cur.append(c)
        rows += len(c.rows)
    if cur:
        out.append(cur)
    return out


def _rows(p: Proposal, lo: int, hi: int) -> Proposal:
    """Rows ``lo:hi`` of a batched Proposal, as a Proposal of their own; q None when every node's q is one-hot at
    its own token (what a deterministic row gets alone; the same law)."""
    counts = tuple(int(c) for c in p.counts[lo:hi])
    q = p.q[lo:hi] if p.q is not None else None  # [b, N, V]
    if q is not None:
        live = [(b, i) for b, c in enumerate(counts) for i in range(c)]
        if not live:
            q = None
        else:
            bs = torch.tensor([b for b, _ in live])
            ns = torch.tensor([i for _, i in live])
            toks = p.tokens[lo:hi].to(q.device)[bs.to(q.device), ns.to(q.device)]  # [L]
            if bool((q[bs.to(q.device), ns.to(q.device), toks] == 1.0).all()):
                q = None
    return replace(p, request_ids=tuple(p.request_ids[lo:hi]), tokens=p.tokens[lo:hi], counts=counts,
                   parents=p.parents[lo:hi] if p.parents is not None else None, q=q)


class BatchedView:
    """A Drafter-shaped handle on a ``DraftBatcher`` for the requests of one (sub-)drafter, so a session's
    ``overlap.Pipeline`` drafts through the batcher unchanged: ``spec`` and ``lookahead`` (``tree_lookahead``) are
    those of ``drafter`` (with a MultiDrafter: the request's own sub-drafter; the batcher still calls the
    MultiDrafter, which routes)."""

    def __init__(self, batcher: DraftBatcher, drafter) -> None:
        self._b, self.spec = batcher, drafter.spec
        self.lookahead = supports_lookahead(drafter)
        self.tree_lookahead = self.lookahead and drafter.spec.structure == "tree"
        self.predraft = supports_predraft(drafter)
        if not supports_lockstep(drafter):
            self.grow = None  # the session's drafter grows its branches one at a time

    def begin(self, contexts: Sequence) -> None:
        self._b.begin(contexts)

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        return self._b.propose(request_ids, gamma)

    def observe(self, verdicts: Sequence) -> None:
        self._b.observe(verdicts)

    def release(self, request_ids: Sequence[str]) -> None:
        self._b.release(request_ids)

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        return self._b.extend(request_ids, n)

    def observe_ahead(self, verdicts: Sequence) -> None:
        self._b.observe_ahead(verdicts)

    def branch(self, rows: Sequence[tuple[str, int]]) -> list:
        return self._b.branch(rows)

    def grow(self, request_ids: Sequence[str]) -> list:
        return self._b.grow(request_ids)
