"""``ngram``: prompt-lookup drafting (as in vLLM / HF prompt lookup decoding).

Find the most recent earlier occurrence of the last n tokens (n from ``max_n`` down to ``min_n``) in the request's
own tokens (prompt + generated) and propose the ``gamma`` tokens that followed it. Deterministic, so ``q=None``.
Image tokens are never proposed.

Lookahead (``drafters/protocol.py``): ``extend`` looks up the continuation of the committed tokens followed by the
outstanding drafts, which is exactly what ``propose`` would return once those drafts are committed; so with the
data plane's overlap an n-gram run drafts the same blocks as without it. Extensions are anchored where the chain
stood after ``propose`` / ``observe_ahead``, so extending by 1 n times equals extending by n once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registration import register


def lookup(tokens: list[int], gamma: int, min_n: int, max_n: int, banned: int | None = None) -> list[int]:
    """Continuation of the latest earlier match of the longest suffix n-gram (n in [min_n, max_n]).

    >>> lookup([5, 6, 7, 1, 2, 5, 6], gamma=3, min_n=1, max_n=3)
    [7, 1, 2]
    """
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest match first
            if tokens[start:start + n] == suffix:
                cont = tokens[start + n:start + n + gamma]
                if banned is not None and banned in cont:
                    cont = cont[: cont.index(banned)]
                if cont:
                    return cont
    return []


@register("ngram")
class NgramDrafter:
    spec = DrafterSpec(kind="ngram", structure="chain")
    lookahead = True

    def __init__(self, min_n: int = 1, max_n: int = 4, image_token_id: int | None = None, **_):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.image_token_id = min_n, max_n, image_token_id
        self._tokens: dict[str, list[int]] = {}
        self._draft: dict[str, list[int]] = {}  # the outstanding chain (proposed and extended, not yet observed)
        self._anchor: dict[str, int] = {}  # chain length before the first extension (one lookup covers them all)

    def begin(self, contexts: Sequence[DraftContext]) -> None:
        for c in contexts:
            self._tokens[c.request_id] = c.prompt_ids.tolist() + [int(c.first_token)]

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        drafts = [lookup(self._tokens[r], gamma, self.min_n, self.max_n, self.image_token_id) for r in request_ids]
        for r, d in zip(request_ids, drafts):
            self._draft[r], self._anchor[r] = list(d), len(d)
        return _proposal(request_ids, drafts)

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        drafts = []
        for r in request_ids:
            chain, d = self._draft.get(r), []
            if chain:
                a = self._anchor[r]
                done = len(chain) - a
                d = lookup(self._tokens[r] + chain[:a], done + n, self.min_n, self.max_n, self.image_token_id)
                d = d[done:] if d[:done] == chain[a:] else []
                chain.extend(d)
            drafts.append(d)
        return _proposal(request_ids, drafts)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:
            self._tokens[v.request_id].extend(list(v.tokens) + [v.next_token])
            self._draft.pop(v.request_id, None)

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:
            chain, k = self._draft.get(v.request_id) or [], len(v.accepted)
            if list(v.accepted) != list(range(k)) or len(chain) <= k or chain[k] != v.next_token \
                    or chain[:k] != list(v.tokens):
                raise ValueError(f"ngram.observe_ahead: {v.request_id!r}: the verdict does not accept a prefix of "
                                 "the outstanding chain followed by its next node")
            self._tokens[v.request_id].extend(chain[: k + 1])
            self._draft[v.request_id] = chain[k + 1:]
            self._anchor[v.request_id] = len(chain) - k - 1

    def release(self, request_ids: Sequence[str]) -> None:
        for r in request_ids:
            self._tokens.pop(r, None)
            self._draft.pop(r, None)
            self._anchor.pop(r, None)


def _proposal(request_ids: Sequence[str], drafts: list[list[int]]) -> Proposal:
    n = max([len(d) for d in drafts] + [1])
    tokens = torch.zeros((len(drafts), n), dtype=torch.long)  # [B, N]
    for b, d in enumerate(drafts):
        tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
    return Proposal(tuple(request_ids), tokens, tuple(len(d) for d in drafts))
