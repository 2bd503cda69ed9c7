"""``RemoteDrafter``: the Drafter protocol over DrafterService sessions, the verifier's end of the data plane.

To the speculative loop (``SpecEngine``) it is just another drafter; underneath, each request id is one
``Session`` stream to one drafter replica::

    remote = RemoteDrafter(vocab_size=V, codec_preference=["fp16", "fp32"])
    remote.attach("r1", "10.0.0.7:43127")       # Describe the replica (cached per address), negotiate the codec
    engine = SpecEngine(target, drafter=remote, gamma=4)
    engine.generate([...])                       # begin -> Begin, propose -> ProposeRequest/Proposal,
                                                 # observe -> Verdict, release -> Release (stream ends)

With a replica that offers it (``DrafterInfo.early_begin``), the engine's ``prepare`` (before the target's
prefill) sends an early Begin without the first token, and ``begin`` sends the first token as a Verdict: the
drafter's prompt prefill and its first block then run during the target's prefill (``overlap.py``, ``prime``).

Failure is never an exception here: a replica that cannot be reached, a session that breaks, answers with an Error,
sends something invalid or misses the proposal deadline is dropped, and its request goes on with no drafts (the
engine's plain step: gamma = 0), so the output does not change. ``fallbacks`` says which requests fell back and why.

Time split (``stats``, per request; the caller pops it): every Proposal says how long the drafter queued the request
(``idle``: it was still drafting ahead, or busy with other sessions) and drafted it (``draft``); the rest of the
round trip is ``transfer`` (encode, gRPC, decode, both ways). ``ahead`` is drafting that overlapped verification;
``spec_used`` / ``spec_dropped`` count pre-drafted blocks (``spec_branch``: used ones drafted for a rejection;
``offers_taken``: used ones taken as Offers, no round trip); ``bytes_out`` / ``bytes_in`` are serialized frame bytes;
``drafter`` names the drafter that drafted the request's blocks, as the replica reported it ("" before any);
``early``: the session began before the target's prefill; ``first_ahead``: its first block was ready when asked for.

Offers (``offers``; ``DrafterInfo.offers``): the replica sends the blocks it drafted ahead as soon as drafting ahead
is done (one Offers message), each with the verdict it is for. ``propose`` first looks at the Offers the session
holds for the block just verified: one for the last verdict is verified at once, and its ProposeRequest names it
(``offer``) so that no Proposal comes back: a pre-drafted block then costs no round trip (``offers_taken``; its
transfer time is 0). Offers are checked like Proposals (vocabulary, q's shape and values) before they are used.

A request's drafter choice (``DraftContext.drafter``, from ``GenerationRequest.drafter``) goes in its Begin; a
replica that does not serve that name (``DrafterInfo.drafters``) is not asked, and the request decodes alone.

Threads: ``attach`` may be called from any thread (it blocks up to ``connect_timeout_s``); every other method is
called by the one thread that drives the engine. Each open session has a reader thread (gRPC's sync API blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import grpc
import torch

from specula.drafters.protocol import FEATURES, DraftContext, DrafterSpec, Proposal, Verdict
from specula.protos import load
from specula.runtime.dataplane.backlog import Backlog
from specula.runtime.wire import (
    DEFAULT_LIMITS,
    FrameEncoder,
    Message,
    Reassembler,
    WireError,
    WireLimits,
    negotiate_codec,
    pb,
)

log = logging.getLogger(__name__)
_pb2_grpc = load("specula_dataplane").pb2_grpc
_END = object()  # ends the request stream (half-close)


class DrafterUnavailable(Exception):
    """A session (or a replica) cannot draft for its request any more; the request decodes alone."""


class _Closed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Replica:
    """What a drafter address told us (Describe), or why it could not."""

    def __init__(self, info=None, stub=None, channel=None, codec: str = "raw", limits: WireLimits = DEFAULT_LIMITS,
                 error: str | None = None, until: float = 0.0) -> None:
        self.info, self.stub, self.channel, self.codec, self.limits = info, stub, channel, codec, limits
        self.error, self.until = error, until


class SessionStream:
    """One request's Session stream (the verifier's end): send messages, receive them with a deadline."""

    def __init__(self, stub, request_id: str, codec: str, send_limits: WireLimits,
                 recv_limits: WireLimits = DEFAULT_LIMITS) -> None:
        self.request_id = request_id
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self._enc = FrameEncoder(codec, send_limits)
        self._recv_limits = recv_limits
        self._backlog = Backlog(recv_limits.max_backlog_messages, recv_limits.max_backlog_bytes)  # bounds _in + _offers
        self._broken: str | None = None  # set by the reader when the drafter overran the backlog: nothing more is read
        self.bytes_out = self.bytes_in = 0  # serialized frames, each way
        self.arrived_ns = 0  # when the last message received was complete (reader thread clock)
        self._offers: queue.SimpleQueue = queue.SimpleQueue()  # Offers messages, apart from what ``receive`` gets
        self.blocks = 0  # ProposeRequests sent: Offer.after of the offers for the next block
        self.last: tuple[tuple[int, ...], int] | None = None  # the last verdict: (accepted, next token)
        self._call = stub.Session(self._frames())
        self._reader = threading.Thread(target=self._read, name=f"drafter-session-{request_id}", daemon=True)
        self._reader.start()

    def send(self, body, tensors: dict | None = None) -> None:
        for f in self._enc.encode(self.request_id, body, tensors):
            self.bytes_out += f.ByteSize()
            self._out.put(f)

    def receive(self, timeout: float) -> Message:
        """The next message from the drafter; DrafterUnavailable on a timeout, an Error or a broken stream."""
        if self._broken is not None:  # what is still queued came with the flood: none of it is used
            raise DrafterUnavailable(self._broken)
        try:
            item = self._in.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            raise DrafterUnavailable(f"no answer within {timeout:.3g} s") from None
        if isinstance(item, _Closed):
            self._in.put(item)  # stays closed for any later receive
            raise DrafterUnavailable(item.reason)
        item, self.arrived_ns = item
        self._backlog.take(item)
        if item.kind == "error":
            raise DrafterUnavailable(f"drafter error {pb.Error.Code.Name(item.body.code)}: {item.body.message}")
        return item

    def offers(self) -> list[tuple[object, torch.Tensor | None]]:
        """The offers received so far for the next block, as (pb.Offer, its q or None); older ones are dropped.
        WireError for an Offers message whose tensors are not one "q.<i>" per offered block at most."""
        out = []
        while self._broken is None:
            try:
                m = self._offers.get_nowait()
            except queue.Empty:
                return out
            self._backlog.take(m)
            n = len(m.body.blocks)
            names = {f"q.{i}" for i in range(n)}
            if set(m.tensors) - names:
                raise WireError(f"unexpected Offers tensors {sorted(set(m.tensors) - names)[:4]}")
            if m.body.after == self.blocks:
                out += [(o, m.tensors.get(f"q.{i}")) for i, o in enumerate(m.body.blocks)]
        return []

    def finish(self, reason: str = "") -> None:
        """Release the session and half-close; the drafter frees its state and ends the stream."""
        try:
            self.send(pb.Release(reason=reason))
        except WireError:
            pass
        self._out.put(_END)

    def abort(self) -> None:
        """Drop the stream now (no Release: the drafter frees the session when it sees the stream end)."""
        self._out.put(_END)
        self._call.cancel()

    def _frames(self):
        while (f := self._out.get()) is not _END:
            yield f

    def _read(self) -> None:
        r = Reassembler(self._recv_limits)
        try:
            for f in self._call:
                self.bytes_in += f.ByteSize()
                m = r.feed(f)
                if m is not None and (why := self._backlog.add(m)) is not None:
                    self._broken = f"invalid stream from the drafter: {why}"
                    self._in.put(_Closed(self._broken))
                    self._call.cancel()
                    return
                if m is not None and m.kind == "offers":
                    self._offers.put(m)
                elif m is not None:
                    self._in.put((m, time.perf_counter_ns()))
            r.close()
            self._in.put(_Closed("the drafter ended the session"))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            self._in.put(_Closed(f"stream broke: {getattr(code, 'name', code)}: "
                                 f"{e.details() if hasattr(e, 'details') else e}"))
        except WireError as e:
            self._in.put(_Closed(f"invalid frame from the drafter: {e}"))
            self._call.cancel()
        except Exception as e:  # never let a reader thread die silently
            self._in.put(_Closed(f"{type(e).__name__}: {e}"))
            self._call.cancel()


class RemoteDrafter:
    """A Drafter whose requests are drafted by DrafterService replicas, one Session stream per request.

    Args:
        vocab_size: the target's V (drafts and q are checked against it before they reach the verifier).
        codec_preference: the codecs this side would send features in, best first (negotiated per replica).
        limits: this side's frame limits (the sender uses min(these, the replica's)).
        propose_timeout_s: one deadline for all of a step's proposals; a session missing it is dropped.
        connect_timeout_s: deadline of Describe when a replica is first seen.
        retry_after_s: a replica that could not be reached is not tried again for this long.
        max_nodes: most draft nodes accepted in one proposal (a sanity bound on untrusted input).
        overlap: ask replicas to draft ahead while this side verifies (True / False); None = each replica's default.
        predraft: with overlap, ask replicas to draft ahead for rejections too (True / False; the replica's
            ``predraft`` setting says how many); None = each replica's default.
        offers: with overlap, ask replicas that can (``DrafterInfo.offers``) to send blocks drafted ahead unasked,
            and verify one at once when its verdict comes (module docstring).
    """

    def __init__(self, *, vocab_size: int, codec_preference: Sequence[str] = ("fp32",),
                 limits: WireLimits = DEFAULT_LIMITS, propose_timeout_s: float = 2.0, connect_timeout_s: float = 2.0,
                 retry_after_s: float = 5.0, max_nodes: int = 256, overlap: bool | None = None,
                 predraft: bool | None = None, offers: bool = True) -> None:
        self.vocab_size, self.preference, self.limits = vocab_size, list(codec_preference), limits
        self.propose_timeout_s, self.connect_timeout_s = propose_timeout_s, connect_timeout_s
        self.retry_after_s, self.max_nodes, self.overlap = retry_after_s, max_nodes, overlap
        self.predraft, self.offers = predraft, bool(offers)
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._assigned: dict[str, str] = {}  # request id -> address, from attach() until begin()
        self._streams: dict[str, SessionStream] = {}
        self._early: set[str] = set()  # request ids begun early (prepare) whose first token is still to send
        self._spec: DrafterSpec | None = None
        self.fallbacks: dict[str, str] = {}  # request id -> why it decodes alone (the caller pops it)
        self.stats: dict[str, dict] = {}  # request id -> time split and counters (module docstring; caller pops)

    # ------------------------------------------------------------------------------------------- routing

    @property
    def spec(self) -> DrafterSpec:
        """The spec of the replicas seen so far (all must agree); chain with no needs before the first one."""
        return self._spec or DrafterSpec(kind="remote", structure="chain")

    def attach(self, request_id: str, address: str | None) -> str | None:
        """Route ``request_id``'s session to the replica at ``address``; returns why it will decode alone, or None."""
        if address is None:
            reason = "no drafter replica"
        else:
            rep = self._replica(address)
            reason = None if rep.error is None else f"drafter {address}: {rep.error}"
        with self._lock:
            if reason is None:
                self._assigned[request_id] = address
            else:
                self.fallbacks[request_id] = reason
        return reason

    def _replica(self, address: str) -> _Replica:
        with self._lock:
            rep = self._replicas.get(address)
            if rep is not None and (rep.error is None or time.monotonic() < rep.until):
                return rep
        channel = grpc.insecure_channel(address, options=self.limits.grpc_options())
        stub = _pb2_grpc.DrafterServiceStub(channel)
        try:
            info = stub.Describe(pb.DescribeRequest(), timeout=self.connect_timeout_s)
            spec = DrafterSpec(kind=info.kind, structure=info.structure,
                               needs=frozenset(n for n in info.needs if n in FEATURES))
            unknown = set(info.needs) - set(FEATURES)
            if unknown:
                raise DrafterUnavailable(f"it needs features this verifier does not know: {sorted(unknown)}")
            with self._lock:
                if self._spec is None:
                    self._spec = spec
                elif self._spec != spec:
                    raise DrafterUnavailable(f"it runs {spec}, other replicas {self._spec}")
            try:
                codec = negotiate_codec(list(info.accepted_codecs), self.preference)
            except WireError:
                codec = "raw"  # every peer decodes raw
            mmb = min(self.limits.max_message_bytes, info.max_message_bytes or self.limits.max_message_bytes)
            rep = _Replica(info, stub, channel, codec, WireLimits(max_message_bytes=max(mmb, 1024)))
        except (grpc.RpcError, DrafterUnavailable, ValueError) as e:
            channel.close()
            msg = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            log.warning("drafter %s unusable (%s); its requests decode alone", address, msg)
            rep = _Replica(error=msg, until=time.monotonic() + self.retry_after_s)
        with self._lock:
            old = self._replicas.get(address)
            if old is not None and old.error is None and rep.error is None:
                rep.channel.close()  # another thread described it first
                return old
            self._replicas[address] = rep
        return rep

    # ------------------------------------------------------------------------------------------- Drafter protocol

    def prepare(self, contexts: Sequence[DraftContext], gamma: int) -> None:
        """Before the target's prefill: an early Begin (no first token) for each context whose replica offers it
        (``DrafterInfo.early_begin``; overlap not turned off here), so the drafter's prompt prefill and its first
        block overlap the target's prefill; ``begin`` then sends the first token as a Verdict. Contexts carry
        ``first_token`` -1 and only what the prefill does not make (pixels, visual)."""
        if self.overlap is False or gamma <= 0:
            return
        for c in contexts:
            with self._lock:
                address = self._assigned.get(c.request_id)
                rep = self._replicas.get(address) if address is not None else None
            if rep is None or rep.error is not None or not rep.info.early_begin:
                continue
            if c.drafter and rep.info.drafters and c.drafter not in rep.info.drafters:
                continue  # begin() reports it
            with self._lock:
                self._assigned.pop(c.request_id, None)
            if self._open(c, rep, early=True, gamma=gamma):
                self._early.add(c.request_id)

    def begin(self, contexts: Sequence[DraftContext]) -> None:
        for c in contexts:
            if c.request_id in self._early:  # begun before the prefill: the first token is a verdict now
                self._early.discard(c.request_id)
                s = self._streams.get(c.request_id)
                if s is not None:
                    try:
                        s.last = ((), int(c.first_token))
                        s.send(pb.Verdict(accepted=[], tokens=[], next_token=int(c.first_token)))
                    except WireError as e:
                        self._drop(c.request_id, f"Verdict failed: {e}")
                continue
            with self._lock:
                address = self._assigned.pop(c.request_id, None)
                rep = self._replicas.get(address) if address is not None else None
            if rep is None or rep.error is not None:
                continue
            if c.drafter and rep.info.drafters and c.drafter not in rep.info.drafters:
                self._drop(c.request_id, f"drafter {c.drafter!r} is not served by {address} (it serves "
                                         f"{list(rep.info.drafters)})")
                continue
            self._open(c, rep)

    def _open(self, c: DraftContext, rep: _Replica, early: bool = False, gamma: int = 0) -> bool:
        """Open the request's session with its Begin; False (and the request decodes alone) if that fails."""
        tensors = {name: t for name, t in (("pixel_values", c.pixel_values), ("visual", c.visual),
                                           ("hidden", c.hidden), *c.extra.items()) if t is not None}
        sampling = pb.SamplingParams(temperature=c.temperature)
        if c.seed is not None:
            sampling.seed = c.seed
        begin = pb.Begin(prompt_ids=c.prompt_ids.tolist(), first_token=max(int(c.first_token), 0), sampling=sampling,
                         codec=rep.codec, drafter=c.drafter or "", early=early, gamma=gamma if early else 0,
                         offers=self.offers and self.overlap is not False and bool(rep.info.offers))
        if self.overlap is not None:
            begin.overlap = bool(self.overlap)
        if self.predraft is not None:
            begin.predraft = bool(self.predraft)
        self.stats[c.request_id] = _new_stats(rep.codec, bool(rep.info.overlap) and self.overlap is not False)
        self.stats[c.request_id]["early"] = early
        try:
            s = SessionStream(rep.stub, c.request_id, rep.codec, rep.limits, self.limits)
            self._streams[c.request_id] = s
            s.send(begin, tensors)
        except (WireError, grpc.RpcError, ValueError) as e:
            self._drop(c.request_id, f"Begin failed: {e}")
            return False
        return True

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        live = [(b, rid, s) for b, rid in enumerate(request_ids) if (s := self._streams.get(rid)) is not None]
        rows: list[tuple[list[int], list[int] | None, torch.Tensor | None]] = [([], None, None)] * len(request_ids)
        sent_ns, taken = {}, set()
        for b, rid, s in live:
            try:
                offer = self._take_offer(rid, s, gamma)
                if offer is not None:
                    s.send(pb.ProposeRequest(gamma=gamma, offer=offer[0]))
                    rows[b] = offer[1]
                    taken.add(rid)
                else:
                    s.send(pb.ProposeRequest(gamma=gamma))
                    sent_ns[rid] = time.perf_counter_ns()
                s.blocks += 1
            except WireError as e:
                self._drop(rid, f"ProposeRequest failed: {e}")
            except DrafterUnavailable as e:
                self._drop(rid, str(e))
        deadline = time.monotonic() + self.propose_timeout_s
        for b, rid, s in live:
            if rid not in self._streams or rid in taken:
                continue
            try:
                m = s.receive(deadline - time.monotonic())
                rows[b] = self._check(m, gamma)
                self._account(rid, m.body.stats, s.arrived_ns - sent_ns[rid], s)
            except DrafterUnavailable as e:
                self._drop(rid, str(e))
        return _batch(tuple(request_ids), rows, self.vocab_size)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:
            s = self._streams.get(v.request_id)
            if s is None:
                continue
            try:
                tensors = {k: t for k, t in (("hidden", v.hidden), *v.extra.items()) if t is not None}
                s.last = (tuple(int(i) for i in v.accepted), int(v.next_token))
                s.send(pb.Verdict(accepted=list(v.accepted), tokens=list(v.tokens), next_token=int(v.next_token)),
                       tensors or None)
            except WireError as e:
                self._drop(v.request_id, f"Verdict failed: {e}")

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._early.discard(rid)
            with self._lock:
                self._assigned.pop(rid, None)
            s = self._streams.pop(rid, None)
            if s is not None:
                s.finish("done")
                self._bytes(rid, s)

    # ------------------------------------------------------------------------------------------- helpers

    def close(self) -> None:
        for rid in list(self._streams):
            self._streams.pop(rid).abort()
        with self._lock:
            for rep in self._replicas.values():
                if rep.channel is not None:
                    rep.channel.close()
            self._replicas.clear()

    def pop_stats(self, request_id: str) -> dict | None:
        """The request's data-plane figures (module docstring), seconds rounded to microseconds; None if it had
        no session."""
        st = self.stats.pop(request_id, None)
        if st is None:
            return None
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in st.items()}

    def _take_offer(self, rid: str, s: SessionStream, gamma: int):
        """The Offer held for the last verdict, as (its id, its checked first ``gamma`` nodes), or None."""
        try:
            held = s.offers()
        except WireError as e:
            raise DrafterUnavailable(f"invalid Offers: {e}") from None
        if gamma <= 0 or s.last is None or not held:
            return None
        o, q = next(((o, q) for o, q in held if tuple(o.accepted) == s.last[0] and o.next_token == s.last[1]),
                    (None, None))
        if o is None:
            return None
        tokens = list(o.tokens)
        if len(tokens) > self.max_nodes or (q is not None and tuple(q.shape) != (len(tokens), self.vocab_size)):
            raise DrafterUnavailable(f"an Offer of {len(tokens)} nodes with q of shape "
                                     f"{None if q is None else tuple(q.shape)}")
        row = self._rows(tokens[:gamma], [], None if q is None else q[:gamma], gamma)
        self._account(rid, o.stats, 0, s)
        self.stats[rid]["offers_taken"] += 1
        return int(o.id), row

    def _account(self, rid: str, ps, round_trip_ns: int, s: SessionStream) -> None:
        st = self.stats.get(rid)
        if st is None:
            return
        idle, draft = ps.queued_ns / 1e9, ps.draft_ns / 1e9
        st["proposals"] += 1
        if st["proposals"] == 1:
            st["first_ahead"] = bool(ps.speculative)  # the first block was drafted before it was asked for
        st["idle_s"] += idle
        st["draft_s"] += draft
        st["transfer_s"] += max(round_trip_ns / 1e9 - idle - draft, 0.0)
        st["ahead_s"] += ps.ahead_ns / 1e9
        st["spec_used"] += int(ps.speculative)
        st["spec_dropped"] += int(ps.dropped)
        st["spec_branch"] += int(ps.branch)
        if ps.drafter:
            st["drafter"] = ps.drafter
        self._bytes(rid, s)

    def _bytes(self, rid: str, s: SessionStream) -> None:
        st = self.stats.get(rid)
        if st is not None:
            st["bytes_out"], st["bytes_in"] = s.bytes_out, s.bytes_in

    def _drop(self, rid: str, reason: str) -> None:
        self._early.discard(rid)
        s = self._streams.pop(rid, None)
        if s is not None:
            self._bytes(rid, s)
            s.abort()
        log.warning("request %s decodes alone from here: %s", rid, reason)
        with self._lock:
            self.fallbacks[rid] = reason

    def _check(self, m: Message, gamma: int) -> tuple[list[int], list[int] | None, torch.Tensor | None]:
        """A Proposal from an untrusted peer -> (tokens [N], parents [N] or None, q [N, V] or None)."""
        if m.kind != "proposal":
            raise DrafterUnavailable(f"expected a Proposal, got {m.kind}")
        if set(m.tensors) - {"q"}:
            raise DrafterUnavailable(f"unexpected Proposal tensors {sorted(set(m.tensors) - {'q'})}")
        return self._rows(list(m.body.tokens), list(m.body.parents), m.tensors.get("q"), gamma)

    def _rows(self, tokens: list[int], parents: list[int], q: torch.Tensor | None,
              gamma: int) -> tuple[list[int], list[int] | None, torch.Tensor | None]:
        n = len(tokens)
        if n > self.max_nodes or (not parents and n > gamma):  # trees may spend gamma per level
            raise DrafterUnavailable(f"{n} draft nodes for gamma={gamma} (max_nodes={self.max_nodes})")
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise DrafterUnavailable(f"a draft token is outside the vocabulary [0, {self.vocab_size})")
        if parents and (len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents))):
            raise DrafterUnavailable("tree parents must be one per node, each -1 or an earlier node")
        if q is not None:
            if tuple(q.shape) != (n, self.vocab_size) or not q.is_floating_point():
                raise DrafterUnavailable(f"q has shape {tuple(q.shape)}, expected ({n}, {self.vocab_size})")
            q = q.float()
            if not bool(torch.isfinite(q).all()) or bool((q < 0).any()):
                raise DrafterUnavailable("q must be finite and non-negative")
        return tokens, (parents or None), q


