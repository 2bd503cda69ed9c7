"""Bearer-token checks shared by the HTTP routes and the gRPC methods.

A header ``Authorization: Bearer <token>`` (gRPC: metadata ``authorization``) is accepted when the token is one of
the configured keys (``AuthConfig.keys()``); with no keys configured auth is off. Comparison is constant-time per
key so a wrong token's timing does not reveal a right one's prefix.
"""

from __future__ import annotations

import hmac


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization`` value (``Bearer`` scheme, case-insensitive), else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authorized(header: str | None, keys: frozenset[str]) -> bool:
    """True when auth is off (no keys) or the header carries one of ``keys``."""
    if not keys:
        return True
    token = bearer_token(header)
    if token is None:
        return False
    got = token.encode()
    ok = False
    for key in keys:  # no early exit: every key is compared
        ok |= hmac.compare_digest(got, key.encode())
    return ok
