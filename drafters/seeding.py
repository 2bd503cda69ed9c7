"""Per-request draft generators: each request drafts from a ``torch.Generator`` of its own.

A seeded request gets a stream derived from (drafter kind, drafter seed, request seed) by hashing, so it is apart
from the verifier's stream (which is seeded with the request seed itself) and the same for the same request
whatever else shares the drafter's batch. An unseeded request takes its seed from the drafter's own seeder.
"""

from __future__ import annotations

import hashlib

import torch


def request_generator(kind: str, drafter_seed: int, request_seed: int | None,
                      seeder: torch.Generator) -> torch.Generator:
    if request_seed is None:
        s = int(torch.randint(0, 2**62, (1,), generator=seeder))
    else:
        tag = f"{kind}/{drafter_seed}/{request_seed}".encode()
        s = int.from_bytes(hashlib.blake2b(tag, digest_size=8).digest())
    return torch.Generator().manual_seed(s)