def _new_stats(codec: str, overlap: bool) -> dict:
    return {"codec": codec, "overlap": overlap, "early": False, "first_ahead": False, "drafter": "", "proposals": 0,
            "draft_s": 0.0, "transfer_s": 0.0, "idle_s": 0.0, "ahead_s": 0.0, "spec_used": 0, "spec_dropped": 0,
            "spec_branch": 0, "offers_taken": 0, "bytes_out": 0, "bytes_in": 0}


def _batch(ids: tuple[str, ...], rows, vocab_size: int) -> Proposal:
    """Per-session proposals -> one batched Proposal. Rows with nothing to propose get count 0 (plain step)."""
    counts = tuple(len(t) for t, _, _ in rows)
    width = max(max(counts, default=0), 1)
    B = len(ids)
    tokens = torch.zeros((B, width), dtype=torch.long)  # [B, N]
    tree = any(p is not None for _, p, _ in rows)
    parents = torch.full((B, width), -1, dtype=torch.long) if tree else None  # [B, N]
    with_q = any(q is not None for _, _, q in rows)
    q = torch.zeros((B, width, vocab_size), dtype=torch.float32) if with_q else None  # [B, N, V]
    for b, (t, p, qb) in enumerate(rows):
        n = len(t)
        if not n:
            continue
        tokens[b, :n] = torch.tensor(t, dtype=torch.long)
        if parents is not None:
            parents[b, :n] = torch.tensor(p if p is not None else list(range(-1, n - 1)), dtype=torch.long)
        if q is not None:
            if qb is not None:
                q[b, :n] = qb
            else:  # a deterministic row in a batch with sampled rows: its drafts were drawn from one-hot q
                q[b, torch.arange(n), tokens[b, :n]] = 1.0
    return Proposal(ids, tokens, counts, parents, q)
