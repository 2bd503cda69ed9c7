"""The verifier's end of Offers against a scripted, untrusted DrafterService over real gRPC: an Offer is taken only
for the verdict it names, the ProposeRequest that takes it names it (and gets no Proposal), and a malformed Offer
(tokens outside the vocabulary, a q of the wrong shape or with negative mass, stray tensors, too many nodes) drops
the session with the reason instead of reaching the verifier."""

from __future__ import annotations

import queue
import time
from concurrent import futures

import grpc
import pytest
import torch

from specula.drafters.protocol import DraftContext, Verdict
from specula.protos import load
from specula.runtime.dataplane import RemoteDrafter
from specula.runtime.wire import DEFAULT_LIMITS, FrameEncoder, Reassembler, WireLimits, pb

rpc = load("specula_dataplane").pb2_grpc
V = 32  # the verifier's vocabulary


class ScriptedDrafter(rpc.DrafterServiceServicer):
    """Answers each ProposeRequest without ``offer`` with Proposal [1, 2]; after each Verdict sends ``offers(verdict,
    after)`` -> (pb.Offers body, tensors) unasked (as if it had foreseen the verdict), ``flood`` times over.
    Records the requests."""

    def __init__(self, offers, flood: int = 1) -> None:
        self.offers, self.requests, self.flood = offers, queue.SimpleQueue(), flood

    def Describe(self, request, context):  # noqa: N802
        return pb.DrafterInfo(kind="scripted", structure="chain", accepted_codecs=["fp32"], overlap=True,
                              offers=True, max_message_bytes=DEFAULT_LIMITS.max_message_bytes)

    def Session(self, request_iterator, context):  # noqa: N802
        inbox, out, blocks = Reassembler(DEFAULT_LIMITS), FrameEncoder("raw", DEFAULT_LIMITS), 0
        for frame in request_iterator:
            msg = inbox.feed(frame)
            if msg is None:
                continue
            self.requests.put(msg)
            if msg.kind == "propose_request":
                blocks += 1
                if not msg.body.HasField("offer"):
                    yield from out.encode(msg.request_id, pb.Proposal(tokens=[1, 2]), {})
            elif msg.kind == "verdict":
                for _ in range(self.flood):
                    body, tensors = self.offers(msg.body, blocks)
                    yield from out.encode(msg.request_id, body, tensors)
            elif msg.kind == "release":
                return


