"""Data-plane fuzz: >= 10,000 random or mutated tensor frames are each decoded or refused with a WireError (or a
protobuf DecodeError for bytes that are not a frame at all); nothing else escapes, and no buffer larger than the
declared limits is ever allocated.

The corpus is valid traffic of every kind (proposals with q, verdicts with hidden states and last-layer KV, begins
with visual features, multi-chunk messages) under every codec; mutations act at three levels:
  bytes    - flips, truncation, insertion, splicing two frames, pure noise;
  frame    - protobuf fields (kind, seq, chunk index/count, request id, header/payload swapped or cut);
  header   - msgpack tensor entries with fields replaced by wrong types, huge or negative sizes, bad dtypes/codecs;
and multi-chunk streams are reordered, duplicated or cut. A frame that still decodes is fine (a flipped float bit
is not detectable); what matters is that the only outcomes are "decoded" and "refused with a message".
"""

from __future__ import annotations

import random
import resource

import msgpack
import torch
from google.protobuf.message import DecodeError

import specula.runtime.wire.tensor as tensor_mod
from specula.runtime.wire import Message, Reassembler, WireError, WireLimits, encode_message, pb

from reliability_kit import record_figure, scale

LIMITS = WireLimits(max_message_bytes=8192, max_total_bytes=1 << 20, max_tensor_bytes=1 << 20, max_chunks=64)
CODECS = ("fp32", "fp16", "bf16", "int8", "fp16+lz4", "int8+zstd", "fp32+zstd")


def corpus() -> list[list[bytes]]:
    """Valid messages, each as the serialized frames of one stream."""
    g = torch.Generator().manual_seed(0)
    msgs = []
    for i, codec in enumerate(CODECS):
        msgs.append((Message("r1", pb.Verdict(accepted=[0, 1], tokens=[4, 9], next_token=2),
                             {"hidden": torch.randn(3, 32, generator=g), "last_k": torch.randn(1, 2, 3, 8, generator=g)},
                             seq=i), codec))
        msgs.append((Message("r2", pb.Proposal(tokens=[3, 5, 7]), {"q": torch.softmax(torch.randn(3, 50, generator=g), -1)},
                             seq=i), codec))
        # big enough to need several chunks at max_message_bytes=8192
        msgs.append((Message("r3", pb.Verdict(accepted=[], tokens=[], next_token=1),
                             {"visual": torch.randn(4, 36, 64, generator=g)}, seq=i), codec))
    out = []
    for m, codec in msgs:
        frames = encode_message(m, codec=codec, limits=LIMITS)
        out.append([f.SerializeToString() for f in frames])
    assert any(len(s) > 2 for s in out), "the corpus must include multi-chunk messages"
    return out


def _mutate_bytes(rng: random.Random, data: bytes, other: bytes) -> bytes:
    b = bytearray(data)
    op = rng.randrange(6)
    if op == 0:
        for _ in range(rng.randrange(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 1:
        del b[rng.randrange(len(b)):]
    elif op == 2:
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    elif op == 3:
        i = rng.randrange(len(b))
        b = b[:i] + bytearray(other[rng.randrange(len(other)):])
    elif op == 4:
        b = bytearray(rng.randbytes(rng.randrange(1, 512)))
    else:
        i, j = sorted(rng.randrange(len(b)) for _ in range(2))
        b[i:j] = b[i:j][::-1]
    return bytes(b)


_WEIRD = (None, True, -1, 0, 2**31, 2**63 - 1, -(2**63), 1.5, float("nan"), "", "x" * 300, b"\x00" * 9, [], {},
          [1, -1], [2**20, 2**20], [0], "float64", "complex64", "int8+gzip", "fp32+zstd", "raw")


def _mutate_header(rng: random.Random, frame: pb.DataplaneFrame) -> None:
    if not frame.header:
        frame.header = msgpack.packb({"v": 1, "tensors": [{"name": "x", "dtype": rng.choice(_WEIRD[15:])}]})
        return
    head = msgpack.unpackb(frame.header, strict_map_key=False)
    entries = head.get("tensors") or []
    if entries and rng.random() < 0.8:
        e = rng.choice(entries)
        key = rng.choice(sorted(e) + ["extra"])
        v = rng.choice(_WEIRD)
        if rng.random() < 0.3 and isinstance(e.get(key), int) and not isinstance(e.get(key), bool):
            v = e[key] + rng.choice((-1, 1, 7, 1 << 20, 1 << 40))
        e[key] = v
    else:
        head[rng.choice(["v", "tensors", "zz"])] = rng.choice(_WEIRD)
    frame.header = msgpack.packb(head)


def _mutate_frame(rng: random.Random, frame: pb.DataplaneFrame) -> None:
    op = rng.randrange(7)
    if op == 0:
        frame.kind = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 99, 2**31 - 1])
    elif op == 1:
        frame.seq = rng.choice([1, 2, 2**63, 2**64 - 1])
    elif op == 2:
        frame.chunk_index = rng.choice([0, 1, 5, 2**32 - 1])
    elif op == 3:
        frame.chunk_count = rng.choice([0, 1, 2, 65, 4096, 2**32 - 1])
    elif op == 4:
        frame.request_id = rng.choice(["", "r" * 500, "\u00e9\u00e9", "r2"])
    elif op == 5:
        frame.payload = frame.payload[: rng.randrange(len(frame.payload) + 1)] + rng.randbytes(rng.randrange(3))
    else:
        frame.header, frame.payload = frame.payload[:200], frame.header


