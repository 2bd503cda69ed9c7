"""Size limits of the data plane, and the gRPC channel/server options that match them.

gRPC's default receive limit is 4 MiB and prefill features (visual embeddings, prompt hidden states, last-layer KV)
exceed it, so messages are chunked into frames of at most ``max_message_bytes`` *serialized* (envelope included),
and every channel and server sets both gRPC limits explicitly to that size rather than relying on the default.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one frame, as gRPC counts it


@dataclass(frozen=True)
class WireLimits:
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # one serialized frame (gRPC send/receive limit)
    max_total_bytes: int = 1 << 30  # one message's payload, all chunks and tensors together
    max_tensor_bytes: int = 1 << 30  # one tensor's decoded size (and its uncompressed body)
    max_chunks: int = 4096  # frames in one message
    max_header_bytes: int = 1 << 16  # the msgpack header of one message
    max_tensors: int = 64  # tensors in one message
    max_backlog_messages: int = 64  # messages a stream's reader holds unhandled (more = a peer sending unasked)
    max_backlog_bytes: int = 2 << 30  # their bytes together (tensors + bodies)

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_total_bytes", "max_tensor_bytes", "max_chunks",
                     "max_header_bytes", "max_tensors", "max_backlog_messages", "max_backlog_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"WireLimits.{name} must be a positive int, got {v!r}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"WireLimits.max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if self.max_message_bytes >= 1 << 31:
            raise ValueError("WireLimits.max_message_bytes must be < 2 GiB (gRPC's hard limit)")

    def grpc_options(self) -> list[tuple[str, int]]:
        """Options for ``grpc.server(..., options=)`` and ``grpc.insecure_channel(..., options=)``."""
        return grpc_options(self.max_message_bytes)


def grpc_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


DEFAULT_LIMITS = WireLimits()
