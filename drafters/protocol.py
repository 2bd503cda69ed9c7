"""The one Drafter protocol every drafting method implements, and the frozen records it exchanges.

A request's life, seen from a drafter::

    drafter.begin([DraftContext(...)])           # prompt ids, images / visual features, target prefill features
    while not done:
        prop = drafter.propose(["r1"], gamma=5)  # Proposal: tokens [B, N] (+ parents for trees) and q [B, N, V]
        ... the target verifies, the sampler decides ...
        drafter.observe([Verdict(...)])          # accepted path, next token, target features of kept positions
    drafter.release(["r1"])

``q`` is always the distribution each draft token was actually sampled from (for an ensemble: the weighted
mixture; for a semi-autoregressive head: the per-position distribution it emitted). A drafter that proposes
deterministically (n-gram lookup, greedy argmax) returns ``q=None``: the sampler then treats each draft as drawn
from a one-hot distribution, which keeps sampled decoding lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

# Target features a drafter may ask for (DrafterSpec.needs)
FEATURES = ("hidden", "layer_hidden", "last_kv", "visual", "pre_projector", "pixels")
# what a drafter may need and still begin before the target's prefill (the rest are the prefill's outputs)
PREFILL_FREE = frozenset({"pixels", "visual"})


@dataclass(frozen=True)
class DrafterSpec:
    kind: str  # registry key
    structure: str  # "chain" or "tree"
    needs: frozenset[str] = frozenset()  # subset of FEATURES

    def __post_init__(self) -> None:
        if self.structure not in ("chain", "tree"):
            raise ValueError(f"structure must be 'chain' or 'tree', got {self.structure!r}")
        unknown = set(self.needs) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown drafter needs {sorted(unknown)}; known: {FEATURES}")


@dataclass(frozen=True)
class DraftContext:
    """What a drafter gets when a request begins (after the target's prefill)."""

    request_id: str
    prompt_ids: torch.Tensor  # [L] int64, image tokens expanded
    first_token: int  # the token sampled from the prefill logits (pending, not yet verified by anything)
    temperature: float = 0.0  # how the request samples: drafters may sample their drafts at this temperature
    seed: int | None = None
    pixel_values: torch.Tensor | None = None  # [N_img, 3, S, S] when "pixels" is needed
    visual: torch.Tensor | None = None  # [N_img, T_max, H] projected visual embeddings when "visual" is needed, padded
    # to the longest image with zero rows (each image's own T_img from the prompt ids: drafters/image_runs.py)
    hidden: torch.Tensor | None = None  # [L, H] target final hidden states of the prompt when "hidden" is needed
    extra: dict = field(default_factory=dict)  # other features by name (e.g. "last_k"/"last_v" [H_kv, L, D])
    drafter: str | None = None  # the drafter the request chose by name (a MultiDrafter routes on it); None = default


@dataclass(frozen=True)
class Proposal:
    """Draft nodes for each requested row (same order as the call's request ids)."""

    request_ids: tuple[str, ...]
    tokens: torch.Tensor  # [B, N] int64, rows padded past counts
    counts: tuple[int, ...]  # nodes per row (0 = nothing to propose: plain decoding for that row)
    parents: torch.Tensor | None = None  # [B, N] int64 for trees (-1 = child of the pending token); None = chains
    q: torch.Tensor | None = None  # [B, N, V] fp32 distribution each node was sampled from; None = deterministic


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided for one row, plus the target features of the positions now committed."""

    request_id: str
    accepted: tuple[int, ...]  # accepted node indices, root to leaf
    tokens: tuple[int, ...]  # the committed tokens of this step: the accepted drafts' tokens, in order
    next_token: int  # corrected or bonus token (pending: not in the target cache yet)
    hidden: torch.Tensor | None = None  # [1 + len(accepted), H] target final hidden states at pending + accepted
    # other features at the same positions, by name: "last_k" / "last_v" [H_kv, 1 + len(accepted), D] (the target's
    # last decoder layer, keys post-RoPE) when "last_kv" is needed
    extra: dict = field(default_factory=dict)


@runtime_checkable
class Drafter(Protocol):
    spec: DrafterSpec

    def begin(self, contexts: Sequence[DraftContext]) -> None: ...

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal: ...

    def observe(self, verdicts: Sequence[Verdict]) -> None: ...

    def release(self, request_ids: Sequence[str]) -> None: ...


@runtime_checkable
class Lookahead(Protocol):
    """Optional capability of a chain drafter: draft past its outstanding proposal (the runtime's overlap).

    PEARL's post-verify: while the target verifies block n, the drafter drafts block n+1 assuming block n is
    accepted whole. A drafter that can do this has ``lookahead = True`` and two more methods; the data plane then
    proposes ``gamma + 1`` nodes, sends the first ``gamma`` (the last node is its *guess* of the bonus token) and
    extends the chain while the verifier works::

        prop = drafter.propose(["r1"], gamma + 1)     # d_1 .. d_gamma, g     (the verifier sees d_1 .. d_gamma)
        ahead = drafter.extend(["r1"], gamma + 1)     # x_1 .. x_gamma, g'    drafted as if d and g were committed
        # the verdict accepts all of d and its next token equals g:
        drafter.observe_ahead([verdict])              # d and g committed; x_1 .. x_gamma, g' is now the proposal
        # otherwise: drafter.observe([verdict])       # as always: every node past the accepted path is dropped

    ``extend`` appends to the outstanding chain: node indices keep counting, and ``observe`` with any verdict whose
    path is a prefix of the chain stays valid (that is the rollback). Each node's q is the law it was drawn from
    given every node before it, so a block taken from an extension is as lossless as a fresh one (its tokens are
    drawn after the guess, from randomness the target's decisions never see).

    Trees (``tree_lookahead = True``: eagle, msd): the chain that ``extend`` grows is the outstanding tree's
    ``spine`` (its first child at every level), extended past the spine's leaf as new nodes whose parent is the
    previous one; "accepted whole" means the verdict's path is the whole spine. ``observe_ahead`` takes a verdict
    that accepts a prefix of the spine followed by its next node; what stays outstanding is a chain.
    """

    lookahead: bool

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        """Up to ``n`` more chain nodes after each row's outstanding chain (only the new nodes; counts 0 when a row
        has no outstanding chain or its chain cannot grow). ``parents`` None; ``q`` as in ``propose``."""
        ...

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        """Each verdict accepts a prefix of k nodes and its next token equals node k: nodes 0..k are committed
        (node k as the pending token), nodes k+1.. stay outstanding as the row's next proposal, renumbered from 0.
        ``hidden`` as in ``observe`` ([1 + k, H] at the pending token and the accepted nodes)."""
        ...


@runtime_checkable
class Predraft(Protocol):
    """Optional capability of a ``Lookahead`` chain drafter: draft ahead for rejections too (SSD / Saguaro).

    Drafting ahead past the guess pays only when the verifier accepts the whole block and its bonus token equals
    the guess. The other outcomes are "node k rejected, the target's token t at k" (k = gamma: every node accepted,
    the bonus token is not the guess). A drafter that can rank them (from its own probabilities) opens them one at
    a time as hidden branches of its outstanding chain, and ``extend`` then grows the branch opened last::

        drafter.branch([("r1", gamma)])     # -> [(k, t)]: branch point k <= gamma and token t; the tip is now t
        drafter.extend(["r1"], 1)           # the node after t (drafted as if d_0 .. d_{k-1}, t were committed)
        # a verdict that accepts d_0 .. d_{k-1} and whose next token is t:
        drafter.observe_ahead([verdict])    # commits them; the branch's nodes become the row's proposal

    Branch nodes are never sent to the verifier unless their outcome happens; ``observe`` drops them with every
    other node off the accepted path. Branch tokens are drawn from the drafter's own randomness after (k, t) is
    fixed, so a block taken from a branch is as lossless as a fresh one (the ``Lookahead`` argument, per outcome).
    """

    predraft: bool

    def branch(self, rows: Sequence[tuple[str, int]]) -> list[tuple[int, int] | None]:
        """For each (request id, last k): open the most likely outcome (k <= last, t) not opened yet since the
        row's last proposal and make it the row's tip; None when there is none. Nothing is drafted here."""
        ...


def supports_lockstep(drafter) -> bool:
    """True when a ``Predraft`` drafter can also grow every open chain of a row at once: ``grow(request_ids)`` ->
    per row [(outcome, token, q)], outcome None for the main chain or the (k, t) of the branch the node extends
    (text_lm, eagle and msd chains and the IbED family's: ``TextLMDrafter.grow``, ``EagleDrafter.grow``,
    ``EnsembleDrafter.grow``). The overlap then opens its branches first and drafts them side by side. A drafter
    whose ``grow`` serves only some of its requests (``MultiDrafter``) sets ``lockstep = False``: it keeps ``grow``
    for the batcher to route, and is not read as growing as a whole."""
    return supports_predraft(drafter) and callable(getattr(drafter, "grow", None)) \
        and bool(getattr(drafter, "lockstep", True))


def supports_predraft(drafter) -> bool:
    """True when ``drafter`` can draft ahead for rejection outcomes as well (``Predraft`` on a ``Lookahead``)."""
    return supports_lookahead(drafter) and bool(getattr(drafter, "predraft", False)) \
        and callable(getattr(drafter, "branch", None))


def supports_lookahead(drafter) -> bool:
    """True when ``drafter`` implements ``Lookahead`` for its configuration (chains; trees with ``tree_lookahead``)."""
    return bool(getattr(drafter, "lookahead", False)) and isinstance(drafter, Lookahead) \
        and (drafter.spec.structure == "chain" or bool(getattr(drafter, "tree_lookahead", False)))


def spine(parents: Sequence[int]) -> list[int]:
    """The first-child path of a parents-first tree (parents [N], -1 = the root): from the root, the lowest-index
    child at every level. A tree drafter emits a slot's children in draw order, so for greedy rows this is the
    drafter's greedy chain: the path a tree's drafting ahead assumes accepted (``Lookahead``)."""
    path: list[int] = []
    at = -1
    for i, p in enumerate(parents):
        if p == at:
            path.append(i)
            at = i
    return path
