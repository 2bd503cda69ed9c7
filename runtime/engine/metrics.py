"""Speculative decoding metrics, with vLLM's conventions written down.

- ``tau`` (mean accepted length) = tokens emitted per target verification, the bonus/corrected token included.
- ``alpha_n`` = acceptance rate of draft position n (1-based): of the blocks that had a draft at position n,
  the share in which it was accepted. Counted per position, not derived from tau.
- time split: vision / prefill / draft / draft_begin / verify / sample / commit, seconds. "draft" is the drafting of
  blocks (proposals, the drafter's observing of verdicts); "draft_begin" the drafter's ``begin`` of each request
  (its prefill of the prompt: once per request, as the target's prefill is); "caption" (a caption drafter's
  captioning in ``begin``, booked apart from "draft_begin") where a drafter reports it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

TIME_KEYS = ("vision", "prefill", "draft", "draft_begin", "caption", "verify", "sample", "commit")


@dataclass
class RequestMetrics:
    blocks: int = 0  # target verifications after prefill (plain decode steps included)
    draft_tokens: int = 0  # draft nodes sent to the verifier
    accepted_tokens: int = 0  # draft nodes accepted
    emitted: int = 0  # tokens in the output (first token from prefill included)
    drafted_at: list[int] = field(default_factory=list)  # [n] blocks with a draft at position n + 1
    accepted_at: list[int] = field(default_factory=list)  # [n] blocks whose position n + 1 was accepted
    time: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def record_block(self, n_draft: int, n_accepted: int, depth: int | None = None) -> None:
        """A verification of ``n_draft`` nodes (a chain, or a tree ``depth`` deep) of which ``n_accepted`` held."""
        self.blocks += 1
        self.draft_tokens += n_draft
        self.accepted_tokens += n_accepted
        depth = n_draft if depth is None else depth
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
        for i in range(n_accepted):
            self.accepted_at[i] += 1

    @property
    def tau(self) -> float:
        """Tokens per verification: accepted drafts + 1 per block."""
        return (self.accepted_tokens + self.blocks) / self.blocks if self.blocks else 0.0

    @property
    def alpha(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def merge(self, other: "RequestMetrics") -> "RequestMetrics":
        out = RequestMetrics(self.blocks + other.blocks, self.draft_tokens + other.draft_tokens,
                             self.accepted_tokens + other.accepted_tokens, self.emitted + other.emitted)
        n = max(len(self.drafted_at), len(other.drafted_at))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        out.drafted_at = [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))]
        out.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        for k in set(self.time) | set(other.time):
            out.time[k] = self.time.get(k, 0.0) + other.time.get(k, 0.0)
        return out

    def to_dict(self) -> dict:
        return {"blocks": self.blocks, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "emitted": self.emitted, "tau": round(self.tau, 4), "alpha": [round(a, 4) for a in self.alpha],
                "drafted_at": list(self.drafted_at), "accepted_at": list(self.accepted_at),  # counts behind alpha
                "time_s": {k: round(v, 6) for k, v in self.time.items()}}


def aggregate(metrics) -> RequestMetrics:
    total = RequestMetrics()
    for m in metrics:
        total = total.merge(m)
    return total
