"""``DrafterServer``: one drafter replica's DrafterService (protos/specula_dataplane.proto) on gRPC.

Each ``Session`` stream is one request's drafter session (docs/design.md, "Where state lives")::

    verifier -> drafter   Begin  ProposeRequest  Verdict  ProposeRequest  Verdict ...  Release
    drafter -> verifier          Proposal                 Proposal

The server owns one drafter instance (a ``specula.drafters.Drafter``) shared by all its sessions: the protocol is
batched over request ids, so a session is a request id in that drafter (named by the server, unique per replica,
so two verifiers' ids never collide) and the stream's end frees it, however it ends (Release, a broken or cancelled
stream, a bad frame).

Batching across sessions (``batcher.py``): one worker thread owns the drafter; every session hands it its calls
(begin, observe, propose, the overlap's extend / observe_ahead, release) and waits, and the worker runs what is
pending as one drafter call per kind (proposals with the same gamma: one ``propose`` over all their rows, split
back per session). Config ``dataplane.batch_wait_ms`` (a window to gather more; default 0 = what is pending now)
and ``dataplane.max_batch_size``. A drafter exception fails only the sessions whose rows were in that call.

Overlap (``overlap.py``): with ``overlap=True`` and a drafter that can draft ahead (``drafters.protocol.Lookahead``),
a session drafts the next block right after sending a Proposal, while the verifier verifies; a reader thread per
stream takes the verifier's messages meanwhile, so drafting ahead stops as soon as a Verdict shows it is wasted.
Drafting ahead goes through the batcher one node (``extend(1)``) at a time, so sessions drafting ahead at once
share one ``extend`` call, and a stop check still comes between nodes.

Offers (``Begin.offers``; ``overlap.py``): once drafting ahead is done and the verdict has not come, the session
sends the blocks drafted ahead in one ``Offers`` message, each with the verdict it is for; a ProposeRequest
naming one (``ProposeRequest.offer``) gets no Proposal back, the pipeline just takes the block it kept::

    verifier -> drafter   ProposeRequest                      Verdict  ProposeRequest(offer=3) ...
    drafter -> verifier           Proposal  Offers(1, 2, 3)                                  Offers(4, 5) ...

An early Begin (``Begin.early``, offered when ``DrafterInfo.early_begin``): the verifier sends it before its
prefill, with no first token; the session takes the prompt with its last token pending and drafts past its guess
of the first token while the target prefills (``Pipeline.prime``); the first token then comes as a Verdict with
nothing accepted::

    verifier -> drafter   Begin(early)  Verdict(first token)  ProposeRequest  Verdict ...
                          (target prefill meanwhile)           Proposal (drafted during the prefill on a hit)

Several drafters (``drafters.multi.MultiDrafter``, config ``drafter.alternatives``): a session drafts with the one
its Begin names (``Begin.drafter``; empty = the default; ``DrafterInfo.drafters`` lists them), and its pipeline
runs on that drafter, so it overlaps when that drafter can draft ahead. Every ProposalStats names the drafter.

A bad frame, a message out of protocol order or a drafter failure ends that session with an ``Error`` frame; the
server and its other sessions go on. gRPC runs the server on its own threads, so it lives beside whatever owns the
process (a Serve replica's event loop, a test)::

    with DrafterServer(create({"kind": "ngram"}), host="127.0.0.1") as server:   # port 0: a free port
        address = server.address                                                 # "127.0.0.1:43127"
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from specula.drafters.multi_drafter import MultiDrafter
from specula.drafters.protocol import PREFILL_FREE, DraftContext, Verdict, supports_lookahead
from specula.protos import load
from specula.runtime.wire import DEFAULT_LIMITS, FrameEncoder, Message, Reassembler, WireError, WireLimits, pb
from specula.runtime.wire.codecs import parse_codec

from .backlog import Backlog
from .batcher import BatchedView, DraftBatcher
from .overlap import Block, Offer, Pipeline

log = logging.getLogger(__name__)
_pb2_grpc = load("specula_dataplane").pb2_grpc
_WILDCARD = ("0.0.0.0", "::", "")
_BEGIN_FIELDS = ("pixel_values", "visual", "hidden")  # DraftContext fields a Begin tensor may fill; others -> extra


class SessionError(Exception):
    """A session broke the protocol or the drafter failed it: answered with an Error frame of ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class DrafterServer:
    """A gRPC DrafterService over one drafter instance.

    Args:
        drafter: the drafter every session of this replica uses (``specula.drafters.create(...)``).
        host, port: where to bind; port 0 picks a free port (``address`` says which).
        advertise_host: the host put in ``address`` (default: ``host``, or this machine's IP for a wildcard host).
        accept_codecs: codecs this replica decodes (DrafterInfo.accepted_codecs); "raw" is always accepted.
        limits: frame and message limits, both directions (max_message_bytes goes to DrafterInfo).
        max_sessions: concurrent streams; more are refused (RESOURCE_EXHAUSTED) and those requests decode alone.
        device: where decoded features go before the drafter sees them.
        overlap: draft the next block while the verifier verifies (when the drafter can); sessions may opt out.
        predraft: with overlap, also draft up to this many blocks for the likeliest rejection outcomes per block
            (drafters with ``Predraft``: text_lm, eagle and msd chains; ``overlap.py``); 0 = only the block past the guess.
        name: the name a Begin may give to choose ``drafter`` (default its kind); a MultiDrafter has its own names.
        max_batch_size: most rows in one drafter call across sessions (``batcher.DraftBatcher``).
        batch_wait_ms: how long the drafting worker waits for more calls after the first (0 = none).
        on_call: optional ``f(op, n_rows)`` after each drafter call (counts batches; tests, metrics).
        compute: the ``ComputeThread`` the drafter was built on, which then runs every drafter call (the batcher's
            worker); stopped with the server. ``from_config`` makes one. Default: the batcher's own thread.
    """

    def __init__(self, drafter, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 accept_codecs: Sequence[str] = ("fp32",), limits: WireLimits = DEFAULT_LIMITS,
                 max_sessions: int = 64, device: str | torch.device = "cpu", overlap: bool = True,
                 name: str | None = None, max_batch_size: int = 64, batch_wait_ms: float = 0.0,
                 on_call=None, predraft: int = 0, compute=None) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.drafter, self.limits, self.device = drafter, limits, torch.device(device)
        self.host, self.port, self.max_sessions = host, port, max_sessions
        self._advertise = advertise_host
        codecs = [parse_codec(c).name for c in accept_codecs]
        spec = drafter.spec
        multi = isinstance(drafter, MultiDrafter)
        self.choices = drafter.names if multi else (name or spec.kind,)  # what a Begin may name; default first
        self._overlap = bool(overlap)  # sessions of drafters that can draft ahead do
        if isinstance(predraft, bool) or not isinstance(predraft, int) or predraft < 0:
            raise ValueError(f"predraft must be an integer >= 0, got {predraft!r}")
        self._predraft = predraft
        self.overlap = self._overlap and supports_lookahead(drafter.drafters[drafter.default] if multi else drafter)
        members = [drafter.drafters[c] for c in self.choices] if multi else [drafter]
        self.early_begin = self._overlap and all(_early_capable(d) for d in members)
        self.info = pb.DrafterInfo(kind=spec.kind, structure=spec.structure, needs=sorted(spec.needs),
                                   accepted_codecs=codecs, max_message_bytes=limits.max_message_bytes,
                                   overlap=self.overlap, drafters=self.choices, early_begin=self.early_begin,
                                   offers=self.overlap)
        self._accepts = frozenset(codecs) | {"raw"}
        self.compute = compute
        self.batcher = DraftBatcher(drafter, max_batch_size=max_batch_size, wait_ms=batch_wait_ms, on_call=on_call,
                                    compute=compute)
        self._ids = itertools.count()
        self._live: set[str] = set()
        self._server: grpc.Server | None = None
        self._address: str | None = None
        self._stopped = False

    @classmethod
    def from_config(cls, config, *, advertise_host: str | None = None) -> DrafterServer:
        """The drafter of ``config.drafter`` on the DrafterEnsemble's device, bound as ``config.dataplane`` says.
        The drafter is built on a compute thread of the server's own, which then runs every drafter call: a
        replica's torch work on one thread (runtime/engine/compute_thread.py says why)."""
        from specula.runtime.engine.compute_thread import ComputeThread
        from specula.runtime.engine.factory import make_drafter

        dp, settings = config.dataplane, config.deployments.drafter_ensemble
        compute = ComputeThread(name="drafter-compute")
        try:
            drafter = compute.call(make_drafter, config)
        except BaseException:
            compute.stop()
            raise
        return cls(drafter, compute=compute, host=dp.host, port=dp.port,
                   advertise_host=dp.advertise_host or advertise_host, accept_codecs=config.drafter.accept_codecs,
                   limits=WireLimits(max_message_bytes=dp.max_message_bytes), max_sessions=dp.max_sessions,
                   device=settings.device, overlap=config.drafter.overlap,
                   predraft=config.drafter.predraft, name=config.drafter.default_name,
                   max_batch_size=dp.max_batch_size, batch_wait_ms=dp.batch_wait_ms)

    # ------------------------------------------------------------------------------------------- lifecycle

    def start(self) -> str:
        """Bind and serve (on gRPC's threads); returns ``address``."""
        if self._server is not None:
            raise RuntimeError("DrafterServer already started")
        slots = self.max_sessions + 2  # Describe calls need a worker too
        server = grpc.server(ThreadPoolExecutor(max_workers=slots, thread_name_prefix="drafter-session"),
                             options=self.limits.grpc_options(), maximum_concurrent_rpcs=slots)
        _pb2_grpc.add_DrafterServiceServicer_to_server(_Servicer(self), server)
        bind = f"[{self.host}]" if ":" in self.host else self.host
        port = server.add_insecure_port(f"{bind}:{self.port}")
        if port == 0:
            raise OSError(f"DrafterServer could not bind {bind}:{self.port}")
        self.batcher.start()
        server.start()
        self._server, self.port = server, port
        host = self._advertise or (_own_ip() if self.host in _WILDCARD else self.host)
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("DrafterService (%s, %s) serving on %s", self.info.kind, self.info.structure, self._address)
        return self._address

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("DrafterServer is not started")
        return self._address

    @property
    def live_sessions(self) -> int:
        return len(self._live)

    def stop(self, grace: float | None = None) -> None:
        """Stop serving; open sessions end (their verifiers decode alone) and their drafter state is freed."""
        self._stopped = True
        if self._server is not None:
            self._server.stop(grace).wait()
        self.batcher.stop()  # sessions still ending free their state inline
        if self.compute is not None:
            self.compute.stop()

    def check_health(self) -> None:
        if self._server is None or self._stopped:
            raise RuntimeError("DrafterServer is not serving")

    def __enter__(self) -> DrafterServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------------- one session

    def session(self, frames: Iterator, context: grpc.ServicerContext | None = None) -> Iterator:
        """Serve one stream: request frames in, response frames out (the Session RPC's body)."""
        state = _Session(f"s{next(self._ids)}")
        enc = FrameEncoder("raw", self.limits)  # Proposal.q must be exact; nothing else carries floats this way
        inbox = _Inbox(Reassembler(self.limits, device=self.device), frames,
                       Backlog(self.limits.max_backlog_messages, self.limits.max_backlog_bytes))
        self._live.add(state.key)
        try:
            while (item := inbox.get()) is not _EOF:
                yield from self._handle(state, *item, enc)
                if state.done:
                    return
                p = state.pipeline
                if p is not None and p.wants_ahead:  # the Proposal is on its way: draft the next block meanwhile
                    p.speculate(lambda: inbox.makes_ahead_useless(p))
                    offers = p.offers() if not inbox.pending() else []  # the verdict is still out: offer them
                    if offers:
                        yield from enc.encode(state.request_id, *self._offers(offers, state.choice))
            if state.begun:
                log.info("session %s (%s) ended without Release", state.key, state.request_id)
        except grpc.RpcError:  # the verifier cancelled or went away: nothing to answer
            return
        except WireError as e:
            log.warning("session %s: invalid frame: %s", state.key, e)
            yield from enc.encode(state.request_id, pb.Error(code=pb.Error.CODE_INVALID_FRAME, message=str(e)[:4096]))
        except SessionError as e:
            log.warning("session %s: %s", state.key, e)
            yield from enc.encode(state.request_id, pb.Error(code=e.code, message=str(e)[:4096]))
        except Exception as e:  # a drafter failure ends this session only
            log.exception("session %s: drafter failed", state.key)
            yield from enc.encode(state.request_id, pb.Error(code=pb.Error.CODE_INTERNAL,
                                                             message=f"{type(e).__name__}: {e}"[:4096]))
        finally:
            if state.begun and not state.released:
                try:
                    self.batcher.release([state.key])
                except Exception:  # a broken drafter: nothing more to do for this session
                    log.exception("session %s: release failed", state.key)
            self._live.discard(state.key)  # after its state is freed: live_sessions never undercounts held state

    def _handle(self, s: _Session, msg: Message, arrived_ns: int, enc: FrameEncoder) -> Iterator:
        kind = msg.kind
        if s.begun and msg.request_id != s.request_id:
            raise SessionError(pb.Error.CODE_INVALID_FRAME,
                               f"frame for request {msg.request_id!r} in the session of {s.request_id!r}")
        if kind == "begin":
            if s.begun:
                raise SessionError(pb.Error.CODE_INVALID_FRAME, "a second Begin in one session")
            s.request_id = msg.request_id
            s.choice = msg.body.drafter or self.choices[0]
            if s.choice not in self.choices:
                raise SessionError(pb.Error.CODE_UNSUPPORTED, f"drafter {s.choice!r} is not served by this replica; "
                                                              f"it serves {list(self.choices)}")
            wants = msg.body.overlap if msg.body.HasField("overlap") else True
            early = bool(msg.body.early)
            if early and not (self.early_begin and wants):
                raise SessionError(pb.Error.CODE_UNSUPPORTED, "an early Begin needs a replica with early_begin and "
                                                              "overlap on")
            ctx = self._context(s.key, msg, s.choice)
            if early:  # the first token is not known yet: the prompt's last token is the pending one
                if len(ctx.prompt_ids) < 2:
                    raise SessionError(pb.Error.CODE_INVALID_FRAME, "an early Begin needs at least 2 prompt ids")
                ctx = dataclasses.replace(ctx, prompt_ids=ctx.prompt_ids[:-1], first_token=int(ctx.prompt_ids[-1]))
            try:
                self.batcher.begin([ctx])
            finally:
                s.begun = True  # a failed begin may have left state: the session's end releases it
            branches = self._predraft if not msg.body.HasField("predraft") or msg.body.predraft else 0
            # the session's own drafter: with several, the pipeline drafts ahead when the chosen one can
            drafter = self.drafter.drafter_for(s.key) if isinstance(self.drafter, MultiDrafter) else self.drafter
            s.pipeline = Pipeline(BatchedView(self.batcher, drafter), s.key, overlap=self._overlap and wants,
                                  predraft=branches, offers=bool(msg.body.offers))
            if early:
                s.pipeline.prime(int(msg.body.gamma))  # the session loop drafts past the guess until the verdict
            return
        if kind == "error":  # the verifier gave up on this session
            s.done = True
            return
        if not s.begun:
            raise SessionError(pb.Error.CODE_INVALID_FRAME, f"{kind} before Begin")
        if kind == "propose_request" and msg.body.HasField("offer"):  # the verifier took an Offer: no answer
            try:
                s.pipeline.take(int(msg.body.offer), int(msg.body.gamma))
            except ValueError as e:
                raise SessionError(pb.Error.CODE_INVALID_FRAME, str(e)) from None
        elif kind == "propose_request":
            queued = time.perf_counter_ns() - arrived_ns
            yield from enc.encode(s.request_id, *self._proposal(s.pipeline.propose(int(msg.body.gamma)), queued,
                                                                s.choice))
        elif kind == "verdict":
            b = msg.body
            extra = {k: t for k, t in msg.tensors.items() if k != "hidden"}  # e.g. "last_k" / "last_v"
            s.pipeline.verdict(Verdict(s.key, tuple(int(i) for i in b.accepted), tuple(int(t) for t in b.tokens),
                                       int(b.next_token), msg.tensors.get("hidden"), extra))
        elif kind == "release":
            s.done = True
            self.batcher.release([s.key])
            s.released = True
        else:
            raise SessionError(pb.Error.CODE_INVALID_FRAME, f"a {kind} is not sent to a drafter")

    def _context(self, key: str, msg: Message, choice: str) -> DraftContext:
        b = msg.body
        if b.codec and b.codec not in self._accepts:
            raise SessionError(pb.Error.CODE_UNSUPPORTED, f"codec {b.codec!r} is not one this drafter accepts "
                                                          f"({sorted(self._accepts)})")
        if not b.prompt_ids:
            raise SessionError(pb.Error.CODE_INVALID_FRAME, "Begin without prompt_ids")
        t = dict(msg.tensors)
        fields = {name: t.pop(name, None) for name in _BEGIN_FIELDS}
        seed = int(b.sampling.seed) if b.sampling.HasField("seed") else None
        return DraftContext(key, torch.tensor(list(b.prompt_ids), dtype=torch.long), int(b.first_token),
                            float(b.sampling.temperature), seed, extra=t, drafter=choice, **fields)

    @staticmethod
    def _proposal(block: Block, queued_ns: int, drafter: str) -> tuple:
        tensors = {}
        if block.q is not None and block.tokens:
            tensors["q"] = block.q.float().contiguous()  # [N, V] fp32
        return pb.Proposal(tokens=block.tokens, parents=block.parents or [],
                           stats=_stats(block, queued_ns, drafter)), tensors

    @staticmethod
    def _offers(offers: list[Offer], drafter: str) -> tuple:
        """One Offers message for the blocks drafted ahead after the same block; q of blocks[i] as "q.<i>"."""
        body, tensors = pb.Offers(after=offers[0].after), {}
        for i, o in enumerate(offers):
            b = o.block
            body.blocks.append(pb.Offer(id=o.id, accepted=list(o.accepted), next_token=o.next_token,
                                        tokens=b.tokens, stats=_stats(b, 0, drafter)))
            if b.q is not None and b.tokens:
                tensors[f"q.{i}"] = b.q.float().contiguous()  # [N, V] fp32
        return body, tensors


