"""A bound on what a Session stream's reader thread has received and its consumer has not handled yet.

Both ends of a Session read frames on a thread of their own (the verifier to see Offers while it verifies, the drafter
to see the next Verdict while it drafts ahead). Reading eagerly takes the stream out of gRPC's flow control: a peer
that sends what was never asked for (unsolicited Proposals, a stream of Offers, Verdicts ahead of their blocks) would
grow that backlog without end. The protocol is lock-step, so a handful of messages are ever in flight between
correct peers; a backlog past ``max_messages`` or ``max_bytes`` is a broken or hostile peer, and the reader stops
with that reason (the session ends; on the verifier's side its request goes on alone, output unchanged).
"""

from __future__ import annotations

import threading

from specula.runtime.wire.frames import Message


def message_bytes(msg: Message) -> int:
    """What one received message holds in memory: its tensors' bytes plus its protobuf body."""
    return sum(t.numel() * t.element_size() for t in msg.tensors.values()) + msg.body.ByteSize()


class Backlog:
    """Messages (count and bytes) received and not yet handled; thread-safe (reader adds, consumer takes)."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError(f"Backlog bounds must be positive, got {max_messages} messages / {max_bytes} bytes")
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._lock = threading.Lock()
        self.messages = self.bytes = 0

    def add(self, msg: Message) -> str | None:
        """Count a received message; the reason it breaks the bound (it is then not counted), else None."""
        size = message_bytes(msg)
        with self._lock:
            if self.messages + 1 > self.max_messages:
                return f"more than {self.max_messages} messages received and not yet handled (a peer sending unasked)"
            if self.bytes + size > self.max_bytes:
                return (f"{self.bytes + size} bytes received and not yet handled > {self.max_bytes} "
                        f"(a peer sending unasked)")
            self.messages += 1
            self.bytes += size
        return None

    def take(self, msg: Message) -> None:
        """The consumer has handled (or dropped) ``msg``."""
        size = message_bytes(msg)
        with self._lock:
            self.messages = max(0, self.messages - 1)
            self.bytes = max(0, self.bytes - size)
