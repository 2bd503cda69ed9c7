"""``MultiDrafter``: several named drafters behind one Drafter, so each request drafts with the one it chose.

A deployment may serve more than one drafter (config ``drafter.alternatives``). A request names one when it
begins (``DraftContext.drafter``; None = the default) and keeps it for its whole life::

    multi = MultiDrafter({"ngram": create({"kind": "ngram"}), "random": create({"kind": "random", "vocab_size": V})},
                         default="ngram")
    multi.begin([DraftContext("r1", ids1, t1, drafter="random"), DraftContext("r2", ids2, t2)])  # r2: ngram
    prop = multi.propose(["r1", "r2"], gamma=4)    # one Proposal; row 0 from random, row 1 from ngram
    multi.observe([...]); multi.release(["r1", "r2"])

Merging keeps every row's law (``merge_proposals``). Rows are put side by side:

- tokens [B, N] padded to the longest row; counts as each drafter gave them;
- parents: when any row is a tree, every chain row becomes the tree [-1, 0, 1, ...]. ``verify_tree`` on a chain
  makes the same decisions from the same uniforms as ``verify_chain`` (its docstring), greedy included;
- q: when any row carries q, a deterministic row (q=None) gets one-hot q at its tokens. The verifiers read q=None
  as exactly that law: ``verify_chain`` takes q_x = 1 and the residual p - one_hot(x), ``verify_tree`` takes
  q_c = one_hot(x_c) (minus earlier siblings' tokens, renormalized), so one-hot q gives the same accept tests,
  the same residuals and the same uniforms: the same output, token for token.

When every row chose the same drafter its Proposal is passed on as it is.

The spec is the union: ``needs`` of every sub-drafter (each one still sees only the features it asked for, as it
would alone), ``structure`` "tree" when any is a tree. gamma is the caller's, one for all rows (a tree drafter
spends it as nodes, as alone). Lookahead (the data plane's overlap) is per request: ``drafter_for(request_id)`` is
the drafter a request drafts with, and the DrafterServer runs that session's pipeline on it, so a request whose
drafter can draft ahead overlaps and the others draft sequentially. ``extend`` / ``observe_ahead`` here route by
request id too (rows whose drafter cannot draft ahead get nothing), and ``lookahead`` is True only when every
sub-drafter can.

Not in the registry (``create({"kind": ...})`` builds one drafter from its own options): the runtime builds it from
config in ``specula.runtime.engine.factory.make_drafter`` when ``drafter.alternatives`` is set, or a caller builds
it directly as above (an in-process ``SpecEngine`` takes it as its drafter).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict, supports_lookahead, supports_lockstep, supports_predraft

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # what a drafter name may be (config keys, API fields)
RESERVED = ("none",)  # the API's word for "no drafting"; never a drafter's name


def check_name(name: str) -> str:
    """``name`` if it can name a drafter (letters, digits, '_', '.', '-'; 1-64 characters; not 'none')."""
    if not isinstance(name, str) or not NAME.match(name) or name in RESERVED:
        raise ValueError(f"drafter name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
                         f"or digit), and not {' / '.join(map(repr, RESERVED))}")
    return name


class MultiDrafter:
    """Routes each request to the drafter it chose; ``propose`` merges their rows into one Proposal.

    Args:
        drafters: name -> a ``specula.drafters.Drafter`` (built by ``create``), at least one.
        default: the name used by requests that choose none.
    """

    def __init__(self, drafters: Mapping[str, Any], default: str) -> None:
        if not drafters:
            raise ValueError("MultiDrafter needs at least one drafter")
        for name in drafters:
            check_name(name)
        if default not in drafters:
            raise ValueError(f"default drafter {default!r} is not one of {list(drafters)}")
        self.default = default
        self.drafters = {default: drafters[default], **{n: d for n, d in drafters.items() if n != default}}
        subs = list(self.drafters.values())
        structure = "tree" if any(d.spec.structure == "tree" for d in subs) else "chain"
        self.spec = DrafterSpec(kind="multi", structure=structure,
                                needs=frozenset().union(*(d.spec.needs for d in subs)))
        self.lookahead = all(supports_lookahead(d) for d in subs)
        self.tree_lookahead = self.lookahead  # each request drafts ahead as its own sub-drafter does
        self.predraft = self.lookahead and all(supports_predraft(d) for d in subs)
        # not growing as a whole unless every sub-drafter does; ``grow`` stays, since the DraftBatcher calls it for
        # the sessions whose own sub-drafter grows (BatchedView reads that sub-drafter's capabilities)
        self.lockstep = all(supports_lockstep(d) for d in subs)
        self._route: dict[str, str] = {}  # request id -> the name it drafts with (begin .. release)

    @property
    def names(self) -> tuple[str, ...]:
        """Every drafter a request may choose; the default first."""
        return tuple(self.drafters)

    def resolve(self, name: str | None) -> str:
        """The drafter name a request's choice means (None = the default); ValueError listing the choices."""
        if name is None:
            return self.default
        if name not in self.drafters:
            raise ValueError(f"drafter {name!r} is not served here; choose one of {list(self.names)}")
        return name

    def name_for(self, request_id: str) -> str | None:
        """The drafter ``request_id`` drafts with (None before its begin or after its release)."""
        return self._route.get(request_id)

    def drafter_for(self, request_id: str):
        """The sub-drafter ``request_id`` drafts with; it knows the request by the same id."""
        return self.drafters[self._route.get(request_id, self.default)]

    # ------------------------------------------------------------------------------------------- Drafter protocol

    def begin(self, contexts: Sequence[DraftContext]) -> None:
        names = [self.resolve(c.drafter) for c in contexts]  # every choice checked before any drafter begins
        for name, rows in _groups(names):
            d = self.drafters[name]
            for b in rows:
                self._route[contexts[b].request_id] = name  # before begin: a failed begin is still released there
            d.begin([_context_for(contexts[b], d.spec.needs) for b in rows])

    def pop_begin_times(self) -> dict:
        """Drafter-side parts of begin the sub-drafters timed themselves (see SpecEngine.add), by request id."""
        out: dict = {}
        for d in self.drafters.values():
            if hasattr(d, "pop_begin_times"):
                out.update(d.pop_begin_times())
        return out

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        ids = tuple(request_ids)
        parts = [(rows, self.drafters[name].propose([ids[b] for b in rows], gamma))
                 for name, rows in _groups(self._names(ids))]
        return merge_proposals(ids, parts)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        for name, rows in _groups(self._names(v.request_id for v in verdicts)):
            d = self.drafters[name]
            d.observe([_verdict_for(verdicts[b], d.spec.needs) for b in rows])

    def release(self, request_ids: Sequence[str]) -> None:
        ids = [r for r in request_ids if r in self._route]  # never begun: nothing to free
        for name, rows in _groups([self._route[r] for r in ids]):
            self.drafters[name].release([ids[b] for b in rows])
        for r in ids:
            self._route.pop(r, None)

    # ------------------------------------------------------------------------------------------- Lookahead

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        ids = tuple(request_ids)
        parts = []
        for name, rows in _groups(self._names(ids)):
            d = self.drafters[name]
            if supports_lookahead(d):
                parts.append((rows, d.extend([ids[b] for b in rows], n)))
        return merge_proposals(ids, parts)  # rows whose drafter cannot draft ahead: count 0

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        for name, rows in _groups(self._names(v.request_id for v in verdicts)):
            d = self.drafters[name]
            if not supports_lookahead(d):
                raise ValueError(f"observe_ahead for requests of drafter {name!r}, which does not draft ahead")
            d.observe_ahead([_verdict_for(verdicts[b], d.spec.needs) for b in rows])

    def branch(self, rows: Sequence[tuple[str, int]]) -> list[tuple[int, int] | None]:
        """``Predraft`` by request: rows whose drafter cannot rank rejection outcomes get None."""
        rows = list(rows)
        out: list[tuple[int, int] | None] = [None] * len(rows)
        for name, idx in _groups(self._names(r for r, _ in rows)):
            d = self.drafters[name]
            if supports_predraft(d):
                for b, opened in zip(idx, d.branch([rows[b] for b in idx])):
                    out[b] = opened
        return out

    def grow(self, request_ids: Sequence[str]) -> list[list]:
        """``supports_lockstep`` by request: rows whose drafter cannot grow its branches together get []."""
        ids = list(request_ids)
        out: list[list] = [[] for _ in ids]
        for name, idx in _groups(self._names(ids)):
            d = self.drafters[name]
            if supports_lockstep(d):
                for b, nodes in zip(idx, d.grow([ids[b] for b in idx])):
                    out[b] = nodes
        return out

    def _names(self, request_ids) -> list[str]:
        # a request that never began drafts with the default, as it would with the default alone
        return [self._route.get(r, self.default) for r in request_ids]


