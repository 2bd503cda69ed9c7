"""The DrafterService server on its own, driven frame by frame over real gRPC: a malformed or out-of-protocol
stream ends that session with an Error frame and frees it, while the server keeps serving other sessions."""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from specula.drafters import create
from specula.drafters.ngram import NgramDrafter
from specula.protos import load
from specula.runtime.dataplane import DrafterServer, DrafterUnavailable, SessionStream
from specula.runtime.wire import DEFAULT_LIMITS, WireLimits, encode_message, Message, pb

pb2_grpc = load("specula_dataplane").pb2_grpc


@pytest.fixture()
def server():
    drafter = create({"kind": "ngram", "max_n": 3})
    with DrafterServer(drafter, accept_codecs=["fp32", "fp16"]) as s:
        yield s


@pytest.fixture()
def stub(server):
    channel = grpc.insecure_channel(server.address, options=DEFAULT_LIMITS.grpc_options())
    yield pb2_grpc.DrafterServiceStub(channel)
    channel.close()


def _frames(*messages: Message) -> list:
    out = []
    for m in messages:
        out += encode_message(m)
    return out


def _answer(stub, frames) -> list:
    """Send ``frames`` (then half-close) and collect what the server answers until it ends the stream."""
    return list(stub.Session(iter(frames), timeout=10))


def _begin(seq=0, rid="r1", **tensors):
    return Message(rid, pb.Begin(prompt_ids=[5, 6, 7, 5, 6], first_token=7, codec="fp32"), tensors, seq)


