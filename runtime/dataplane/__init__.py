"""The verifier <-> drafter data plane on gRPC: ``DrafterServer`` (a drafter replica's DrafterService) and
``RemoteDrafter`` (the Drafter protocol over its Session streams, used by the verifier's loop).

Frames, codecs and limits are ``specula.runtime.wire``; the service is protos/specula_dataplane.proto.
"""

from .remote_drafter import DrafterUnavailable, RemoteDrafter, SessionStream
from .drafter_server import DrafterServer, SessionError

__all__ = ["DrafterServer", "DrafterUnavailable", "RemoteDrafter", "SessionError", "SessionStream"]