def _stream_variant(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    op = rng.randrange(4)
    f = list(frames)
    if op == 0:
        rng.shuffle(f)
    elif op == 1:
        i = rng.randrange(len(f))
        f.insert(i, f[i])
    elif op == 2:
        del f[rng.randrange(len(f))]
    else:
        f = f + frames  # the same message twice (seq does not advance)
    return f


def test_ten_thousand_mutated_frames_are_decoded_or_refused(monkeypatch):
    largest = [0]
    real = tensor_mod._from_bytes

    def counting(buf, dtype):  # the decoder's only allocation of tensor storage
        largest[0] = max(largest[0], len(buf))
        return real(buf, dtype)

    monkeypatch.setattr(tensor_mod, "_from_bytes", counting)
    streams = corpus()
    flat = [f for s in streams for f in s]
    rng = random.Random(1234)
    n = scale(10_000, 100_000)
    outcomes = {"decoded": 0, "wire_error": 0, "not_a_frame": 0}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(n):
        stream = rng.choice(streams)
        level = i % 4
        if level == 0:
            raw = [_mutate_bytes(rng, rng.choice(stream), rng.choice(flat))]
        elif level == 3 and len(stream) > 1:
            raw = _stream_variant(rng, stream)
        else:
            raw = list(stream)
            j = rng.randrange(len(raw))
            f = pb.DataplaneFrame.FromString(raw[j])
            (_mutate_header if level == 1 else _mutate_frame)(rng, f)
            raw[j] = f.SerializeToString()
        r = Reassembler(LIMITS)
        try:
            frames = [pb.DataplaneFrame.FromString(b) for b in raw]
        except DecodeError:
            outcomes["not_a_frame"] += 1
            continue
        try:
            for f in frames:
                r.feed(f)
            r.close()
            outcomes["decoded"] += 1
        except WireError as e:
            assert str(e), "a refusal must say why"
            outcomes["wire_error"] += 1
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024  # KiB -> MiB
    record_figure(
        "test_ten_thousand_mutated_frames_are_decoded_or_refused",
        f"{n} fuzzed frames/streams: {outcomes['decoded']} decoded, {outcomes['wire_error']} refused with "
        f"WireError, {outcomes['not_a_frame']} not protobuf; largest tensor buffer {largest[0]} B "
        f"(limit {LIMITS.max_tensor_bytes}); max RSS +{rss_growth:.1f} MiB",
        frames=n, **outcomes, largest_tensor_b=largest[0], limit_tensor_b=LIMITS.max_tensor_bytes,
        rss_growth_mib=round(rss_growth, 1))
    assert sum(outcomes.values()) == n
    assert outcomes["wire_error"] > n // 4, outcomes  # the mutations really hit the checks
    assert largest[0] <= LIMITS.max_tensor_bytes
    assert rss_growth < 64, f"RSS grew {rss_growth:.1f} MiB while fuzzing"


def test_pure_noise_never_escapes():
    rng = random.Random(7)
    refused = 0
    for _ in range(scale(2_000, 20_000)):
        raw = rng.randbytes(rng.randrange(0, 2048))
        try:
            f = pb.DataplaneFrame.FromString(raw)
        except DecodeError:
            refused += 1
            continue
        try:
            Reassembler(LIMITS).feed(f)
        except WireError:
            refused += 1
    record_figure("test_pure_noise_never_escapes", f"noise frames refused: {refused}", refused=refused)
    assert refused > 0
