"""Messages <-> DataplaneFrames (protos/specula_dataplane.proto): chunking under the gRPC message limit, reassembly.

A ``Message`` is a typed body (``Begin``, ``ProposeRequest``, ``Proposal``, ``Verdict``, ``Release``, ``Error``)
plus named tensors. On the wire it is ``chunk_count`` frames with one ``seq``::

    frame 0:  kind, request_id, seq, chunk_index=0, chunk_count, body (oneof), header (msgpack), payload[0:a]
    frame i:  kind, request_id, seq, chunk_index=i, chunk_count,                                 payload[a:b]

    header  = msgpack {"v": 1, "tensors": [{"name": "hidden", <tensor header, see tensor.py>}, ...]}
    payload = the tensors' encoded payloads concatenated in header order, split across the frames

Every frame serializes to at most ``WireLimits.max_message_bytes`` (the budgets are computed from the protobuf
encoding, not guessed). The receiver (``Reassembler``) checks every frame against the stream's state and the
limits and raises ``WireError`` on the first problem: kind/body mismatch, a header that is not what tensor.py
accepts, seq out of order, a chunk missing, duplicated or out of order, more or fewer payload bytes than the
header declares, or a lossy codec on a ``Proposal`` (its ``q`` feeds the rejection rule, so it must be exact).
Chunks of one message are never interleaved with another's: a stream is one request's session (docs/design.md,
"Where state lives").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import msgpack
import torch

from specula.protos import load

from .codecs import Codec, parse_codec
from .errors import WireError
from .limits import DEFAULT_LIMITS, WireLimits
from .tensor import TensorSpec, decode_tensor, encode_tensor, validate_header

pb = load("specula_dataplane").pb2

HEADER_VERSION = 1
MAX_NAME_CHARS = 64
MAX_REQUEST_ID_CHARS = 256
KIND_OF = {  # oneof field name -> Kind enum value
    "begin": pb.KIND_BEGIN, "propose_request": pb.KIND_PROPOSE_REQUEST, "proposal": pb.KIND_PROPOSAL,
    "verdict": pb.KIND_VERDICT, "release": pb.KIND_RELEASE, "error": pb.KIND_ERROR, "offers": pb.KIND_OFFERS,
}
BODY_OF = {v: k for k, v in KIND_OF.items()}
_FIELD_OF_TYPE = {"Begin": "begin", "ProposeRequest": "propose_request", "Proposal": "proposal",
                  "Verdict": "verdict", "Release": "release", "Error": "error", "Offers": "offers"}
LOSSLESS_ONLY = frozenset({"proposal", "offers"})  # drafter -> verifier tensors the target's decision uses
_U32 = (1 << 32) - 1  # placeholder for size computations: the widest varint a uint32 field can take
_PAYLOAD_TAG_AND_LEN = 1 + 5  # field 7 tag + length varint (< 2 GiB)


@dataclass(frozen=True)
class Message:
    """One logical message of a session. ``body`` is a message of the generated module (``pb.Verdict(...)``)."""

    request_id: str
    body: object  # pb.Begin | pb.ProposeRequest | pb.Proposal | pb.Offers | pb.Verdict | pb.Release | pb.Error
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    seq: int = 0

    @property
    def kind(self) -> str:
        """The body's oneof field name: "begin", "propose_request", "proposal", "offers", "verdict", "release",
        "error"."""
        return _body_field(self.body)


def encode_message(
    msg: Message,
    *,
    codec: str = "fp32",
    codecs: Mapping[str, str] | None = None,
    limits: WireLimits = DEFAULT_LIMITS,
    scale_dtype: torch.dtype = torch.float32,
    level: int | None = None,
) -> list:
    """``msg`` -> its DataplaneFrames. Float tensors use ``codecs[name]`` or ``codec``; others travel raw.

    Tensors of ``LOSSLESS_ONLY`` messages (``Proposal.q``, the Offers' q) ignore a lossy session ``codec`` and travel
    raw (same compression); asking for a lossy codec for them by name in ``codecs`` is a WireError.

        >>> frames = encode_message(Message("r1", pb.Verdict(accepted=[0, 1], tokens=[5, 7], next_token=9),
        ...                                 {"hidden": torch.randn(3, 64)}, seq=4), codec="fp16")
        >>> len(frames), frames[0].chunk_count, frames[0].WhichOneof("body")
        (1, 1, 'verdict')
    """
    kind = _body_field(msg.body)
    _check_request_id(msg.request_id)
    if isinstance(msg.seq, bool) or not isinstance(msg.seq, int) or not 0 <= msg.seq < 1 << 64:
        raise WireError(f"seq must be an int in [0, 2**64), got {msg.seq!r}")
    if len(msg.tensors) > limits.max_tensors:
        raise WireError(f"{len(msg.tensors)} tensors in one message > max_tensors={limits.max_tensors}")
    heads, payloads = [], []
    for name, t in msg.tensors.items():
        _check_name(name)
        if not isinstance(t, torch.Tensor):
            raise WireError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        explicit = (codecs or {}).get(name)
        c = parse_codec(explicit or codec).for_dtype(t.dtype)
        if kind in LOSSLESS_ONLY and not c.is_lossless(t.dtype):
            if explicit:
                raise WireError(f"{kind}.{name} must travel losslessly (it feeds the rejection rule); "
                                f"{c.name} is lossy for {t.dtype}")
            c = Codec("raw", c.compression)  # the session codec is for features; this tensor goes exact
        h, p = encode_tensor(t, c.name, scale_dtype=scale_dtype, level=level)
        heads.append({"name": name, **h})
        payloads.append(p)
    header = msgpack.packb({"v": HEADER_VERSION, "tensors": heads}) if heads else b""
    if len(header) > limits.max_header_bytes:
        raise WireError(f"header of {len(header)} bytes > max_header_bytes={limits.max_header_bytes}")
    total = sum(len(p) for p in payloads)
    if total > limits.max_total_bytes:
        raise WireError(f"message payload of {total} bytes > max_total_bytes={limits.max_total_bytes}")

    first = pb.DataplaneFrame(kind=KIND_OF[kind], request_id=msg.request_id, seq=msg.seq, chunk_index=0,
                              chunk_count=_U32, header=header, **{kind: msg.body})
    rest = pb.DataplaneFrame(kind=KIND_OF[kind], request_id=msg.request_id, seq=msg.seq, chunk_index=_U32,
                             chunk_count=_U32)
    budget0 = limits.max_message_bytes - first.ByteSize() - _PAYLOAD_TAG_AND_LEN
    budget = limits.max_message_bytes - rest.ByteSize() - _PAYLOAD_TAG_AND_LEN
    if budget0 < 0:
        raise WireError(f"{kind} body + header ({first.ByteSize()} bytes) exceed max_message_bytes="
                        f"{limits.max_message_bytes}; send large data as tensors")
    first_size = min(total, budget0)
    count = 1 + -(-(total - first_size) // budget)  # ceil
    if count > limits.max_chunks:
        raise WireError(f"message needs {count} chunks > max_chunks={limits.max_chunks}")
    sizes = [first_size] + [min(budget, total - first_size - i * budget) for i in range(count - 1)]

    frames, pieces = [], _slices(payloads, sizes)
    for i, data in enumerate(pieces):
        f = first if i == 0 else pb.DataplaneFrame()
        if i:
            f.CopyFrom(rest)
            f.chunk_index = i
        f.chunk_count = len(sizes)
        f.payload = data
        frames.append(f)
    return frames


class FrameEncoder:
    """One direction of a session: numbers messages 0, 1, 2, ... and encodes them with the negotiated codec."""

    def __init__(self, codec: str = "fp32", limits: WireLimits = DEFAULT_LIMITS, **options) -> None:
        parse_codec(codec)
        self.codec, self.limits, self.options, self.seq = codec, limits, options, 0

    def encode(self, request_id: str, body: object, tensors: Mapping[str, torch.Tensor] | None = None,
               codecs: Mapping[str, str] | None = None) -> list:
        frames = encode_message(Message(request_id, body, tensors or {}, self.seq), codec=self.codec,
                                codecs=codecs, limits=self.limits, **self.options)
        self.seq += 1
        return frames


@dataclass
class _Partial:
    seq: int
    kind: int
    request_id: str
    chunk_count: int
    body: object
    specs: list[tuple[str, TensorSpec, dict]]  # (name, validated spec, header as sent minus "name")
    declared: int  # payload bytes the header declares
    parts: list[bytes]
    received: int = 0
    next_index: int = 1


class Reassembler:
    """The receiving side of one direction of a session: ``feed`` frames in arrival order, get ``Message``s.

    The first WireError poisons it (a session with a bad frame is over; the peer gets an Error and the stream
    ends). Call ``close()`` when the stream ends, to catch a message cut off mid-way. One per stream direction,
    fed from one thread (a gRPC request iterator is).

        >>> r = Reassembler()
        >>> [m for f in frames if (m := r.feed(f)) is not None]  # doctest: +SKIP
    """

    def __init__(self, limits: WireLimits = DEFAULT_LIMITS, *, device: str | torch.device = "cpu",
                 first_seq: int = 0) -> None:
        self.limits, self.device, self.next_seq = limits, device, first_seq
        self._open: _Partial | None = None
        self._failed: str | None = None

    @property
    def pending(self) -> bool:
        """Whether a message is partially received."""
        return self._open is not None

    def feed(self, frame: object) -> Message | None:
        if self._failed is not None:
            raise WireError(f"stream already failed: {self._failed}")
        try:
            return self._feed(frame)
        except WireError as e:
            self._failed = str(e)
            raise

    def feed_all(self, frames: Iterable[object]) -> Iterator[Message]:
        """Messages from a frame iterator (e.g. a gRPC request iterator), then ``close()``."""
        for f in frames:
            msg = self.feed(f)
            if msg is not None:
                yield msg
        self.close()

    def close(self) -> None:
        p = self._open
        if p is not None:
            raise WireError(f"stream ended inside message seq {p.seq}: got {p.next_index} of {p.chunk_count} chunks")

    def _feed(self, f: object) -> Message | None:
        if not isinstance(f, pb.DataplaneFrame):
            raise WireError(f"expected a DataplaneFrame, got {type(f).__name__}")
        if f.ByteSize() > self.limits.max_message_bytes:
            raise WireError(f"frame of {f.ByteSize()} bytes > max_message_bytes={self.limits.max_message_bytes}")
        if f.kind not in BODY_OF:
            raise WireError(f"unknown frame kind {f.kind}")
        if not 1 <= f.chunk_count <= self.limits.max_chunks:
            raise WireError(f"chunk_count {f.chunk_count} outside [1, max_chunks={self.limits.max_chunks}]")
        if f.chunk_index >= f.chunk_count:
            raise WireError(f"chunk_index {f.chunk_index} >= chunk_count {f.chunk_count}")
        p = self._open
        if p is None:
            self._start(f)
        else:
            self._continue(p, f)
        p = self._open
        if p.next_index < p.chunk_count:
            return None
        self._open = None
        self.next_seq += 1
        return self._finish(p)

    def _start(self, f) -> None:
        if f.chunk_index != 0:
            raise WireError(f"seq {f.seq}: chunk {f.chunk_index} of {f.chunk_count} arrived before chunk 0 "
                            "(missing or out-of-order chunk)")
        if f.seq != self.next_seq:
            raise WireError(f"expected message seq {self.next_seq}, got {f.seq} (lost, duplicated or reordered)")
        _check_request_id(f.request_id)
        body = f.WhichOneof("body")
        if body != BODY_OF[f.kind]:
            raise WireError(f"frame kind {pb.Kind.Name(f.kind)} carries body {body!r}")
        specs = self._parse_header(f.header, body)
        declared = sum(s.payload_nbytes for _, s, _ in specs)
        if declared > self.limits.max_total_bytes:
            raise WireError(f"message declares {declared} payload bytes > "
                            f"max_total_bytes={self.limits.max_total_bytes}")
        self._open = _Partial(f.seq, f.kind, f.request_id, f.chunk_count, getattr(f, body), specs, declared, [])
        self._take(self._open, f.payload)

    def _continue(self, p: _Partial, f) -> None:
        if f.seq != p.seq:
            raise WireError(f"frame of seq {f.seq} arrived while seq {p.seq} is incomplete "
                            f"(got {p.next_index} of {p.chunk_count} chunks)")
        if (f.kind, f.request_id, f.chunk_count) != (p.kind, p.request_id, p.chunk_count):
            raise WireError(f"seq {p.seq} chunk {f.chunk_index}: kind, request_id or chunk_count differ from chunk 0")
        if f.chunk_index != p.next_index:
            what = "duplicate or out of order" if f.chunk_index < p.next_index else "missing or out of order"
            raise WireError(f"seq {p.seq}: expected chunk {p.next_index}, got {f.chunk_index} ({what})")
        if f.header or f.WhichOneof("body") is not None:
            raise WireError(f"seq {p.seq} chunk {f.chunk_index}: only chunk 0 may carry a header or body")
        p.next_index += 1
        self._take(p, f.payload)

    def _take(self, p: _Partial, data: bytes) -> None:
        p.received += len(data)
        if p.received > p.declared:
            raise WireError(f"seq {p.seq}: received {p.received} payload bytes, header declares {p.declared}")
        if data:
            p.parts.append(data)

    def _finish(self, p: _Partial) -> Message:
        if p.received != p.declared:
            raise WireError(f"seq {p.seq}: payload truncated: {p.received} of {p.declared} declared bytes")
        blob = p.parts[0] if len(p.parts) == 1 else b"".join(p.parts)
        view, off, tensors = memoryview(blob), 0, {}
        for name, spec, header in p.specs:
            try:
                tensors[name] = decode_tensor(header, view[off:off + spec.payload_nbytes],
                                              max_bytes=self.limits.max_tensor_bytes, device=self.device)
            except WireError as e:
                raise WireError(f"seq {p.seq} tensor {name!r}: {e}") from None
            off += spec.payload_nbytes
        return Message(p.request_id, p.body, tensors, p.seq)

    def _parse_header(self, raw: bytes, body: str) -> list[tuple[str, TensorSpec, dict]]:
        if not raw:
            return []
        if len(raw) > self.limits.max_header_bytes:
            raise WireError(f"header of {len(raw)} bytes > max_header_bytes={self.limits.max_header_bytes}")
        try:
            h = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_ext_len=0, use_list=True)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise WireError(f"header is not valid msgpack: {type(e).__name__}: {str(e)[:120]}") from None
        if not isinstance(h, dict) or set(h) != {"v", "tensors"}:
            raise WireError("header must be a map with exactly the keys 'v' and 'tensors'")
        if h["v"] != HEADER_VERSION or isinstance(h["v"], bool):
            raise WireError(f"header version {str(h['v'])[:16]} is not {HEADER_VERSION}")
        entries = h["tensors"]
        if not isinstance(entries, list) or not 1 <= len(entries) <= self.limits.max_tensors:
            raise WireError(f"header 'tensors' must be a list of 1..{self.limits.max_tensors} tensor headers")
        specs, names = [], set()
        for e in entries:
            if not isinstance(e, dict) or "name" not in e:
                raise WireError("every tensor header must be a map with a 'name'")
            th = dict(e)
            name = th.pop("name")
            _check_name(name)
            if name in names:
                raise WireError(f"tensor {name!r} appears twice in one header")
            names.add(name)
            try:
                spec = validate_header(th, max_bytes=self.limits.max_tensor_bytes)
            except WireError as err:
                raise WireError(f"tensor {name!r}: {err}") from None
            if body in LOSSLESS_ONLY and not spec.codec.is_lossless(spec.dtype):
                raise WireError(f"{body}.{name} arrived with lossy codec {spec.codec.name}; it must be exact")
            specs.append((name, spec, th))
        return specs


def error_message(request_id: str, exc: BaseException, seq: int = 0) -> Message:
    """The ``Error`` message to send when handling a peer's frames raised ``exc``."""
    code = pb.Error.CODE_INVALID_FRAME if isinstance(exc, WireError) else pb.Error.CODE_INTERNAL
    return Message(request_id, pb.Error(code=code, message=f"{type(exc).__name__}: {exc}"[:4096]), {}, seq)


def _slices(payloads: list[bytes], sizes: list[int]) -> Iterator[bytes]:
    """Cut the concatenation of ``payloads`` into pieces of ``sizes`` bytes, copying each byte once."""
    views = [memoryview(p) for p in payloads if p]
    i = off = 0
    for size in sizes:
        pieces = []
        while size:
            v = views[i]
            take = min(size, len(v) - off)
            pieces.append(v[off:off + take])
            off += take
            size -= take
            if off == len(v):
                i, off = i + 1, 0
        yield b"".join(pieces)


def _body_field(body: object) -> str:
    name = type(body).__name__ if hasattr(body, "DESCRIPTOR") else None
    if name not in _FIELD_OF_TYPE or not isinstance(body, getattr(pb, name)):
        raise WireError(f"message body must be one of pb.{', pb.'.join(_FIELD_OF_TYPE)}; got {type(body).__name__}")
    return _FIELD_OF_TYPE[name]


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise WireError(f"tensor names are strings of 1..{MAX_NAME_CHARS} chars, got {str(name)[:80]!r}")


def _check_request_id(rid: object) -> None:
    if not isinstance(rid, str) or len(rid) > MAX_REQUEST_ID_CHARS:
        raise WireError(f"request_id must be a string of at most {MAX_REQUEST_ID_CHARS} chars")