@pytest.fixture
def serve():
    servers = []

    def start(offers, flood: int = 1) -> tuple[str, ScriptedDrafter]:
        d = ScriptedDrafter(offers, flood)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=DEFAULT_LIMITS.grpc_options())
        rpc.add_DrafterServiceServicer_to_server(d, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", d

    yield start
    for s in servers:
        s.stop(grace=None).wait(10)


def _offer(v, after, tokens=(3, 4, 5), q=None, name="q.0", accepted=None, next_token=None):
    body = pb.Offers(after=after, blocks=[pb.Offer(
        id=7, accepted=list(v.accepted) if accepted is None else accepted,
        next_token=v.next_token if next_token is None else next_token, tokens=list(tokens),
        stats=pb.ProposalStats(speculative=True))])
    return body, ({} if q is None else {name: q})


def _session(address, limits: WireLimits = DEFAULT_LIMITS):
    remote = RemoteDrafter(vocab_size=V, propose_timeout_s=5.0, max_nodes=8, limits=limits)
    assert remote.attach("r", address) is None
    remote.begin([DraftContext("r", torch.tensor([1, 2, 3]), 4)])
    first = remote.propose(["r"], 2)
    assert first.tokens[0, :2].tolist() == [1, 2]
    remote.observe([Verdict("r", (0,), (1,), 9)])
    stream = remote._streams["r"]  # noqa: SLF001
    deadline = time.monotonic() + 5
    while stream._offers.empty() and time.monotonic() < deadline:  # noqa: SLF001 (the Offers have arrived)
        time.sleep(0.01)
    return remote


def test_an_offer_for_the_verdict_is_taken_without_a_proposal(serve):
    q = torch.softmax(torch.randn(3, V), -1)
    address, d = serve(lambda v, after: _offer(v, after, q=q))
    remote = _session(address)
    block = remote.propose(["r"], 2)
    assert block.tokens[0, :2].tolist() == [3, 4] and block.counts == (2,)
    torch.testing.assert_close(block.q[0, :2], q[:2])
    st = remote.pop_stats("r")
    assert st["offers_taken"] == 1 and st["spec_used"] == 1 and st["proposals"] == 2
    kinds = []
    for _ in range(4):  # what the drafter received (the last message may still be on its way)
        m = d.requests.get(timeout=5)
        kinds.append((m.kind, m.body.offer if m.kind == "propose_request" and m.body.HasField("offer") else None))
    assert kinds == [("begin", None), ("propose_request", None), ("verdict", None), ("propose_request", 7)]
    time.sleep(0.2)
    assert d.requests.empty() and not remote.fallbacks  # nothing else was sent, no Proposal was awaited
    remote.close()


@pytest.mark.parametrize("case", ["other_verdict", "other_block"])
def test_an_offer_for_another_verdict_or_block_is_not_taken(serve, case):
    if case == "other_verdict":
        address, _ = serve(lambda v, after: _offer(v, after, next_token=v.next_token + 1))
    else:
        address, _ = serve(lambda v, after: _offer(v, after - 1))
    remote = _session(address)
    block = remote.propose(["r"], 2)
    assert block.tokens[0, :2].tolist() == [1, 2]  # asked for and proposed
    assert remote.pop_stats("r")["offers_taken"] == 0 and not remote.fallbacks
    remote.close()


@pytest.mark.parametrize("case,why", [
    ("token", "outside the vocabulary"), ("q_shape", "q of shape"), ("q_negative", "finite and non-negative"),
    ("stray_tensor", "unexpected Offers tensors"), ("too_long", "nodes"),
])
def test_a_malformed_offer_drops_the_session_with_its_reason(serve, case, why):
    def offers(v, after):
        if case == "token":
            return _offer(v, after, tokens=(3, V + 5, 4))
        if case == "q_shape":
            return _offer(v, after, q=torch.full((3, V - 1), 1.0 / V))
        if case == "q_negative":
            return _offer(v, after, q=torch.full((3, V), -1.0))
        if case == "stray_tensor":
            return _offer(v, after, q=torch.zeros(3, V), name="hidden")
        return _offer(v, after, tokens=tuple(range(12)))

    address, _ = serve(offers)
    remote = _session(address)
    block = remote.propose(["r"], 2)
    assert block.counts == (0,)  # this step decodes alone; the output cannot change
    assert why in remote.fallbacks["r"], remote.fallbacks
    remote.close()


def test_a_drafter_flooding_offers_is_cut_off_at_the_backlog_bound(serve):
    """The verifier reads Offers on its own thread; a drafter that sends them faster than they are used (here 200
    per verdict) must not grow that backlog without end: past ``max_backlog_messages`` the reader stops, and the
    session is dropped with the reason (the step decodes alone) instead of taking any of the flood."""
    address, _ = serve(lambda v, after: _offer(v, after), flood=200)
    remote = _session(address, WireLimits(max_backlog_messages=8))
    stream = remote._streams["r"]  # noqa: SLF001
    deadline = time.monotonic() + 5
    while stream._broken is None and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)
    assert stream._backlog.messages <= 8  # noqa: SLF001 (what it held when it stopped)
    block = remote.propose(["r"], 2)
    assert block.counts == (0,)
    assert "not yet handled" in remote.fallbacks["r"], remote.fallbacks
    remote.close()


def test_offers_in_step_with_the_verifier_never_reach_the_bound(serve):
    """A correct drafter (one Offers message per verdict) stays far below even a tight bound over many blocks."""
    address, _ = serve(lambda v, after: _offer(v, after))
    remote = _session(address, WireLimits(max_backlog_messages=3))
    for _ in range(20):
        block = remote.propose(["r"], 2)
        assert block.counts == (2,)  # an offer or a proposal, never a fallback
        remote.observe([Verdict("r", (0,), (1,), 9)])
    assert not remote.fallbacks
    remote.close()