def _wait_free(server, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while server.live_sessions and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.live_sessions == 0


def test_describe_reports_the_drafter(stub):
    info = stub.Describe(pb.DescribeRequest(), timeout=5)
    assert (info.kind, info.structure, list(info.accepted_codecs)) == ("ngram", "chain", ["fp32", "fp16"])
    assert info.max_message_bytes == DEFAULT_LIMITS.max_message_bytes


def test_a_session_proposes_observes_and_releases(server, stub):
    got = _answer(stub, _frames(_begin(), Message("r1", pb.ProposeRequest(gamma=3), {}, 1),
                                Message("r1", pb.Verdict(accepted=[0, 1], tokens=[5, 6], next_token=9), {}, 2),
                                Message("r1", pb.Release(reason="done"), {}, 3)))
    assert [f.kind for f in got] == [pb.KIND_PROPOSAL]
    assert list(got[0].proposal.tokens) == [5, 6, 7]  # continuation of the latest "6 7" ... "5 6 7" match
    assert _wait_free(server) and server.drafter._tokens == {}


@pytest.mark.parametrize("case", ["garbage_header", "propose_before_begin", "wrong_seq", "proposal_to_drafter",
                                  "two_begins", "lossy_codec_not_accepted"])
def test_malformed_stream_ends_the_session_with_an_error_and_the_server_stays_up(server, stub, case):
    if case == "garbage_header":
        f = encode_message(_begin())[0]
        f.header = b"\xc1\xc1 not msgpack"
        frames = [f]
    elif case == "propose_before_begin":
        frames = _frames(Message("r1", pb.ProposeRequest(gamma=2), {}, 0))
    elif case == "wrong_seq":
        frames = _frames(_begin(), Message("r1", pb.ProposeRequest(gamma=2), {}, 5))
    elif case == "proposal_to_drafter":
        frames = _frames(_begin(), Message("r1", pb.Proposal(tokens=[1]), {}, 1))
    elif case == "two_begins":
        frames = _frames(_begin(), _begin(seq=1))
    else:
        frames = _frames(Message("r1", pb.Begin(prompt_ids=[1, 2], first_token=3, codec="int8"), {}, 0))
    got = _answer(stub, frames)
    assert len(got) == 1 and got[0].kind == pb.KIND_ERROR, case
    want = pb.Error.CODE_UNSUPPORTED if case == "lossy_codec_not_accepted" else pb.Error.CODE_INVALID_FRAME
    assert got[0].error.code == want, got[0].error.message
    assert _wait_free(server) and server.drafter._tokens == {}  # the session's drafter state is gone
    # the server still serves a well-formed session
    ok = _answer(stub, _frames(_begin(rid="r2"), Message("r2", pb.ProposeRequest(gamma=2), {}, 1)))
    assert [f.kind for f in ok] == [pb.KIND_PROPOSAL] and list(ok[0].proposal.tokens) == [5, 6]


def test_a_broken_stream_frees_the_session(server, stub):
    s = SessionStream(stub, "r1", "fp16", DEFAULT_LIMITS)
    s.send(pb.Begin(prompt_ids=[5, 6, 7, 5, 6], first_token=7, codec="fp16"), {"hidden": torch.randn(6, 8)})
    s.send(pb.ProposeRequest(gamma=2))
    assert s.receive(5).kind == "proposal"
    assert server.live_sessions == 1 and len(server.drafter._tokens) == 1
    s.abort()  # the verifier vanishes: no Release
    assert _wait_free(server) and server.drafter._tokens == {}
    with pytest.raises(DrafterUnavailable):
        s.receive(1)


def _early(rid="r1", prompt=(5, 6, 7, 5, 6, 7)):
    return Message(rid, pb.Begin(prompt_ids=list(prompt), codec="fp32", early=True, gamma=3), {}, 0)


@pytest.mark.parametrize("first", [5, 9])
def test_an_early_begin_drafts_the_first_block_before_the_first_token_arrives(server, stub, first):
    """Begin.early: the prompt without a first token; the first token comes as a Verdict with nothing accepted.
    When it is the drafter's guess (ngram: 5 after "... 6 7") the first block was drafted before it came and is sent
    as such (speculative); otherwise the drafter rolls back and drafts from it. Either way the block is the one a
    Begin with that first token would have got."""
    assert stub.Describe(pb.DescribeRequest(), timeout=5).early_begin
    got = _answer(stub, _frames(_early(), Message("r1", pb.Verdict(accepted=[], tokens=[], next_token=first), {}, 1),
                                Message("r1", pb.ProposeRequest(gamma=3), {}, 2)))
    plain = _answer(stub, _frames(Message("r2", pb.Begin(prompt_ids=[5, 6, 7, 5, 6, 7], first_token=first,
                                                         codec="fp32"), {}, 0),
                                  Message("r2", pb.ProposeRequest(gamma=3), {}, 1)))
    assert [f.kind for f in got] == [f.kind for f in plain] == [pb.KIND_PROPOSAL]
    assert list(got[0].proposal.tokens) == list(plain[0].proposal.tokens)
    assert got[0].proposal.stats.speculative == (first == 5)
    assert _wait_free(server) and server.drafter._tokens == {}


def test_an_early_begin_is_refused_where_the_replica_does_not_offer_it():
    with DrafterServer(create({"kind": "ngram"}), overlap=False) as s:
        channel = grpc.insecure_channel(s.address, options=DEFAULT_LIMITS.grpc_options())
        try:
            stub = pb2_grpc.DrafterServiceStub(channel)
            assert not stub.Describe(pb.DescribeRequest(), timeout=5).early_begin
            got = _answer(stub, _frames(_early()))
        finally:
            channel.close()
        assert len(got) == 1 and got[0].error.code == pb.Error.CODE_UNSUPPORTED, got
        assert _wait_free(s)


def _wait_offers(s: SessionStream, timeout=5.0) -> list:
    deadline = time.monotonic() + timeout
    got = []
    while not got and time.monotonic() < deadline:
        got = s.offers()
        time.sleep(0.01)
    return got


def test_an_offer_taken_by_the_verifier_gets_no_proposal_and_is_the_block_it_would_have_asked_for(server, stub):
    """Begin.offers: drafting ahead past the guess of the first token (ngram: 5 after "... 6 7"), the replica sends
    the whole block as an Offer for the verdict "first token 5"; the verifier takes it (ProposeRequest.offer) and
    no Proposal comes for it: the next message answers the next ProposeRequest. The offered block is what a Begin
    with that first token would have been proposed."""
    assert stub.Describe(pb.DescribeRequest(), timeout=5).offers
    s = SessionStream(stub, "r1", "fp32", DEFAULT_LIMITS)
    s.send(pb.Begin(prompt_ids=[5, 6, 7, 5, 6, 7], codec="fp32", early=True, gamma=3, offers=True))
    offers = _wait_offers(s)
    assert len(offers) == 1, offers
    o, q = offers[0]
    assert (list(o.accepted), o.next_token) == ([], 5) and len(o.tokens) >= 3
    assert o.stats.speculative and not o.stats.branch and q is None  # ngram: deterministic, no q
    s.send(pb.Verdict(accepted=[], tokens=[], next_token=5))
    s.send(pb.ProposeRequest(gamma=3, offer=o.id))
    s.blocks += 1
    s.send(pb.Verdict(accepted=[0], tokens=[o.tokens[0]], next_token=1))  # a rejection at node 1
    s.send(pb.ProposeRequest(gamma=3))
    m = s.receive(5)
    assert m.kind == "proposal" and not m.body.stats.speculative  # the answer to the second request, drafted anew
    s.finish()
    plain = _answer(stub, _frames(Message("r2", pb.Begin(prompt_ids=[5, 6, 7, 5, 6, 7], first_token=5,
                                                         codec="fp32"), {}, 0),
                                  Message("r2", pb.ProposeRequest(gamma=3), {}, 1)))
    assert list(o.tokens)[:3] == list(plain[0].proposal.tokens)
    assert _wait_free(server) and server.drafter._tokens == {}


def test_taking_an_offer_the_verdict_did_not_keep_ends_the_session(server, stub):
    s = SessionStream(stub, "r1", "fp32", DEFAULT_LIMITS)
    s.send(pb.Begin(prompt_ids=[5, 6, 7, 5, 6, 7], codec="fp32", early=True, gamma=3, offers=True))
    o = _wait_offers(s)[0][0]
    s.send(pb.Verdict(accepted=[], tokens=[], next_token=9))  # not the guess: the offered block is dropped
    s.send(pb.ProposeRequest(gamma=3, offer=o.id))
    with pytest.raises(DrafterUnavailable, match="INVALID_FRAME.*not the block the last verdict kept"):
        s.receive(5)
    assert _wait_free(server) and server.drafter._tokens == {}


class _SlowBegin(NgramDrafter):
    """An ngram drafter whose begin takes a while: whatever the verifier sends meanwhile waits unhandled."""

    def begin(self, contexts) -> None:
        time.sleep(0.5)
        super().begin(contexts)


def test_a_verifier_sending_far_ahead_of_the_session_is_cut_off_at_the_backlog_bound():
    """The drafter reads each stream on its own thread (to see the next Verdict while it drafts ahead); a verifier
    that sends far more than the lock-step protocol has in flight must not grow that backlog without end: past
    ``max_backlog_messages`` the session ends with INVALID_FRAME and its state is freed."""
    with DrafterServer(_SlowBegin(max_n=3), limits=WireLimits(max_backlog_messages=4)) as server:
        channel = grpc.insecure_channel(server.address, options=DEFAULT_LIMITS.grpc_options())
        stub = pb2_grpc.DrafterServiceStub(channel)
        flood = [Message("r1", pb.ProposeRequest(gamma=2), {}, 1 + i) for i in range(100)]
        got = _answer(stub, _frames(_begin(), *flood))
        assert len(got) == 1 and got[0].kind == pb.KIND_ERROR, [f.kind for f in got]
        assert got[0].error.code == pb.Error.CODE_INVALID_FRAME and "not yet handled" in got[0].error.message
        assert _wait_free(server) and server.drafter._tokens == {}
        # three messages ahead of a slow begin (what the protocol can have in flight) stay within the same bound
        ok = _answer(stub, _frames(_begin(rid="r2"), Message("r2", pb.ProposeRequest(gamma=2), {}, 1),
                                   Message("r2", pb.Verdict(accepted=[0], tokens=[5], next_token=6), {}, 2),
                                   Message("r2", pb.ProposeRequest(gamma=2), {}, 3)))
        assert [f.kind for f in ok] == [pb.KIND_PROPOSAL] * 2
        channel.close()
