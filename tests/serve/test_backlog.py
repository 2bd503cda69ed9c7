"""The stream backlog bound on its own: messages and bytes held unhandled, released as the consumer takes them."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.dataplane.backlog import Backlog, message_bytes
from specula.runtime.wire import Message, pb


def _msg(n_floats: int) -> Message:
    return Message("r", pb.Verdict(accepted=[0], tokens=[5], next_token=6), {"hidden": torch.zeros(n_floats)}, 1)


def test_the_byte_bound_refuses_what_would_exceed_it_and_taking_frees_room():
    small, big = _msg(16), _msg(1024)
    b = Backlog(max_messages=10, max_bytes=message_bytes(small) * 2 + 10)
    assert b.add(small) is None and b.add(small) is None
    assert "bytes received and not yet handled" in b.add(small)  # a third would pass the byte bound
    assert (b.messages, b.bytes) == (2, 2 * message_bytes(small))  # the refused one is not counted
    b.take(small)
    assert b.add(small) is None
    assert "bytes" in Backlog(10, message_bytes(big) - 1).add(big)  # one message alone can exceed it


def test_the_message_bound_and_bad_bounds():
    b = Backlog(max_messages=2, max_bytes=1 << 20)
    m = _msg(4)
    assert b.add(m) is None and b.add(m) is None
    assert "more than 2 messages" in b.add(m)
    b.take(m)
    b.take(m)
    b.take(m)  # taking more than was added never goes negative
    assert (b.messages, b.bytes) == (0, 0)
    with pytest.raises(ValueError):
        Backlog(0, 1)
