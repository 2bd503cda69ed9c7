"""``ngram``: prompt-lookup drafting (as in vLLM / HF prompt lookup decoding).

Find the most recent earlier occurrence of the last n tokens (n from ``max_n`` down to ``min_n``) in the request's
own tokens (prompt + generated) and propose the ``gamma`` tokens that followed it. Deterministic, so ``q=None``.
Image tokens are never proposed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registry import register


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

    def __init__(self, min_n: int = 1, max_n: int = 4, image_token_id: int | None = None, **_):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.image_token_id = min_n, max_n, image_token_id
        self._tokens: dict[str, list[int]] = {}

    def begin(self, contexts: Sequence[DraftContext]) -> None:
        for c in contexts:
            self._tokens[c.request_id] = c.prompt_ids.tolist() + [int(c.first_token)]

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        drafts = [lookup(self._tokens[r], gamma, self.min_n, self.max_n, self.image_token_id) for r in request_ids]
        n = max([len(d) for d in drafts] + [1])
        tokens = torch.zeros((len(drafts), n), dtype=torch.long)  # [B, N]
        for b, d in enumerate(drafts):
            tokens[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        return Proposal(tuple(request_ids), tokens, tuple(len(d) for d in drafts))

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for v in verdicts:
            self._tokens[v.request_id].extend(list(v.tokens) + [v.next_token])

    def release(self, request_ids: Sequence[str]) -> None:
        for r in request_ids:
            self._tokens.pop(r, None)
