"""The one exception the wire raises for anything a peer sent (or asked to send) that it cannot accept."""

from __future__ import annotations


class WireError(ValueError):
    """A malformed, oversized or unsupported frame, header, payload or codec; the message says which and why.

    Raised before anything is allocated from untrusted sizes. Callers answer it with an ``Error`` frame
    (``CODE_INVALID_FRAME``) and end the session; the verifier then decodes alone, so the output is unchanged.
    """