_EOF = object()  # the verifier half-closed the stream


class _Inbox:
    """A stream's messages, read on a thread of their own, so a session can look at what came while it drafts."""

    def __init__(self, reassembler: Reassembler, frames: Iterator, backlog: Backlog) -> None:
        self._q: queue.Queue = queue.Queue()
        self._seen: list = []  # taken off the queue by a peek, not yet handled
        self._backlog = backlog  # messages in _q and _seen: a verifier sending unasked ends the session
        self._broken: WireError | None = None  # the backlog overran: raised before anything still queued
        self._thread = threading.Thread(target=self._read, args=(reassembler, frames), daemon=True,
                                        name="drafter-session-reader")
        self._thread.start()

    def get(self):
        """(message, arrival ns) in order, then _EOF; re-raises what broke the stream."""
        if self._broken is not None:
            raise self._broken
        item = self._seen.pop(0) if self._seen else self._q.get()
        if isinstance(item, BaseException):
            self._seen.insert(0, item)  # stays broken
            raise item
        if item is not _EOF:
            self._backlog.take(item[0])
        return item

    def pending(self) -> bool:
        """Has a message come that is not handled yet?"""
        while True:
            try:
                self._seen.append(self._q.get_nowait())
            except queue.Empty:
                return bool(self._seen)

    def makes_ahead_useless(self, pipeline: Pipeline) -> bool:
        """Has a message come that settles the block being drafted ahead against it (a disagreeing Verdict, the
        end of the request, a broken stream)?"""
        self.pending()
        for item in self._seen:
            if item is _EOF or isinstance(item, BaseException):
                return True
            msg = item[0]
            if msg.kind == "verdict":
                return not pipeline.would_hit([int(i) for i in msg.body.accepted], int(msg.body.next_token))
            if msg.kind != "propose_request":
                return True
        return False

    def _read(self, reassembler: Reassembler, frames: Iterator) -> None:
        try:
            for msg in reassembler.feed_all(frames):
                if (why := self._backlog.add(msg)) is not None:
                    self._broken = WireError(why)
                    self._q.put(self._broken)  # wakes a get() that waits
                    return
                self._q.put((msg, time.perf_counter_ns()))
            self._q.put(_EOF)
        except BaseException as e:  # WireError, grpc.RpcError (cancelled), anything: the session sees it
            self._q.put(e)


