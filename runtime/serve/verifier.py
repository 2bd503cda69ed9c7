"""``VerifierEngine``: the TargetVerifier deployment's engine (no Ray): each request's decode loop, on one target.

One thread owns the target and a ``SpecEngine`` whose drafter is a ``RemoteDrafter``: the speculative step is the
single-process one, only the drafts come over gRPC. That thread is the process's compute thread
(runtime/engine/compute_thread.py), which also loads the models: torch's parallel kernels run twice as slowly on a
small machine once a second thread of the process has used them. Requests join and leave the live batch between
steps (continuous batching), so a request's KV cache never leaves this engine::

    engine = VerifierEngine(target, drafter=RemoteDrafter(vocab_size=V), gamma=4)
    for chunk in engine.stream(GenerationRequest("r1", ids, params=SamplingParams(max_tokens=32)),
                               drafter_address="127.0.0.1:43127"):
        chunk["tokens"]       # tokens this step added; the last chunk has finished=True, finish_reason, metrics

    async for chunk in engine.astream(request, drafter_address=...):   # the same, for an event loop (Serve)

The last chunk also carries "dataplane": the request's time split seen from here (``verify_s``: target verify,
sample and commit; ``draft_s`` / ``idle_s`` / ``transfer_s``: waiting for proposals, split by what the drafter
reported, ``runtime/dataplane/remote_drafter.py``), ``ahead_s`` (drafting that overlapped verification), the pre-drafted
blocks used and dropped (``spec_used`` / ``spec_dropped``), wire bytes, the codec and the drafter that drafted;
None without a session. Its "metrics" name that drafter too (``metrics["drafter"]``, "" when none drafted).

If the drafter is unreachable, slow or broken the request decodes alone (the plain step), output unchanged, and its
last chunk says why under "drafter". If the target fails, every request in the failed step gets ``VerifierError``
(never a truncated answer) and the engine goes on with the next requests.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace

from specula.runtime.dataplane import RemoteDrafter
from specula.runtime.engine.compute_thread import ComputeThread, compute_thread
from specula.runtime.engine.drafter_route import route
from specula.runtime.engine.loop import GenerationRequest, SpecEngine, TokenEvent
from specula.targets.types import VisualFeatures

log = logging.getLogger(__name__)
Sink = Callable[[object], None]  # gets chunk dicts, then (instead of a finished chunk) maybe a VerifierError


class VerifierError(RuntimeError):
    """The target failed this request (or the engine stopped): the client must see an error, not a short answer."""


class VerifierEngine:
    """Continuous-batching speculative decoding on one target, drafts from remote drafter replicas.

    Args:
        target: a ``specula.targets.Target`` (only the loop thread touches it).
        drafter: the ``RemoteDrafter`` sessions go through; or a drafter of this process (``drafter.colocate``:
            the loop drafts itself, as ``SpecEngine`` in one process does); or None for plain decoding.
        drafter_name: the name a colocated drafter reports in each request's metrics when the request chose none.
        adaptive: a colocated drafter's draft length chosen per step by expected goodput (runtime/engine/adaptive.py).
        begin_after: a colocated drafter begins for a request once it has this many tokens (SpecEngine's).
        text_only: the drafter's name for requests without images that name none (config ``drafter.text_only``,
            runtime/engine/drafter_route.py); None = the default for all.
        gamma: draft tokens per block.
        eos_token_ids: default the target's.
        max_batch_size: live requests decoded together; more wait in arrival order.
        stream_interval_s: least time between two chunks ``astream`` yields for one request (the steps in between
            are merged into one chunk; the first token and the last chunk go at once); 0 = a chunk per step.
        compute: the thread that steps this engine and runs every torch call of it (default: the process's
            ``compute_thread()``, runtime/engine/compute_thread.py; ``from_config`` loads the models there too).
    """

    def __init__(self, target, drafter=None, *, gamma: int = 4, eos_token_ids=None, max_batch_size: int = 16,
                 stream_interval_s: float = 0.0, drafter_name: str = "", adaptive: bool = False,
                 begin_after: int = 0, text_only: str | None = None, compute: ComputeThread | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if stream_interval_s < 0:
            raise ValueError(f"stream_interval_s must be >= 0, got {stream_interval_s}")
        self.target, self.max_batch_size = target, max_batch_size
        self.remote = drafter if isinstance(drafter, RemoteDrafter) else None
        self.local = drafter if drafter is not None and self.remote is None else None
        self.stream_interval_s, self.drafter_name = stream_interval_s, drafter_name
        self.text_only = text_only if drafter is not None else None  # drafter_route.py
        self._chosen: dict[str, str] = {}  # request id -> the colocated drafter it drafts with
        self._compute = compute or compute_thread()
        self.engine = self._compute.call(
            SpecEngine, target, drafter, gamma=gamma if drafter is not None else 0, eos_token_ids=eos_token_ids,
            adaptive=adaptive and self.local is not None, begin_after=begin_after if self.local is not None else 0)
        # touched on the compute thread only, except _ids (under its lock): callers' threads refuse duplicates there
        self._waiting: deque[tuple[GenerationRequest, Sink]] = deque()
        self._sinks: dict[str, Sink] = {}
        self._ids: set[str] = set()  # submitted and not finished
        self._ids_lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._closed = False
        self._stopped = False
        self._compute.attach(self)

    @classmethod
    def from_config(cls, config) -> VerifierEngine:
        from specula.runtime.engine.factory import load_target_for, set_threads
        from specula.runtime.wire import WireLimits

        settings, d = config.deployments.target_verifier, config.drafter

        def build():  # on the compute thread: loading runs torch's parallel kernels, and they must stay on one thread
            set_threads(settings)
            target = load_target_for(config, settings.device)
            drafter = None
            if d.gamma > 0 and d.colocate:  # the drafter lives here, on the verifier's device
                from specula.runtime.engine.factory import make_drafter

                drafter = make_drafter(config, device=settings.device)
            elif d.gamma > 0:
                drafter = RemoteDrafter(vocab_size=target.info.vocab_size, codec_preference=d.codec_preference,
                                        limits=WireLimits(max_message_bytes=config.dataplane.max_message_bytes),
                                        propose_timeout_s=d.propose_timeout_s,
                                        connect_timeout_s=d.connect_timeout_s, overlap=d.overlap, offers=d.offers)
            return target, drafter

        compute = compute_thread()
        target, drafter = compute.call(build)
        return cls(target, drafter, gamma=d.gamma, max_batch_size=settings.max_batch_size,
                   stream_interval_s=settings.stream_interval_ms / 1000.0, drafter_name=d.default_name,
                   adaptive=d.adaptive, begin_after=d.begin_after, text_only=d.text_only, compute=compute)

    # ------------------------------------------------------------------------------------------- callers' side

    def submit(self, request: GenerationRequest, sink: Sink, drafter_address: str | None = None) -> None:
        """Queue ``request``; ``sink`` gets its chunks on the loop thread. Blocks while the drafter is described."""
        if self._closed or self._fatal is not None:
            raise VerifierError("the verifier is not running")
        with self._ids_lock:
            if request.request_id in self._ids:
                raise ValueError(f"request id {request.request_id!r} is already live")
            self._ids.add(request.request_id)
        request = route(request, self.text_only)  # a request without images that named no drafter
        if self.remote is not None:
            self.remote.attach(request.request_id, drafter_address)
            request = _keep_what_is_needed(request, self.remote.spec.needs)
        elif self.local is not None:
            self._chosen[request.request_id] = request.drafter or self.drafter_name
            request = _keep_what_is_needed(request, self.local.spec.needs)
        self._compute.submit(self._enqueue, request, sink)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step; its last chunk has finish_reason "cancelled"."""
        self._compute.submit(self._cancel, request_id)

    def stream(self, request: GenerationRequest, drafter_address: str | None = None) -> Iterator[dict]:
        """Chunks of one request, as the loop produces them; raises VerifierError if the target failed it. Called
        on the compute thread itself (a benchmark running there), it turns that thread until each chunk comes."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.submit(request, q.put, drafter_address)
        inline = self._compute.is_current()
        done = False
        try:
            while True:
                while inline and q.empty():
                    self._compute.turn()
                item = q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item["finished"]:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(request.request_id)

    async def astream(self, request: GenerationRequest, drafter_address: str | None = None) -> AsyncIterator[dict]:
        """``stream`` for an event loop: nothing blocks the loop; leaving early cancels the request. Chunks of steps
        that come within ``stream_interval_s`` of the last one sent are merged into one (``merge_chunks``) on the
        loop thread, before they wake the event loop: a request costs the event loop (and Ray's streaming) one
        message per interval, not one per step. Every step emits a chunk for each live request, and the last chunk
        is never held, so nothing stays pending. A request with ``streamed`` False (a whole answer, nothing to watch
        on the way) gets its first token's chunk and its last one only: every chunk wakes the event loop, whose
        thread then takes a core from the forward's OpenMP threads on a small machine (served captions ran about
        5% faster without the chunks between)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        held: dict = {"chunk": None, "sent": None}  # merged chunks not sent yet; when the last one was sent
        interval = self.stream_interval_s if request.streamed else math.inf  # whole answers: first and last only

        def sink(item) -> None:
            if not isinstance(item, BaseException):
                if held["chunk"] is not None:
                    item, held["chunk"] = merge_chunks(held["chunk"], item), None
                now = time.monotonic()
                if (interval > 0 and not item["finished"] and held["sent"] is not None
                        and now - held["sent"] < interval):
                    held["chunk"] = item  # within the interval: wait for the next step's
                    return
                held["sent"] = now
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the caller's loop is gone
                pass

        if self.remote is None:  # nothing in submit can block: queue it from the loop, no worker thread woken to
            self.submit(request, sink, drafter_address)  # fight the prefill it starts for the cores and the GIL
        else:  # describing a remote drafter waits on gRPC
            await asyncio.to_thread(self.submit, request, sink, drafter_address)
        done = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item["finished"]:
                    done = True
                    return
        finally:
            if not done:
                self.cancel(request.request_id)

    def generate(self, request: GenerationRequest, drafter_address: str | None = None) -> dict:
        """Run one request to the end: {"tokens", "finish_reason", "metrics", "drafter"}."""
        tokens: list[int] = []
        for chunk in self.stream(request, drafter_address):
            tokens.extend(chunk["tokens"])
        return {**chunk, "tokens": tokens}

    def check_health(self) -> None:
        if self._fatal is not None:
            raise VerifierError(f"the verifier loop died: {self._fatal!r}")
        if not self._compute.is_alive() and not self._closed:
            raise VerifierError("the verifier loop is not running")

    def close(self) -> None:
        """Stop stepping; requests still queued or live get VerifierError."""
        if self._closed:
            return
        self._closed = True
        if self._compute.is_alive():
            try:
                self._compute.call(self._shutdown, VerifierError("the verifier stopped"))
            except RuntimeError:  # the thread ended meanwhile
                pass
        if self.remote is not None:
            self.remote.close()

    # ------------------------------------------------------------------------------------------- the loop

    # the compute thread's stepper (runtime/engine/compute_thread.py): everything below runs on that thread

    def busy(self) -> bool:
        return not self._stopped and bool(self.engine.rows or self._waiting)

    def step(self) -> None:
        """Admit what waits (room permitting), then one step of every live request."""
        self._admit()
        if self.engine.rows:
            ids = list(self.engine.rows)
            try:
                events = self.engine.step()
            except Exception as e:
                self._fail(ids, e)
                return
            self._dispatch(events)

    def crashed(self, exc: BaseException) -> None:
        """A bug in the step itself (not a target failure): fail everyone, report unhealthy."""
        self._fatal = exc
        log.error("verifier loop died: %r", exc)
        self._shutdown(VerifierError(f"the verifier failed: {exc!r}"))

    def _shutdown(self, err: VerifierError) -> None:
        self._stopped = True
        self._compute.detach(self)
        self._fail(list(self.engine.rows), err)
        while self._waiting:
            self._send_error(self._waiting.popleft()[0].request_id, err)

    def _enqueue(self, request: GenerationRequest, sink: Sink) -> None:
        self._sinks[request.request_id] = sink
        if self._stopped:
            self._send_error(request.request_id, VerifierError("the verifier is not running"))
        else:
            self._waiting.append((request, sink))

    def _cancel(self, rid: str) -> None:
        for i, (r, _) in enumerate(self._waiting):
            if r.request_id == rid:
                del self._waiting[i]
                if self.remote is not None:
                    self.remote.release([rid])  # forget its drafter assignment; no session was opened
                self._dispatch([TokenEvent(rid, (), True, "cancelled")])
                return
        self.engine.cancel(rid)

    def _admit(self) -> None:
        room = self.max_batch_size - len(self.engine.rows)
        new = []
        while self._waiting and len(new) < room:
            new.append(self._waiting.popleft()[0])
        if not new:
            return
        try:
            self._dispatch(self.engine.add(new))
        except Exception as e:
            self.engine.abort([r.request_id for r in new])
            if len(new) == 1:
                self._fail([new[0].request_id], e)
                return
            for r in new:  # find the request that broke the batched prefill; the others go on
                try:
                    self._dispatch(self.engine.add([r]))
                except Exception as e1:
                    self.engine.abort([r.request_id])
                    self._fail([r.request_id], e1)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        for ev in events:
            chunk = {"request_id": ev.request_id, "tokens": list(ev.tokens), "finished": ev.finished,
                     "finish_reason": ev.finish_reason}
            if ev.finished:
                result = self.engine.finished.pop(ev.request_id, None)
                chunk["metrics"] = result.metrics.to_dict() if result is not None else None
                chunk["drafter"] = self._drafter_status(ev.request_id)
                chunk["dataplane"] = self._dataplane(ev.request_id, result)
                chosen = self._chosen.pop(ev.request_id, "")
                if chunk["metrics"] is not None:  # which drafter drafted (the request's choice): "" = none did
                    chunk["metrics"]["drafter"] = (chunk["dataplane"] or {}).get("drafter", chosen)
                sink = self._sinks.pop(ev.request_id, None)
                with self._ids_lock:
                    self._ids.discard(ev.request_id)
            else:
                sink = self._sinks.get(ev.request_id)
            if sink is not None:
                sink(chunk)

    def _drafter_status(self, rid: str) -> str:
        if self.local is not None:
            return "ok"
        if self.remote is None:
            return "off"
        reason = self.remote.fallbacks.pop(rid, None)
        return "ok" if reason is None else f"fallback: {reason}"

    def _dataplane(self, rid: str, result) -> dict | None:
        st = self.remote.pop_stats(rid) if self.remote is not None else None
        if st is not None and result is not None:
            t = result.metrics.time
            st["verify_s"] = round(t.get("verify", 0.0) + t.get("sample", 0.0) + t.get("commit", 0.0), 6)
        return st

    def _fail(self, ids: list[str], exc: BaseException) -> None:
        if not ids:
            return
        log.error("verifier failed requests %s: %r", ids, exc)
        try:
            self.engine.abort(ids)
        except Exception:  # the target is in an unknown state; its rows are gone either way
            log.exception("abort after a failure failed")
        err = exc if isinstance(exc, VerifierError) else VerifierError(f"target failed: {type(exc).__name__}: {exc}")
        for rid in ids:
            self._send_error(rid, err)

    def _send_error(self, rid: str, err: VerifierError) -> None:
        sink = self._sinks.pop(rid, None)
        self._chosen.pop(rid, None)
        with self._ids_lock:
            self._ids.discard(rid)
        if self.remote is not None:
            self.remote.fallbacks.pop(rid, None)
            self.remote.stats.pop(rid, None)
        if sink is not None:
            sink(err)


def merge_chunks(first: dict, then: dict) -> dict:
    """One chunk for two consecutive chunks of a request: ``then``'s fields (finished, metrics, ...) with the tokens
    of both, in order."""
    return {**then, "tokens": first["tokens"] + then["tokens"]}


def _keep_what_is_needed(request: GenerationRequest, needs: frozenset[str]) -> GenerationRequest:
    """With visual features from the vision stage the target needs no pixels: they stay only for a drafter that
    reads pixels, or one that needs pre-projector features the vision stage did not send (then they are computed
    here from the pixels); pre-projector features a drafter does not need are dropped."""
    visual = request.visual
    if visual is None:
        return request
    pre = visual.pre_projector if isinstance(visual, VisualFeatures) else None
    if pre is not None and "pre_projector" not in needs:
        visual = replace(visual, pre_projector=None)
        pre = None
    keep_pixels = "pixels" in needs or ("pre_projector" in needs and pre is None)
    return replace(request, visual=visual, pixel_values=request.pixel_values if keep_pixels else None)
