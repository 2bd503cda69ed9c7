"""``random``: an adversarial drafter that proposes random tokens (chains or trees), with their true q.

Useful for tests and as a floor in benchmarks: nearly every draft is rejected, so it exercises the rejection and
recovery paths, and the output must still equal plain decoding (greedy) or follow the target (sampled).
``peaked`` > 0 draws from a random peaked distribution instead of the uniform one, so q differs from uniform.
Trees: ``branching`` children per node for ``depth`` levels, siblings drawn without replacement in draw order.
Randomness: one generator per request, seeded from ``seed`` and the request's seed (a stream apart from the
verifier's), so a seeded request drafts the same however many requests the drafter served before it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registration import register
from specula.drafters.seeding import request_generator
from specula.runtime.core.sampling import sample, sample_without_replacement  # pure torch, no Ray/gRPC


@register("random")
class RandomDrafter:
    def __init__(self, vocab_size: int, structure: str = "chain", branching: int = 2, depth: int = 3,
                 peaked: float = 0.0, seed: int = 0, banned: Sequence[int] = (), **_):
        self.spec = DrafterSpec(kind="random", structure=structure)
        self.vocab_size, self.branching, self.depth, self.seed = vocab_size, branching, depth, seed
        self.g = torch.Generator().manual_seed(seed)  # the law below, then the seeds of unseeded requests
        logits = torch.randn(vocab_size, generator=self.g) * peaked
        if banned:
            logits[list(banned)] = float("-inf")
        self.q = torch.softmax(logits, -1)  # [V] the law every draft token is drawn from
        self.live: dict[str, torch.Generator] = {}  # request id -> its generator

    def begin(self, contexts: Sequence[DraftContext]) -> None:
        for c in contexts:
            self.live[c.request_id] = request_generator("random", self.seed, c.seed, self.g)

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        B = len(request_ids)
        gens = [self.live.get(r, self.g) for r in request_ids]  # a request that never began: the shared one
        if self.spec.structure == "chain":
            tokens = sample(self.q.expand(B, gamma, -1), gens)  # [B, gamma]
            q = self.q.expand(B, gamma, -1).clone()  # [B, gamma, V]
            return Proposal(tuple(request_ids), tokens, (gamma,) * B, None, q)
        parents, level = [], [-1]
        for _ in range(self.depth):  # breadth-first: parents precede children
            nxt = []
            for p in level:
                for _ in range(self.branching):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            level = nxt
        N = min(len(parents), max(gamma, 1) * self.branching)
        parents = parents[:N]
        tokens = torch.zeros((B, N), dtype=torch.long)
        for i in range(0, N, self.branching):  # each sibling group: drawn without replacement, in draw order
            k = min(self.branching, N - i)
            tokens[:, i:i + k] = sample_without_replacement(self.q.expand(B, -1), k, gens)
        q = self.q.expand(B, N, -1).clone()  # [B, N, V] law given the parent (siblings: without replacement)
        par = torch.tensor(parents, dtype=torch.long).expand(B, -1).clone()
        return Proposal(tuple(request_ids), tokens, (N,) * B, par, q)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        pass

    def release(self, request_ids: Sequence[str]) -> None:
        for r in request_ids:
            self.live.pop(r, None)
