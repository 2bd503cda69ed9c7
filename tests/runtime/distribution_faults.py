"""Known-wrong samplers, injected with monkeypatch, that the end-to-end distribution check must reject.

Each function patches one seam and changes nothing else:
- ``accept_every_draft_p_allows``: ``verify_chain`` (as the engine calls it) accepts every draft with p(x) > 0;
- ``q_squared``: a drafter reports q^2 renormalized while its tokens were drawn from q;
- ``bonus_from_q``: after a fully accepted chain the bonus token is drawn from the last draft's q, not p;
- ``one_member_q``: the ensemble reports its first member's q while drawing from the mixture.
(Tree siblings verified under the wrong convention need no patch: ``SpecEngine(siblings="independent")`` for a
drafter that draws them without replacement.)
"""

from __future__ import annotations

import dataclasses

import torch

from specula.drafters.ensemble import EnsembleDrafter
from specula.runtime.core.sampling import sample
from specula.runtime.engine import loop


def accept_every_draft_p_allows(monkeypatch) -> None:
    """q scaled by 1e-20: ``u * q(x) < p(x)`` holds whenever p(x) > 0, and the residual is p itself."""
    real = loop.verify_chain

    def faulty(tokens, q, p, **kw):
        q = torch.nn.functional.one_hot(tokens.clamp_min(0), p.shape[-1]).float() if q is None else q  # [B, gamma, V]
        return real(tokens, q * 1e-20, p, **kw)

    monkeypatch.setattr(loop, "verify_chain", faulty)


def q_squared(monkeypatch, drafter) -> None:
    """The proposal's q [B, N, V] replaced by q^2 / sum q^2; the tokens stay those drawn from q."""
    real = drafter.propose

    def faulty(request_ids, gamma):
        prop = real(request_ids, gamma)
        q2 = prop.q.double() ** 2  # [B, N, V]
        return dataclasses.replace(prop, q=(q2 / q2.sum(-1, keepdim=True).clamp_min(1e-300)).float())

    monkeypatch.setattr(drafter, "propose", faulty)


def bonus_from_q(monkeypatch) -> None:
    """A row whose every draft was accepted gets its next token from q of its last draft instead of p."""
    real = loop.verify_chain
    g = torch.Generator().manual_seed(12345)

    def faulty(tokens, q, p, *, num_draft=None, **kw):
        v = real(tokens, q, p, num_draft=num_draft, **kw)
        n = torch.as_tensor(num_draft if num_draft is not None else [tokens.shape[1]] * tokens.shape[0])  # [B]
        full = (v.accepted == n) & (n > 0)  # [B] rows that reached the bonus position
        last = q[torch.arange(len(n)), (n - 1).clamp_min(0)]  # [B, V] the last draft's q
        nxt = torch.where(full, sample(last, g), v.next_token)  # [B]
        out = v.output_tokens.clone()
        out[torch.arange(len(n)), v.accepted] = nxt
        return dataclasses.replace(v, next_token=nxt, output_tokens=out)

    monkeypatch.setattr(loop, "verify_chain", faulty)


def one_member_q(monkeypatch) -> None:
    """Drafts still drawn from each request's mixture, but the q reported is its first member's softmax."""
    real = EnsembleDrafter._children

    def faulty(self, logits, k, temps, greedy, gens):
        kids, _ = real(self, logits, k, temps, greedy, gens)  # [Bc, W, k]
        lg = logits.clone()
        lg[..., self.image_token_id] = float("-inf")
        member = torch.softmax(lg / temps[:, None, None], dim=-1)  # [Bc, W, V] q_m of every member row
        first = torch.tensor([s for s, n, _ in self._call_groups for _ in range(n)], device=member.device)  # [Bc]
        return kids, member[first]

    monkeypatch.setattr(EnsembleDrafter, "_children", faulty)
