"""Messages <-> frames: chunking under the message limit, reassembly, and adversarial chunk sequences."""

from __future__ import annotations

import re

import pytest
import torch

from specula.runtime.wire import (
    DEFAULT_MAX_MESSAGE_BYTES, FrameEncoder, Message, Reassembler, WireError, WireLimits, encode_message,
    error_message, pb,
)

SMALL = WireLimits(max_message_bytes=4096)


def feed_all(frames, limits=SMALL, **kw) -> list[Message]:
    return list(Reassembler(limits, **kw).feed_all(frames))


def big_message(nbytes: int, seq: int = 0) -> Message:
    x = torch.randn(nbytes // 4 // 1024, 1024, generator=torch.Generator().manual_seed(1))  # [T, 1024] fp32
    begin = pb.Begin(prompt_ids=list(range(100)), first_token=7, sampling=pb.SamplingParams(temperature=0.7, seed=3),
                     codec="fp32")
    return Message("req-1", begin, {"hidden": x, "prompt": torch.arange(100)}, seq)


def test_every_body_kind_round_trips_with_tensors():
    bodies = [
        (pb.Begin(prompt_ids=[1, 2, 3], first_token=4, codec="fp16"), {"visual": torch.randn(1, 5, 8)}),
        (pb.ProposeRequest(gamma=5), {}),
        (pb.Proposal(tokens=[3, 4, 5], parents=[-1, 0, 0]), {"q": torch.softmax(torch.randn(3, 11), -1)}),
        (pb.Verdict(accepted=[0, 1], tokens=[3, 4], next_token=9), {"hidden": torch.randn(3, 8)}),
        (pb.Release(reason="done"), {}),
        (pb.Error(code=pb.Error.CODE_INTERNAL, message="boom"), {}),
    ]
    enc = FrameEncoder("fp16+lz4", SMALL)
    frames = [f for body, tensors in bodies for f in enc.encode("r1", body, tensors)]
    got = feed_all(frames)
    assert [m.kind for m in got] == ["begin", "propose_request", "proposal", "verdict", "release", "error"]
    assert [m.seq for m in got] == list(range(6))
    for (body, tensors), m in zip(bodies, got):
        assert m.body == body and m.request_id == "r1" and set(m.tensors) == set(tensors)
    assert torch.equal(got[2].tensors["q"], bodies[2][1]["q"])  # Proposal.q: exact whatever the session codec
    assert torch.allclose(got[3].tensors["hidden"], bodies[3][1]["hidden"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("limit", [DEFAULT_MAX_MESSAGE_BYTES, 1 << 16, 4096])
def test_large_tensor_is_chunked_under_the_limit_and_reassembled_exactly(limit):
    msg = big_message(6 << 20)  # 6 MiB > gRPC's 4 MiB default
    limits = WireLimits(max_message_bytes=limit)
    frames = encode_message(msg, codec="fp32", limits=limits)
    sizes = [f.ByteSize() for f in frames]
    assert len(frames) > 1 and max(sizes) <= limit
    assert min(sizes[:-1]) >= limit - 16  # budgets are computed, not guessed: frames are full
    assert all(f.chunk_count == len(frames) and f.chunk_index == i for i, f in enumerate(frames))
    assert frames[0].HasField("begin") and all(not f.header and f.WhichOneof("body") is None for f in frames[1:])
    (m,) = feed_all(frames, limits)
    assert torch.equal(m.tensors["hidden"], msg.tensors["hidden"]) and torch.equal(m.tensors["prompt"],
                                                                                    msg.tensors["prompt"])
    assert m.body == msg.body


def test_frames_survive_serialization():
    frames = encode_message(big_message(64 << 10), codec="int8+zstd", limits=SMALL)
    wire = [pb.DataplaneFrame.FromString(f.SerializeToString()) for f in frames]
    (m,) = feed_all(wire)
    assert m.tensors["hidden"].shape == (16, 1024)


def test_empty_and_scalar_tensors_and_no_tensors():
    msg = Message("r", pb.Verdict(next_token=1), {"e": torch.zeros(0, 4), "s": torch.tensor(2.5)})
    (m,) = feed_all(encode_message(msg, codec="int8+zstd"))
    assert m.tensors["e"].shape == (0, 4) and m.tensors["s"].item() == 2.5
    (m,) = feed_all(encode_message(Message("r", pb.ProposeRequest(gamma=3))))
    assert m.tensors == {} and m.body.gamma == 3


def chunked(nbytes=40 << 10, seq=0):
    frames = encode_message(big_message(nbytes, seq), codec="fp32", limits=SMALL)
    assert len(frames) >= 5
    return frames


def copy(f, **changes):
    g = pb.DataplaneFrame()
    g.CopyFrom(f)
    for k, v in changes.items():
        if k in ("begin", "release"):
            getattr(g, k).CopyFrom(v)
        else:
            setattr(g, k, v)
    return g


ADVERSARIAL = {
    "missing-middle-chunk": (lambda fs: fs[:2] + fs[3:], "expected chunk 2, got 3"),
    "missing-last-chunk": (lambda fs: fs[:-1], "stream ended inside message"),
    "duplicate-chunk": (lambda fs: fs[:3] + fs[2:], "expected chunk 3, got 2 (duplicate"),
    "swapped-chunks": (lambda fs: fs[:1] + [fs[2], fs[1]] + fs[3:], "expected chunk 1, got 2"),
    "starts-without-chunk-0": (lambda fs: fs[1:], "arrived before chunk 0"),
    "chunk-of-another-seq": (lambda fs: fs[:2] + [copy(fs[2], seq=1)] + fs[3:], "while seq 0 is incomplete"),
    "chunk-count-changes": (lambda fs: fs[:2] + [copy(fs[2], chunk_count=len(fs) + 1)] + fs[3:], "differ"),
    "kind-changes": (lambda fs: fs[:2] + [copy(fs[2], kind=pb.KIND_VERDICT)] + fs[3:], "differ"),
    "request-id-changes": (lambda fs: fs[:2] + [copy(fs[2], request_id="other")] + fs[3:], "differ"),
    "header-on-continuation": (lambda fs: fs[:2] + [copy(fs[2], header=b"\x80")] + fs[3:], "only chunk 0"),
    "body-on-continuation": (lambda fs: fs[:2] + [copy(fs[2], release=pb.Release())] + fs[3:], "only chunk 0"),
    "truncated-last-chunk": (lambda fs: fs[:-1] + [copy(fs[-1], payload=fs[-1].payload[:-1])], "truncated"),
    "extra-payload": (lambda fs: fs[:-1] + [copy(fs[-1], payload=fs[-1].payload + b"x")], "header declares"),
    "index-past-count": (lambda fs: fs[:1] + [copy(fs[1], chunk_index=len(fs))], ">= chunk_count"),
    "zero-chunk-count": (lambda fs: [copy(fs[0], chunk_count=0)], "chunk_count 0"),
    "too-many-chunks": (lambda fs: [copy(fs[0], chunk_count=10**6)], "max_chunks"),
    "seq-skips": (lambda fs: [copy(f, seq=2) for f in fs], "expected message seq 0, got 2"),
    "message-replayed": (lambda fs: fs + fs, "expected message seq 1, got 0"),
    "oversized-frame": (lambda fs: [copy(fs[0], payload=fs[0].payload + bytes(5000))], "max_message_bytes"),
}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_adversarial_chunk_sequences_are_refused(name):
    mutate, match = ADVERSARIAL[name]
    with pytest.raises(WireError, match=re.escape(match)):
        feed_all(mutate(chunked()))


def test_an_error_poisons_the_reassembler():
    fs = chunked()
    r = Reassembler(SMALL)
    r.feed(fs[0])
    with pytest.raises(WireError):
        r.feed(fs[2])
    with pytest.raises(WireError, match="already failed"):
        r.feed(fs[1])


def test_declared_total_over_limit_is_refused_at_chunk_0():
    fs = chunked(64 << 10)
    r = Reassembler(WireLimits(max_message_bytes=4096, max_total_bytes=32 << 10))
    with pytest.raises(WireError, match="max_total_bytes"):
        r.feed(fs[0])


def test_pending_and_close():
    fs = chunked()
    r = Reassembler(SMALL)
    assert r.feed(fs[0]) is None and r.pending
    for f in fs[1:-1]:
        assert r.feed(f) is None
    assert r.feed(fs[-1]) is not None and not r.pending
    r.close()


def test_proposal_q_is_always_exact():
    q = torch.softmax(torch.randn(4, 32), -1)  # [N, V] fp32
    proposal = Message("r", pb.Proposal(tokens=[1, 2, 3, 4]), {"q": q})
    for codec in ("fp16", "bf16+lz4", "int8+zstd", "fp32+zstd"):
        (m,) = feed_all(encode_message(proposal, codec=codec))  # a lossy session codec does not apply to q
        assert torch.equal(m.tensors["q"], q), codec
    for codec in ("fp16", "bf16+lz4", "int8+zstd"):
        with pytest.raises(WireError, match="losslessly"):
            encode_message(proposal, codecs={"q": codec})  # asking for it by name is a bug
    q16 = q.half()  # a drafter that sampled from an fp16 q may send it as fp16: that is exact
    (m,) = feed_all(encode_message(Message("r", pb.Proposal(tokens=[1, 2, 3, 4]), {"q": q16}), codec="fp16"))
    assert torch.equal(m.tensors["q"], q16)


def test_per_tensor_codec_overrides():
    msg = Message("r", pb.Verdict(next_token=1), {"hidden": torch.randn(4, 8), "last_k": torch.randn(2, 4, 8)})
    frames = encode_message(msg, codec="int8", codecs={"hidden": "fp32"})
    (m,) = feed_all(frames)
    assert torch.equal(m.tensors["hidden"], msg.tensors["hidden"])
    assert not torch.equal(m.tensors["last_k"], msg.tensors["last_k"])


def test_sender_side_limits():
    with pytest.raises(WireError, match="exceed max_message_bytes"):
        encode_message(Message("r", pb.Begin(prompt_ids=list(range(5000)))), limits=SMALL)
    with pytest.raises(WireError, match="max_total_bytes"):
        encode_message(big_message(64 << 10), limits=WireLimits(max_total_bytes=1 << 10))
    with pytest.raises(WireError, match="max_chunks"):
        encode_message(big_message(64 << 10), limits=WireLimits(max_message_bytes=4096, max_chunks=4))
    with pytest.raises(WireError, match="body must be one of"):
        encode_message(Message("r", pb.DataplaneFrame()))
    with pytest.raises(WireError, match="tensor names"):
        encode_message(Message("r", pb.Release(), {"": torch.zeros(1)}))
    with pytest.raises(ValueError, match="max_message_bytes"):
        WireLimits(max_message_bytes=10)


def test_error_message_for_a_wire_error():
    m = error_message("r", WireError("bad chunk"), seq=3)
    assert m.kind == "error" and m.body.code == pb.Error.CODE_INVALID_FRAME and "bad chunk" in m.body.message
    assert error_message("r", RuntimeError("x")).body.code == pb.Error.CODE_INTERNAL


def test_grpc_options_set_both_limits_explicitly():
    assert WireLimits(max_message_bytes=8 << 20).grpc_options() == [
        ("grpc.max_send_message_length", 8 << 20), ("grpc.max_receive_message_length", 8 << 20)]