def merge_proposals(request_ids: tuple[str, ...], parts: Sequence[tuple[Sequence[int], Proposal]]) -> Proposal:
    """Proposals for disjoint rows -> one Proposal for ``request_ids`` (module docstring: how, and why lossless).

    ``parts``: (rows, proposal) with ``proposal`` row i answering ``request_ids[rows[i]]``; rows no part covers get
    count 0. Output on the first part's device: tokens [B, N] int64, parents [B, N] int64 when any part is a tree
    (-1 pads), q [B, N, V] fp32 when any part carries q (zeros pad).

    >>> chain = Proposal(("a",), torch.tensor([[7, 8]]), (2,))                              # deterministic chain
    >>> q = torch.full((1, 3, 10), 0.1)                                                      # sampled tree
    >>> tree = Proposal(("b",), torch.tensor([[3, 4, 5]]), (3,), torch.tensor([[-1, -1, 0]]), q)
    >>> m = merge_proposals(("a", "b"), [([0], chain), ([1], tree)])
    >>> m.parents.tolist(), m.q[0, :, 7].tolist(), m.q[0, :, 8].tolist()
    ([[-1, 0, -1], [-1, -1, 0]], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0])
    """
    B = len(request_ids)
    counts = [0] * B
    for rows, p in parts:
        if len(rows) != len(p.counts) or p.tokens.shape[0] != len(rows):
            raise ValueError(f"a proposal of {len(p.counts)} rows for {len(rows)} requests")
        for b, c in zip(rows, p.counts):
            counts[b] = int(c)
    if len(parts) == 1 and list(parts[0][0]) == list(range(B)):  # one drafter for every row: as it proposed
        return replace(parts[0][1], request_ids=request_ids)
    width = max(max(counts, default=0), 1)
    device = parts[0][1].tokens.device if parts else torch.device("cpu")
    vocab = {int(p.q.shape[-1]) for _, p in parts if p.q is not None}
    if len(vocab) > 1:
        raise ValueError(f"drafters disagree on the vocabulary size of q: {sorted(vocab)}")
    tokens = torch.zeros((B, width), dtype=torch.long, device=device)  # [B, N]
    tree = any(p.parents is not None for _, p in parts)
    parents = torch.full((B, width), -1, dtype=torch.long, device=device) if tree else None  # [B, N]
    q = torch.zeros((B, width, vocab.pop()), dtype=torch.float32, device=device) if vocab else None  # [B, N, V]
    for rows, p in parts:
        if not rows:
            continue
        idx = torch.tensor(list(rows), dtype=torch.long, device=device)  # [b]
        w = min(int(p.tokens.shape[1]), width)
        toks = p.tokens[:, :w].to(device=device, dtype=torch.long)  # [b, w]
        live = torch.arange(w, device=device)[None, :] < torch.tensor(p.counts, device=device)[:, None]  # [b, w]
        tokens[idx, :w] = torch.where(live, toks, 0)
        if parents is not None:
            if p.parents is not None:
                parents[idx, :w] = torch.where(live, p.parents[:, :w].to(device=device, dtype=torch.long), -1)
            else:  # a chain as a tree: node i hangs off node i - 1, the first off the pending token
                chain = torch.arange(-1, w - 1, device=device).expand(len(rows), w)  # [b, w]
                parents[idx, :w] = torch.where(live, chain, -1)
        if q is not None:
            if p.q is not None:
                q[idx, :w] = p.q[:, :w].to(device=device, dtype=torch.float32)
            else:  # deterministic rows: the one-hot law the verifiers assume for q=None
                one_hot = torch.nn.functional.one_hot(toks, q.shape[-1]).float()  # [b, w, V]
                q[idx, :w] = one_hot * live[..., None]
    return Proposal(request_ids, tokens, tuple(counts), parents, q)