class _Session:
    __slots__ = ("key", "request_id", "begun", "released", "done", "pipeline", "choice")

    def __init__(self, key: str) -> None:
        self.key, self.request_id, self.choice = key, "", ""
        self.begun = self.released = self.done = False
        self.pipeline: Pipeline | None = None


class _Servicer(_pb2_grpc.DrafterServiceServicer):
    def __init__(self, server: DrafterServer) -> None:
        self._s = server

    def Describe(self, request, context):  # noqa: N802 (gRPC method name)
        return self._s.info

    def Session(self, request_iterator, context):  # noqa: N802
        return self._s.session(request_iterator, context)


def _stats(block: Block, queued_ns: int, drafter: str):
    return pb.ProposalStats(speculative=block.speculative, dropped=block.dropped, queued_ns=max(queued_ns, 0),
                            draft_ns=block.draft_ns, ahead_ns=block.ahead_ns, drafter=drafter, branch=block.branch)


def _early_capable(drafter) -> bool:
    """Can ``drafter`` start before the target's prefill (Begin.early)? It must draft ahead (the first block is
    drafted past its guess of the first token) and need no feature the prefill makes."""
    return supports_lookahead(drafter) and not (set(drafter.spec.needs) - PREFILL_FREE)


def _own_ip() -> str:
    """This machine's address as other machines see it (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
