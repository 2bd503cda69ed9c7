"""The data plane's wire format: tensor codecs, frames, chunking, limits (the verifier <-> drafter stream).

Public surface (everything else is internal)::

    header, payload = encode_tensor(t, "int8+zstd")              # tensor.py
    t = decode_tensor(header, payload, max_bytes=1 << 30)         # validates before allocating
    frames = encode_message(Message("r1", pb.Verdict(...), {"hidden": h}, seq=3), codec="fp16")   # frames.py
    msg = Reassembler(limits).feed(frame)                          # Message once its last chunk arrived
    codec = negotiate_codec(drafter_accepts, server_prefers)       # codecs.py
    grpc.server(pool, options=limits.grpc_options())               # limits.py

``pb`` is the generated ``specula_dataplane_pb2`` module (bodies: pb.Begin, pb.ProposeRequest, pb.Proposal,
pb.Verdict, pb.Release, pb.Error; the envelope pb.DataplaneFrame). Every failure is a ``WireError``.
"""

from .codecs import CODECS, Codec, negotiate_codec, parse_codec
from .errors import WireError
from .frames import FrameEncoder, Message, Reassembler, encode_message, error_message, pb
from .limits import DEFAULT_LIMITS, DEFAULT_MAX_MESSAGE_BYTES, WireLimits, grpc_options
from .tensor import MAX_RANK, TensorSpec, decode_tensor, encode_tensor, validate_header

__all__ = [
    "CODECS", "Codec", "DEFAULT_LIMITS", "DEFAULT_MAX_MESSAGE_BYTES", "FrameEncoder", "MAX_RANK", "Message",
    "Reassembler", "TensorSpec", "WireError", "WireLimits", "decode_tensor", "encode_message", "encode_tensor",
    "error_message", "grpc_options", "negotiate_codec", "parse_codec", "pb", "validate_header",
]