# ----------------------------------------------------------------------------------------------- helpers

# the features a spec may need -> what carries them in a DraftContext / Verdict (fields, then ``extra`` keys)
_FIELDS = {"pixels": ("pixel_values",), "visual": ("visual",), "hidden": ("hidden",)}
_EXTRA = {"last_kv": ("last_k", "last_v"), "pre_projector": ("pre_projector",)}


def _groups(names: Sequence[str]) -> list[tuple[str, list[int]]]:
    """Row indices by name, names in order of first appearance: ["a", "b", "a"] -> [("a", [0, 2]), ("b", [1])]."""
    out: dict[str, list[int]] = {}
    for b, n in enumerate(names):
        out.setdefault(n, []).append(b)
    return list(out.items())


def _context_for(c: DraftContext, needs: frozenset[str]) -> DraftContext:
    """``c`` with only the features ``needs`` names (what the engine would give that drafter alone)."""
    drop = {f: None for feat, fields in _FIELDS.items() if feat not in needs for f in fields}
    gone = {k for feat, keys in _EXTRA.items() if feat not in needs for k in keys}
    extra = {k: v for k, v in c.extra.items() if k not in gone}
    return replace(c, extra=extra, **drop) if drop or len(extra) != len(c.extra) else c


def _verdict_for(v: Verdict, needs: frozenset[str]) -> Verdict:
    gone = {k for feat, keys in _EXTRA.items() if feat not in needs for k in keys}
    extra = {k: t for k, t in v.extra.items() if k not in gone}
    hidden = v.hidden if "hidden" in needs else None
    if hidden is v.hidden and len(extra) == len(v.extra):
        return v
    return replace(v, hidden=hidden, extra=extra)
