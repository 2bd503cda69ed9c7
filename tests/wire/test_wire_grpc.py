"""A real gRPC round trip on 127.0.0.1: an echo DrafterService that decodes and re-encodes every message."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
import torch

from specula.protos import load
from specula.runtime.wire import (
    FrameEncoder, Reassembler, WireError, WireLimits, error_message, negotiate_codec, pb,
)

pytestmark = pytest.mark.integration
rpc = load("specula_dataplane").pb2_grpc
LIMITS = WireLimits(max_message_bytes=4 << 20)  # gRPC's default size, but set explicitly on both ends
ACCEPTS = ["fp32", "fp32+lz4", "fp16", "int8+zstd"]


class EchoDrafter(rpc.DrafterServiceServicer):
    """Decodes each message and sends it back re-encoded with the session's codec; Release ends the session."""

    def Describe(self, request, context):
        return pb.DrafterInfo(kind="echo", structure="chain", accepted_codecs=ACCEPTS,
                              max_message_bytes=LIMITS.max_message_bytes)

    def Session(self, request_iterator, context):
        inbox, outbox, rid = Reassembler(LIMITS), FrameEncoder("fp32", LIMITS), ""
        try:
            for frame in request_iterator:
                rid = frame.request_id
                msg = inbox.feed(frame)
                if msg is None:
                    continue
                if msg.kind == "release":
                    return
                if msg.kind == "begin":
                    outbox = FrameEncoder(msg.body.codec, LIMITS)
                yield from outbox.encode(msg.request_id, msg.body, msg.tensors)
            inbox.close()
        except WireError as e:
            err = error_message(rid, e)
            yield from outbox.encode(rid, err.body)


@pytest.fixture
def stub():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=LIMITS.grpc_options())
    rpc.add_DrafterServiceServicer_to_server(EchoDrafter(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    assert port > 0
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=LIMITS.grpc_options())
    try:
        yield rpc.DrafterServiceStub(channel), port
    finally:
        channel.close()
        server.stop(grace=None).wait(10)


def test_10_mib_tensor_round_trips_in_chunks(stub):
    stub, _ = stub
    info = stub.Describe(pb.DescribeRequest(), timeout=10)
    codec = negotiate_codec(info.accepted_codecs, ["fp32+lz4", "fp32"])
    limits = WireLimits(max_message_bytes=min(LIMITS.max_message_bytes, info.max_message_bytes))
    assert codec == "fp32+lz4"
    x = torch.randn(2560, 1024, generator=torch.Generator().manual_seed(0))  # [T, H] fp32, 10 MiB
    kv = torch.randn(1, 2, 64, 16)  # [B, H_kv, T, D]
    out = FrameEncoder(codec, limits)
    frames = out.encode("r1", pb.Begin(prompt_ids=[1, 2, 3], first_token=4, codec=codec), {"hidden": x, "kv": kv})
    frames += out.encode("r1", pb.Verdict(accepted=[0], tokens=[5], next_token=6), {"hidden": x[:2]})
    frames += out.encode("r1", pb.Release(reason="done"))
    assert len(frames) >= 4 and all(f.ByteSize() <= limits.max_message_bytes for f in frames)
    got = list(Reassembler(limits).feed_all(stub.Session(iter(frames), timeout=60)))
    assert [m.kind for m in got] == ["begin", "verdict"]
    assert torch.equal(got[0].tensors["hidden"], x) and torch.equal(got[0].tensors["kv"], kv)
    assert torch.equal(got[1].tensors["hidden"], x[:2]) and got[1].body.next_token == 6
    assert list(got[0].body.prompt_ids) == [1, 2, 3]


def test_server_refuses_an_unchunked_oversized_message(stub):
    _, port = stub
    big = WireLimits(max_message_bytes=16 << 20)  # a client that would send 5 MiB in one message
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=big.grpc_options()) as channel:
        frame = pb.DataplaneFrame(kind=pb.KIND_RELEASE, request_id="r", chunk_count=1, release=pb.Release(),
                                  payload=bytes(5 << 20))
        with pytest.raises(grpc.RpcError) as info:
            list(rpc.DrafterServiceStub(channel).Session(iter([frame]), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_client_refuses_to_send_over_its_limit(stub):
    stub, _ = stub
    frame = pb.DataplaneFrame(kind=pb.KIND_RELEASE, request_id="r", chunk_count=1, release=pb.Release(),
                              payload=bytes(5 << 20))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Session(iter([frame]), timeout=30))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_malformed_frame_gets_an_error_message_back(stub):
    stub, _ = stub
    bad = pb.DataplaneFrame(kind=pb.KIND_VERDICT, request_id="r9", chunk_count=1, verdict=pb.Verdict(),
                            header=b"\xc1 not msgpack")
    (m,) = list(Reassembler(LIMITS).feed_all(stub.Session(iter([bad]), timeout=30)))
    assert m.kind == "error" and m.request_id == "r9"
    assert m.body.code == pb.Error.CODE_INVALID_FRAME and "msgpack" in m.body.message
