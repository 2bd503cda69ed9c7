"""``eagle``: the feature-level baseline (EAGLE-1 head, EAGLE-2 dynamic trees) over the target's hidden states.

The head (``drafters/eagle_head.py``) reads pairs (h_i, x_{i+1}) of a target hidden state and the next token and
predicts h_{i+1}; the target's lm_head turns a prediction into q. Committed positions use the target's true h
(``DraftContext.hidden`` at begin, ``Verdict.hidden`` after each block); draft positions use the head's own h^.

Drafting (one head forward per level; the last level is never fed):

- ``structure="chain"``: gamma tokens, token j drawn from q_j = softmax(lm_head(h^) / T) (T = the request's
  temperature; T = 0 takes the argmax, q one-hot, ``q=None`` when every row is greedy).
- ``structure="tree"`` (EAGLE-2): level 1 = the root's ``top_k`` children; each later level expands the ``top_k``
  nodes of the previous level with the highest cumulative confidence (sum of log q along the path) into ``top_k``
  children each; ``depth`` levels at most (and at most gamma).
  * Greedy rows (T = 0): children are the top-k tokens; after the last level all nodes are reranked by cumulative
    confidence and the best ``total_tokens`` are kept (EAGLE-2). A child never outranks its parent (ties go to the
    lower index), so the kept set is a tree; it is emitted parents-first (level order).
  * Sampled rows (T > 0): the verifier (``runtime/core/tree_rejection.py``, "without_replacement") needs each child's
    token to have law q(parent) given its earlier siblings and everything the tree's shape reveals, so a node's
    existence must never depend on its own token (EAGLE-2's rerank would prune low-confidence siblings: biased).
    The rule: a sibling group's existence and size are fixed *before* its tokens are drawn, from tokens drawn
    earlier (the parents' confidences, the budget left); its tokens are drawn one after another without
    replacement from the parent's q and kept in draw order; nothing is pruned afterwards. Concretely the budget is
    spent while building: at each level the ``top_k`` nodes of the previous level by cumulative confidence (log q
    at T) are expanded, ``top_k`` children each, until ``total_tokens`` nodes exist (the last group may be cut
    short: a prefix of a without-replacement sequence has the same law). No rerank, so for the same budget a
    sampled tree is wider and shallower than a greedy one. A draw that finds no mass left (fewer than k tokens
    with q > 0) is dropped; it is the last of its group.
  ``Proposal.q[b, i]`` is the q node i was drawn from (its parent's), one-hot for greedy rows in a mixed batch.

Cache (one ``targets.kv.BatchedKV`` for all live rows, keys post-RoPE, positions per row). Per row:

    cache  pairs (h_i, x_{i+1}) of the committed sequence, with the target's h    tail  pairs not fed yet
    root   head output at the last fed committed pair (valid while the tail is empty)

- ``begin`` feeds the prompt's L pairs (h_0, x_1) .. (h_{L-1}, first_token) -> root.
- ``propose`` feeds every call row's tail (one forward; rows not in it ride along with an invalid slot) -> root,
  then one forward per tree level. Draft columns are never marked valid: each draft query's mask names its
  ancestors' columns explicitly.
- ``observe`` appends the verdict's pairs (h at the pending token and at each accepted draft, paired with the
  accepted tokens then ``next_token``) to the tail: the draft's columns, fed with predicted h^, stay invalid
  holes, so the cache always equals the committed sequence with the target's own features (what EAGLE does).
  ``BatchedKV.reclaim`` compacts the holes whenever they pile up, proposals outstanding or not (with sessions
  drafting ahead some proposal always is, and waiting for none let the cache grow without bound): a proposal's
  columns are dead once it is drawn, except a chain's that ``extend`` still attends to, which are pinned
  through the compaction and renumbered (``_reclaim``).
- Lookahead (``drafters/protocol.py``): a chain remembers its fed nodes' columns and the head output its last
  node was drawn from; ``extend`` feeds the pair (that output, the last node) and draws on, each query seeing the
  row's valid slots and the chain's columns. ``observe_ahead`` appends the verdict's pairs (the target's own h) to
  the tail, and the rest of the chain stays a proposal: so an extension drafts from predicted h^ for the block
  under verification (as a longer chain would), while the cache only ever holds the target's features. A tree
  drafts ahead along its spine (``protocol.spine``: the first child at every level, the greedy chain for greedy
  rows; every spine node but the leaf was fed as a frontier slot): the chain ``extend`` grows starts at the leaf.
- Predraft (chains; ``drafters/protocol.py``): ``branch`` opens the likeliest rejection outcome "nodes 0..k-1
  accepted, the target's token at k is t" (``drafters/outcomes.py``, ranked from the head outputs the chain's
  nodes were drawn from) as a hidden branch; its first pair is (the head output node k was drawn from, t), seeing
  the chain's columns before k, so its nodes are what a chain that had drawn t at k would draw next. ``grow`` feeds
  every open lane of a row (the chain past its proposal, each branch) in one head forward; ``observe_ahead`` also
  takes a verdict that lands on a branch's t (its nodes after t become the proposal). The chain's and branches'
  fed columns stay pinned through compaction until the next verdict.

    drafter = create({"kind": "eagle", "path": "eagle", "structure": "tree", "top_k": 4, "depth": 5,
                      "total_tokens": 24}, target=target)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specula.drafters import lean_llama, stopping
from specula.drafters.eagle_head import EagleHead
from specula.drafters.outcomes import best_outcome, node_rank
from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict, spine
from specula.drafters.registration import register
from specula.drafters.seeding import request_generator
from specula.runtime.core.sampling import sample_without_replacement  # pure torch, no Ray/gRPC
from specula.targets.kv import BatchedKV, KVPolicy, attention_mask, growable_cache


@dataclass
class _Row:
    tail_h: torch.Tensor  # [T, H] target hidden states of the pairs not fed yet
    tail_x: list[int]  # the token after each of them
    next_pos: int  # position id of tail[0] (= pairs fed so far)
    temperature: float
    generator: torch.Generator
    root: torch.Tensor | None = None  # [H] head output at the last fed pair; None while the tail is non-empty
    draft: tuple[list[int], list[int]] | None = None  # outstanding proposal: (tokens, parents)
    ahead: _Ahead | None = None  # the outstanding chain that ``extend`` grows (while ``open``)


@dataclass
class _Branch:
    """``Predraft``: a hidden chain for the outcome "path[:k] accepted, the target's token at k is t"."""

    k: int
    tokens: list[int]  # t, then the nodes drawn after it
    cols: list[int]  # the draft column each fed node went to (t first)
    src: list[torch.Tensor]  # [H] head output each node was drawn from (for t: the one path node k was drawn from)
    open: bool = True  # False once it cannot grow (a stop token, no mass left)


@dataclass
class _Ahead:
    cols: list[int]  # draft column of chain node i (every node but the last is fed)
    out: torch.Tensor  # [H] head output the last node was drawn from
    path: list[int]  # the chain's node indices in the outstanding proposal (a chain: 0 .. n-1; a tree: its spine)
    open: bool = True  # False once the chain cannot grow (a stop token, no mass left): kept for its ``path``
    src: list[torch.Tensor] = field(default_factory=list)  # [H] head output each path node was drawn from
    branches: dict[tuple[int, int], _Branch] = field(default_factory=dict)  # chains: (k, t) -> its hidden chain
    tip: tuple[int, int] | None = None  # the branch ``extend`` grows (None: the chain itself)
    ranked: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)  # k -> node_rank


def _int(kind: str, name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{kind}: {name} must be an integer >= {lo}, got {v!r}")
    return v


@register("eagle")
class EagleDrafter:
    """Options: ``path`` (zoo name or directory of an exported head, default "eagle") or ``head`` (an
    ``EagleHead``); ``structure`` "chain" | "tree"; tree: ``top_k``, ``depth``, ``total_tokens``; ``seed``;
    ``device`` / ``dtype`` of the head (default: the target's device, float32); ``quantize`` "auto" (default: int8
    weights for the head's decoder layer, its fc and the target's lm_head it reads, through copies of its own, on a
    CPU), "int8" or "none" (``drafters/int8_weights.py``; changes what is drafted, never the output); ``kv_policy``;
    ``stop_token_ids``
    (default: the target's EOS ids; ``[]`` = never stop): a drafted stop token gets no children, since a generation
    that accepts it is over (a chain ends there; a tree expands other nodes instead).
    Resources: ``target`` (its embedding and lm_head are shared with the head; needed unless ``head`` is already
    attached), ``tokenizer`` (unused).

    Subclasses (``drafters/msd.py``) set ``KIND`` / ``HEAD`` and may override ``_needs``, ``_check_context`` and
    ``_prompt_inputs`` (what the head reads at prompt positions); drafting, trees and the cache are shared."""

    KIND = "eagle"
    HEAD: type[EagleHead] = EagleHead

    def __init__(self, path: str | Path | None = None, head: EagleHead | None = None, structure: str = "chain",
                 top_k: int = 4, depth: int = 5, total_tokens: int = 24, seed: int = 0,
                 device: str | None = None, dtype: str | None = None, kv_policy: KVPolicy | None = None,
                 stop_token_ids: Sequence[int] | None = None, quantize: str = "auto", target=None, tokenizer=None,
                 **unknown):
        kind = self.KIND
        if unknown:
            raise ValueError(f"{kind}: unknown options {sorted(unknown)}")
        self.top_k, self.depth = _int(kind, "top_k", top_k, 1), _int(kind, "depth", depth, 1)
        self.total_tokens, self.seed = _int(kind, "total_tokens", total_tokens, 1), _int(kind, "seed", seed, 0)
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"{kind}: unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16'")
        dt = getattr(torch, str(dtype)) if dtype is not None else None
        if head is None:
            head = self.HEAD.load(kind if path is None else path, target, device=device, dtype=dt)
        else:
            if not isinstance(head, self.HEAD):
                raise ValueError(f"{kind}: head must be a {self.HEAD.__name__}, got {type(head).__name__}")
            if dt is not None or device is not None:
                head.to(device=device, dtype=dt)
            if target is not None:  # (re)attach to this target's embedding and lm_head
                model = target.model
                emb = model.get_input_embeddings()
                head.attach(emb, model.get_output_embeddings(), copy=head.fc.weight.device != emb.weight.device)
            if not head.attached:
                raise ValueError(f"{kind}: give a target (its embedding and lm_head) or an attached head")
        self.head = head.eval()
        cfg = head.config
        self.vocab_size = cfg.vocab_size
        if target is not None:
            if target.info.vocab_size != cfg.vocab_size or target.info.hidden_size != cfg.hidden_size:
                raise ValueError(f"{kind}: head (V={cfg.vocab_size}, H={cfg.hidden_size}) does not fit the target "
                                 f"(V={target.info.vocab_size}, H={target.info.hidden_size})")
            image = target.info.image_token_id
        else:
            image = cfg.image_token_id
        self.image_token_id = None if image is None else int(image)
        self.stop_ids = stopping.stop_ids(kind, stop_token_ids, target)  # [n_stop]
        self._stop_set = frozenset(self.stop_ids.tolist())
        self.spec = DrafterSpec(kind=kind, structure=structure, needs=self._needs())
        self.lookahead = True  # chains, and trees along their spine
        self.tree_lookahead = structure == "tree"
        self.predraft = structure == "chain"  # ``branch`` / ``grow``: drafting ahead for rejection outcomes too
        p = head.fc.weight
        self.device, self.dtype = p.device, p.dtype
        self.stop_ids = self.stop_ids.to(self.device)  # compared with drafted tokens on the head's device
        self._attn = head.llama_config._attn_implementation
        self._int8 = lean_llama.int8_drafting(quantize, self.device, [head.layer], kind)
        lc = head.llama_config
        self._kv = BatchedKV(lambda: growable_cache(lc), kv_policy or KVPolicy())  # appends in place, no O(S) copy
        self._rows: dict[str, _Row] = {}  # insertion order == row order of self._kv
        self._seeder = torch.Generator().manual_seed(seed)  # for requests without a seed

    def _needs(self) -> frozenset[str]:
        """The target features ``begin`` reads (DrafterSpec.needs)."""
        return frozenset({"hidden"})

    def _check_context(self, c: DraftContext) -> None:
        """Refuse a context ``_prompt_inputs`` cannot use (called for all contexts before any state changes)."""

    def _prompt_inputs(self, contexts: list[DraftContext], seq: int) -> dict:
        """Extra keyword arguments of the head's forward over the prompts' pairs, padded to [B, seq, ..]."""
        return {}

    # ------------------------------------------------------------------------------------------------ protocol

    @torch.no_grad()
    def begin(self, contexts: Sequence[DraftContext]) -> None:
        """Feed each prompt's pairs (h_i, x_{i+1}), the last one pairing h_{L-1} with the first token."""
        contexts = list(contexts)
        if not contexts:
            return
        ids = [c.request_id for c in contexts]
        if len(set(ids)) != len(ids) or any(i in self._rows for i in ids):
            raise ValueError(f"{self.KIND}.begin: request ids must be new and unique, got {ids}")
        H = self.head.config.hidden_size
        for c in contexts:
            n = int(c.prompt_ids.shape[0])
            if c.hidden is None or tuple(c.hidden.shape) != (n, H) or n < 1:
                got = None if c.hidden is None else tuple(c.hidden.shape)
                raise ValueError(f"{self.KIND}.begin: {c.request_id!r} needs hidden [L={n}, H={H}] (target final-norm "
                                 f"states of the prompt), got {got}")
            if not float(c.temperature) >= 0:
                raise ValueError(f"{self.KIND}.begin: request {c.request_id!r} has temperature {c.temperature!r}")
            self._check_context(c)
        b, seq = len(contexts), max(int(c.prompt_ids.shape[0]) for c in contexts)
        nxt = torch.zeros(b, seq, dtype=torch.long)  # [B, L] x_{i+1}
        hid = torch.zeros(b, seq, H, dtype=self.dtype, device=self.device)  # [B, L, H] h_i
        lengths = torch.tensor([int(c.prompt_ids.shape[0]) for c in contexts])  # [B]
        for i, c in enumerate(contexts):
            n = int(lengths[i])
            nxt[i, : n - 1], nxt[i, n - 1] = c.prompt_ids[1:].cpu(), int(c.first_token)
            hid[i, :n] = c.hidden.to(self.device, self.dtype)
        valid = torch.arange(seq)[None, :] < lengths[:, None]  # [B, L] bool
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]  # [B, L, L]
        extra = self._prompt_inputs(contexts, seq)
        cache = self._kv.new_cache()
        out = self._forward(nxt, hid, torch.arange(seq).expand(b, seq), allowed[:, None], cache, **extra)  # [B, L, H]
        self._kv.join(cache, valid.to(self.device))
        for i, c in enumerate(contexts):
            n = int(lengths[i])
            self._rows[c.request_id] = _Row(hid.new_zeros(0, H), [], n, float(c.temperature), self._generator(c),
                                            root=out[i, n - 1].clone())

    @torch.no_grad()
    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.KIND}.propose: duplicate request ids {list(ids)}")
        rows = [self._row(r) for r in ids]
        if any(r.draft is not None for r in rows):
            raise ValueError(f"{self.KIND}.propose: a row's previous proposal was not observed")
        bc = len(ids)
        if gamma < 1 or not bc:
            return Proposal(ids, torch.zeros(bc, 1, dtype=torch.long), (0,) * bc)
        chain = self.spec.structure == "chain"
        k, depth, budget = (1, gamma, gamma) if chain else (self.top_k, min(self.depth, gamma), self.total_tokens)
        index = {rid: i for i, rid in enumerate(self._rows)}
        sel = torch.tensor([index[r] for r in ids], dtype=torch.long, device=self.device)  # [Bc] cache rows
        self._feed_tails([r for r in rows if r.tail_x], [index[r] for r in ids if self._rows[r].tail_x])
        draft_start = self._kv.seq_len
        tokens, parents, q, counts, last_out, fed = self._grow(rows, sel, k, depth, budget)
        for b, (r, t, p, n) in enumerate(zip(rows, tokens.tolist(), parents.tolist(), counts)):
            r.draft = (t[:n], p[:n])
            r.ahead = None
            if not self.lookahead:
                continue
            if chain and n == depth and t[n - 1] not in self._stop_set:
                # a chain drawn to full length: node i (i < n - 1) was fed at column draft_start + i
                r.ahead = _Ahead(list(range(draft_start, draft_start + n - 1)), last_out[b, 0], list(range(n)),
                                 src=list(fed(b, list(range(n)))[1].unbind(0)))
            elif not chain and n:
                path = spine(p[:n])
                cols, src = fed(b, path)
                r.ahead = _Ahead(cols, src[-1], path, open=t[path[-1]] not in self._stop_set, src=list(src.unbind(0)))
        return Proposal(ids, tokens, tuple(counts), None if chain else parents, q)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        H = self.head.config.hidden_size
        for v in verdicts:  # check them all before changing anything
            row, path = self._row(v.request_id), [int(i) for i in v.accepted]
            if len(v.tokens) != len(path):
                raise ValueError(f"{self.KIND}.observe: {v.request_id!r}: {len(path)} accepted nodes, "
                                 f"{len(v.tokens)} tokens")
            if v.hidden is None or tuple(v.hidden.shape) != (1 + len(path), H):
                got = None if v.hidden is None else tuple(v.hidden.shape)
                raise ValueError(f"{self.KIND}.observe: {v.request_id!r} needs hidden [1 + {len(path)}, {H}], "
                                 f"got {got}")
            if path:
                if row.draft is None:
                    raise ValueError(f"{self.KIND}.observe: {v.request_id!r}: accepted nodes but no proposal")
                toks, parents = row.draft
                prev = -1
                for i in path:
                    if not 0 <= i < len(toks) or parents[i] != prev:
                        raise ValueError(f"{self.KIND}.observe: {v.request_id!r}: path {path} is not a branch")
                    prev = i
                if [toks[i] for i in path] != [int(t) for t in v.tokens]:
                    raise ValueError(f"{self.KIND}.observe: {v.request_id!r}: verdict tokens differ from the drafts")
        for v in verdicts:
            row = self._rows[v.request_id]
            row.draft, row.root, row.ahead = None, None, None
            row.tail_h = torch.cat([row.tail_h, v.hidden.to(self.device, self.dtype)])  # [T + 1 + k, H]
            row.tail_x += [int(t) for t in v.tokens] + [int(v.next_token)]
        self._reclaim()

    @torch.no_grad()
    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        """``Lookahead``: up to ``n`` more nodes on each row's outstanding chain, or on the branch ``branch``
        opened last (``Predraft``)."""
        ids = tuple(request_ids)
        if not self.lookahead:
            raise ValueError(f"{self.KIND}.extend: this drafter does not draft ahead")
        rows = [self._row(r) for r in ids]
        index = {rid: i for i, rid in enumerate(self._rows)}
        grow = [i for i, r in enumerate(rows) if r.draft is not None and r.ahead is not None
                and _lane_open(r.ahead, r.ahead.tip)]
        new: list[list[int]] = [[] for _ in ids]
        qs: list[list] = [[] for _ in ids]
        for _ in range(max(n, 0)):
            if not grow:
                break
            sub = [rows[i] for i in grow]
            drawn = self._step(sub, [index[ids[i]] for i in grow], [[r.ahead.tip] for r in sub])
            still = []
            for i, r, ((t, q),) in zip(grow, sub, drawn):
                if t >= 0:
                    new[i].append(t)
                    qs[i].append(q)
                if _lane_open(r.ahead, r.ahead.tip):
                    still.append(i)
            grow = still
        counts = tuple(len(t) for t in new)
        width = max(max(counts, default=0), 1)
        tokens = torch.zeros(len(ids), width, dtype=torch.long)  # [B, N]
        q = None
        if any(x is not None for row in qs for x in row):
            q = torch.zeros(len(ids), width, self.vocab_size, device=self.device)  # [B, N, V]; greedy rows one-hot
        for b, t in enumerate(new):
            tokens[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            for i, x in enumerate(qs[b]):
                if q is not None:
                    q[b, i] = x if x is not None else torch.nn.functional.one_hot(torch.tensor(t[i]),
                                                                                  self.vocab_size).float()
        return Proposal(ids, tokens, counts, None, q)

    @torch.no_grad()
    def branch(self, rows: Sequence[tuple[str, int]]) -> list[tuple[int, int] | None]:
        """``Predraft`` (chains): open each row's likeliest rejection outcome (k, t), k <= last, not opened yet,
        ranked by ``outcomes.best_outcome`` from the head outputs the chain's nodes were drawn from (logits
        computed here, once per node, never in the draft loop). The branch's first node t is fed later with the
        head output node k was drawn from, seeing the chain's nodes before k: exactly what drafting past t would
        have fed had the head drawn t at k. ``extend`` grows it from now on; ``grow`` grows it beside the rest."""
        rows = [(rid, int(last)) for rid, last in rows]
        for rid, _ in rows:
            self._row(rid)
        out: list[tuple[int, int] | None] = []
        for rid, last in rows:
            r = self._rows[rid]
            a = r.ahead
            best = None
            if self.predraft and r.draft is not None and a is not None and a.src:
                # node k needs its own src and the columns of the nodes before it
                fed = next((i for i, c in enumerate(a.cols) if c < 0), len(a.cols))
                top = min(last, len(a.path) - 1, len(a.src) - 1, fed)
                toks, temp = r.draft[0], r.temperature or 1.0

                def rank(k: int, a=a, toks=toks, temp=temp) -> tuple[float, list[tuple[int, float]]]:
                    if k not in a.ranked:
                        a.ranked[k] = node_rank(self.head.logits(a.src[k], self._int8), toks[a.path[k]], temp,
                                                self.image_token_id)
                    return a.ranked[k]

                best = best_outcome(rank, top, a.branches) if top >= 0 else None
            if best is None:
                out.append(None)
                continue
            k, t = best
            a.branches[(k, t)] = _Branch(k, [t], [], [a.src[k]], open=t not in self._stop_set)
            a.tip = (k, t)
            out.append((k, t))
        return out

    @torch.no_grad()
    def grow(self, request_ids: Sequence[str]) -> list[list[tuple[tuple[int, int] | None, int, torch.Tensor | None]]]:
        """``Predraft`` in lockstep: one more node on every open chain of each row (the outstanding chain past what
        was sent, and each branch opened since), all of a row's tips fed in one head forward as one small tree
        level: a 1-layer head step costs about the same for one tip as for four. Per row, one (outcome, token, q)
        per new node: outcome None for the chain itself, else the branch's (k, t); q [V] fp32, None for greedy
        rows. A row with nothing left to grow answers []."""
        ids = tuple(request_ids)
        if not self.predraft:
            raise ValueError(f"{self.KIND}.grow: only chains draft ahead for rejection outcomes")
        rows = [self._row(r) for r in ids]
        lanes = [[] if r.draft is None or r.ahead is None else
                 [key for key in [None, *r.ahead.branches] if _lane_open(r.ahead, key)] for r in rows]
        grow = [i for i, keys in enumerate(lanes) if keys]
        out: list[list] = [[] for _ in ids]
        if not grow:
            return out
        index = {rid: i for i, rid in enumerate(self._rows)}
        drawn = self._step([rows[i] for i in grow], [index[ids[i]] for i in grow], [lanes[i] for i in grow])
        for i, row in zip(grow, drawn):
            out[i] = [(key, t, q) for key, (t, q) in zip(lanes[i], row) if t >= 0]
        return out

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        H = self.head.config.hidden_size
        plain, keep, hits = [], [], []
        for v in verdicts:  # check them all before changing anything
            row, k, nxt = self._row(v.request_id), len(v.accepted), int(v.next_token)
            toks = row.draft[0] if row.draft is not None else []
            a = row.ahead
            path = a.path if a is not None else list(range(len(toks)))
            on_path = list(v.accepted) == path[:k] and len(path) >= k \
                and [toks[i] for i in path[:k]] == [int(t) for t in v.tokens]
            main = on_path and len(path) > k and toks[path[k]] == nxt
            branch = on_path and not main and a is not None and (k, nxt) in a.branches
            if not self.lookahead or not (main or branch):
                raise ValueError(f"{self.KIND}.observe_ahead: {v.request_id!r}: the verdict does not accept a "
                                 "prefix of the outstanding chain followed by its next node or an open branch's first")
            if v.hidden is None or tuple(v.hidden.shape) != (1 + k, H):
                got = None if v.hidden is None else tuple(v.hidden.shape)
                raise ValueError(f"{self.KIND}.observe_ahead: {v.request_id!r} needs hidden [1 + {k}, {H}], "
                                 f"got {got}")
            # nothing past the landing node: observed as usual; otherwise the nodes past it become the outstanding
            # proposal, also when they cannot grow any more (a stop token): the verifier is about to see them
            if branch:
                (hits if len(a.branches[(k, nxt)].tokens) > 1 else plain).append(v)
            else:
                (plain if len(path) == k + 1 or a is None else keep).append(v)
        for v, is_branch in [(v, False) for v in keep] + [(v, True) for v in hits]:
            row, k, nxt = self._rows[v.request_id], len(v.accepted), int(v.next_token)
            toks, a = row.draft[0], row.ahead
            row.tail_h = torch.cat([row.tail_h, v.hidden.to(self.device, self.dtype)])  # [T + 1 + k, H]
            row.tail_x += [toks[i] for i in a.path[:k]] + [nxt]
            row.root = None
            if is_branch:
                b = a.branches[(k, nxt)]  # a foreseen rejection: the branch's nodes after t are the proposal
                rest, cols, src, is_open, out = b.tokens[1:], b.cols[1:], b.src[1:], b.open, b.src[-1]
            else:
                rest, cols, src, is_open, out = ([toks[i] for i in a.path[k + 1:]], a.cols[k + 1:], a.src[k + 1:],
                                                 a.open, a.out)
            row.draft = (rest, list(range(-1, len(rest) - 1)))  # a chain from here on
            row.ahead = _Ahead(cols, out, list(range(len(rest))), open=is_open, src=src)
        if plain:
            self.observe(plain)  # after the kept chains dropped their accepted nodes: fewer pinned columns
        else:
            self._reclaim()

    def release(self, request_ids: Sequence[str]) -> None:
        drop = {r for r in request_ids if r in self._rows}
        if not drop:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in drop]
        self._kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        for rid in drop:
            del self._rows[rid]
        self._reclaim()

    @torch.no_grad()
    def root_logits(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The head's logits for the token after each row's pending token: [B, V] fp32 (feeds pending tails)."""
        rows = [self._row(r) for r in request_ids]
        if any(r.draft is not None for r in rows):
            raise ValueError(f"{self.KIND}.root_logits: a row's proposal was not observed")
        index = {rid: i for i, rid in enumerate(self._rows)}
        self._feed_tails([r for r in rows if r.tail_x], [index[r] for r in request_ids if self._rows[r].tail_x])
        return self.head.logits(torch.stack([r.root for r in rows]), self._int8)

    # ------------------------------------------------------------------------------------------------ internals

    def _row(self, request_id: str) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"{self.KIND}: unknown request id {request_id!r}")
        return row

    def _generator(self, c: DraftContext) -> torch.Generator:
        return request_generator(self.KIND, self.seed, c.seed, self._seeder)

    def _forward(self, nxt, hid, pos, allowed, cache, **extra) -> torch.Tensor:
        """nxt [B, T] int64, hid [B, T, H], pos [B, T], allowed [B, 1, T, S + T] bool -> head output [B, T, H]."""
        mask = attention_mask(allowed.to(self.device), self._attn, self.dtype)
        return self.head(nxt.to(self.device), hid, pos.to(self.device), mask, cache, int8=self._int8, **extra)

    def _reclaim(self) -> None:
        """``BatchedKV.reclaim``, pinning the fed columns that later draft queries still attend to (invalid slots,
        fed with predicted h^) and renumbering them: an open chain's that ``extend`` can grow; with ``Predraft``
        (chains) every outstanding chain's and branch's, open or not, since a branch opened later or a branch taken
        by ``observe_ahead`` reads them. Every other draft column is dead once its proposal is drawn (``observe``
        feeds the target's own h instead)."""
        ahead = {b: r.ahead for b, r in enumerate(self._rows.values())
                 if r.ahead is not None and (r.ahead.open or self.predraft)}  # by cache row
        pins = {b: [c for c in a.cols + [c for br in a.branches.values() for c in br.cols] if c >= 0]
                for b, a in ahead.items()}
        moved = self._kv.reclaim(pins)  # [B, S_old] int64 (CPU) or None
        if moved is None:
            return
        for b, a in ahead.items():
            a.cols = [int(moved[b, c]) if c >= 0 else -1 for c in a.cols]
            for br in a.branches.values():
                br.cols = [int(moved[b, c]) if c >= 0 else -1 for c in br.cols]

    def _lane(self, r: _Row, key: tuple[int, int] | None) -> tuple[int, torch.Tensor, int, list[int]]:
        """What feeding lane ``key`` (None: the outstanding chain; else a branch) takes next: (its last token, the
        head output [H] that token was drawn from, its position, the draft columns it may see)."""
        a = r.ahead
        if key is None:
            return r.draft[0][a.path[-1]], a.out, r.next_pos + len(a.path) - 1, a.cols
        b = a.branches[key]
        return b.tokens[-1], b.src[-1], r.next_pos + b.k + len(b.tokens) - 1, a.cols[: b.k] + b.cols

    def _step(self, rows: list[_Row], where: list[int], lanes: list[list[tuple[int, int] | None]]
              ) -> list[list[tuple[int, torch.Tensor | None]]]:
        """Draft one node on each of ``lanes`` (per row: None = the outstanding chain, (k, t) = a branch) of
        ``rows`` (cache rows ``where``; pending tails are fed first), all in one head forward; records every node
        in its lane. Per row and lane: (token, -1 when no mass is left; q [V] fp32, None for greedy rows)."""
        fed = [j for j, r in enumerate(rows) if r.tail_x]  # verdict pairs observe_ahead queued: the target's h first
        self._feed_tails([rows[j] for j in fed], [where[j] for j in fed])
        dev, H = self.device, self.head.config.hidden_size
        bc, w, s = len(rows), max(len(x) for x in lanes), self._kv.seq_len
        sel = torch.tensor(where, dtype=torch.long, device=dev)  # [Bc]
        feeds = [[self._lane(r, key) for key in keys] for r, keys in zip(rows, lanes)]
        start = min([c for fs in feeds for f in fs for c in f[3]], default=s)
        anc = self._kv.valid[sel, start:][:, None, :].repeat(1, w, 1)  # [Bc, W, D] committed slots since start
        nxt = torch.zeros(bc, w, dtype=torch.long, device=dev)  # [Bc, W]
        hid = torch.zeros(bc, w, H, dtype=self.dtype, device=dev)  # [Bc, W, H]
        pos = torch.zeros(bc, w, dtype=torch.long, device=dev)  # [Bc, W]
        ok = torch.zeros(bc, w, dtype=torch.bool, device=dev)  # [Bc, W]
        for j, fs in enumerate(feeds):
            for lane, (tok, h, p, cols) in enumerate(fs):
                nxt[j, lane], hid[j, lane], pos[j, lane], ok[j, lane] = tok, h, p, True
                if cols:
                    anc[j, lane, torch.tensor(cols, dtype=torch.long, device=dev) - start] = True  # its chain
        out = self._feed_draft(sel, nxt, hid, pos, anc, ok, start)  # [Bc, W, H]
        logits = self.head.logits(out, self._int8)  # [Bc, W, V] fp32
        if self.image_token_id is not None:
            logits[..., self.image_token_id] = float("-inf")
        drawn = []
        for j, (r, keys) in enumerate(zip(rows, lanes)):
            n = len(keys)
            if r.temperature > 0:  # per row: a seeded row consumes the same draws alone or batched
                probs = (logits[j, :n] / r.temperature).softmax(-1)  # [n, V] the law its lanes draw from
                kids = sample_without_replacement(probs[None], 1, [r.generator])[0, :, 0].tolist()  # -1 = no mass
            else:
                probs, kids = None, logits[j, :n].argmax(-1).tolist()
            for lane, (key, t) in enumerate(zip(keys, kids)):
                self._record(r, key, s + lane, out[j, lane], int(t))
            drawn.append([(int(t), None if probs is None else probs[lane]) for lane, t in enumerate(kids)])
        return drawn

    def _record(self, r: _Row, key: tuple[int, int] | None, col: int, out: torch.Tensor, t: int) -> None:
        """Lane ``key``'s last node was fed at ``col`` and gave ``out`` [H]; ``t`` was drawn from it (-1: none)."""
        a = r.ahead
        if key is None:
            a.cols.append(col)
            a.out = out.clone()
            if t < 0:  # nothing left to draw: the chain ends with a fed node and cannot grow
                a.open = False
                return
            toks, parents = r.draft
            toks.append(t)
            parents.append(a.path[-1])
            a.path.append(len(toks) - 1)
            a.src.append(a.out)
            a.open = t not in self._stop_set  # a stop token ends the chain: nothing after it can be used
            return
        b = a.branches[key]
        b.cols.append(col)
        if t < 0:
            b.open = False
            return
        b.tokens.append(t)
        b.src.append(out.clone())
        b.open = t not in self._stop_set

    def _feed_tails(self, rows: list[_Row], where: list[int]) -> None:
        """Feed ``rows``' tails (cache rows ``where``; others ride along with an invalid slot); sets their root."""
        if not rows:
            return
        b, H = self._kv.batch_size, self.head.config.hidden_size
        t = max(len(r.tail_x) for r in rows)
        nxt = torch.zeros(b, t, dtype=torch.long)  # [B, T]
        hid = torch.zeros(b, t, H, dtype=self.dtype, device=self.device)  # [B, T, H]
        pos = torch.zeros(b, t, dtype=torch.long)  # [B, T]
        real = torch.zeros(b, t, dtype=torch.bool)  # [B, T]
        for i, r in zip(where, rows):
            n = len(r.tail_x)
            nxt[i, :n], hid[i, :n], real[i, :n] = torch.tensor(r.tail_x), r.tail_h, True
            pos[i] = r.next_pos + torch.arange(t)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        block = (causal[None] & real[:, None, :]) | torch.eye(t, dtype=torch.bool)[None]  # [B, T, T]
        out = self._forward(nxt, hid, pos, self._kv.block_mask(block.to(self.device)), self._kv.cache)  # [B, T, H]
        self._kv.extend_valid(real.to(self.device))
        for i, r in zip(where, rows):
            n = len(r.tail_x)
            r.root, r.next_pos = out[i, n - 1].clone(), r.next_pos + n
            r.tail_h, r.tail_x = r.tail_h[:0], []

    def _feed_draft(self, sel, nxt, hid, pos, anc, ok, draft_start: int) -> torch.Tensor:
        """One tree level for the call rows ``sel`` [Bc]: nxt/ok [Bc, W], hid [Bc, W, H], pos [Bc] (or [Bc, W]: a
        position per node), anc [Bc, W, D]
        bool (draft columns since ``draft_start`` each node may see: its ancestors') -> head output [Bc, W, H]."""
        b, (bc, w), s = self._kv.batch_size, nxt.shape, self._kv.seq_len
        dev = self.device
        tok = torch.zeros(b, w, dtype=torch.long, device=dev)
        h = torch.zeros(b, w, hid.shape[-1], dtype=self.dtype, device=dev)
        p = torch.zeros(b, w, dtype=torch.long, device=dev)
        tok[sel], h[sel], p[sel] = nxt, hid, pos if pos.dim() == 2 else pos[:, None].expand(bc, w)
        cached = self._kv.valid[:, None, :].expand(b, w, s).clone()  # [B, W, S]; draft columns are all invalid
        cached[sel, :, draft_start:] = anc[:, :, : s - draft_start] & ok[:, :, None]  # a node sees its ancestors
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(b, w, w)
        out = self._forward(tok, h, p, torch.cat([cached, eye], dim=2)[:, None], self._kv.cache)  # [B, W, H]
        self._kv.extend_valid(torch.zeros(b, w, dtype=torch.bool, device=dev))  # never valid: see the docstring
        return out[sel]

    def _grow(self, rows: list[_Row], sel: torch.Tensor, k: int, depth: int, budget: int):
        """Build every call row's draft tree (module docstring). Returns tokens [Bc, N] int64 (CPU), parents
        [Bc, N] int64 (CPU), q [Bc, N, V] fp32 or None, counts per row, the last frontier's head outputs
        [Bc, W, H], and ``fed(b, path)`` -> (the draft column each node of ``path`` but the last was fed at, the
        head outputs [len(path), H] its nodes were drawn from), for drafting ahead along a path of row b's tree."""
        if k == 1 and budget >= depth:  # a chain: every node is kept and every fed column is an ancestor
            return self._grow_chain(rows, sel, depth)
        return self._grow_tree(rows, sel, k, depth, budget)

    def _grow_tree(self, rows: list[_Row], sel: torch.Tensor, k: int, depth: int, budget: int):
        """``_grow`` for any tree (module docstring: levels, reranking, the sampled rows' budget)."""
        dev, bc = self.device, len(rows)
        greedy = torch.tensor([r.temperature == 0 for r in rows], device=dev)  # [Bc] bool
        temps = torch.tensor([r.temperature or 1.0 for r in rows], device=dev)[:, None, None]  # [Bc, 1, 1]
        sampled_ids = [i for i, r in enumerate(rows) if r.temperature > 0]
        draft_start = self._kv.seq_len
        d_max = k * max(depth - 1, 0)  # draft columns this proposal may feed
        # the frontier: slots whose children the next level draws; level 1's is the root
        f_out = torch.stack([r.root for r in rows])[:, None]  # [Bc, W, H] head outputs at the slots
        f_node = torch.full((bc, 1), -1, dtype=torch.long, device=dev)  # [Bc, W] node index (-1 = root)
        f_ok = torch.ones(bc, 1, dtype=torch.bool, device=dev)  # [Bc, W]
        f_score = torch.zeros(bc, 1, device=dev)  # [Bc, W] cumulative log-confidence
        f_anc = torch.zeros(bc, 1, d_max, dtype=torch.bool, device=dev)  # [Bc, W, D] columns a child may see
        f_group = torch.where(greedy, k, min(k, budget))[:, None]  # [Bc, W] children per slot
        count = torch.zeros(bc, dtype=torch.long, device=dev)  # [Bc] nodes so far
        toks, pars, scores, oks, hins, ancs, qsrc, qs = [], [], [], [], [], [], [], []
        n_nodes, n_q = 0, 0
        fed_nodes, fed_cols = [], []  # per fed level: frontier node indices [Bc, k] and their columns [Bc, k]
        for level in range(1, depth + 1):
            logits = self.head.logits(f_out, self._int8)  # [Bc, W, V] fp32
            w = logits.shape[1]
            if self.image_token_id is not None:
                logits[..., self.image_token_id] = float("-inf")
            conf = torch.where(greedy[:, None, None], logits.log_softmax(-1), (logits / temps).log_softmax(-1))
            kids = logits.topk(k, dim=-1).indices  # [Bc, W, k] greedy rows: the top-k tokens
            probs = None
            if sampled_ids:
                probs = (logits / temps).softmax(-1)  # [Bc, W, V] the law sampled rows draw from
                active = [i for i in sampled_ids if bool(f_ok[i].any())]  # a row draws only when it grows
                if active:
                    a = torch.tensor(active, device=dev)
                    drawn = sample_without_replacement(probs[a], k, [rows[i].generator for i in active])
                    kids[a] = drawn.to(dev)  # [Ba, W, k] in draw order, -1 = no mass left
            ok = f_ok[..., None] & (kids >= 0) & (torch.arange(k, device=dev) < f_group[..., None])  # [Bc, W, k]
            kids = kids.clamp_min(0)
            score = torch.minimum(f_score[..., None] + conf.gather(-1, kids), f_score[..., None])  # never > parent
            # this level's nodes, a slot's children contiguous and in draw order
            toks.append(kids.reshape(bc, w * k))
            pars.append(f_node.repeat_interleave(k, dim=1))
            scores.append(torch.where(ok, score, float("-inf")).reshape(bc, w * k))
            oks.append(ok.reshape(bc, w * k))
            hins.append(f_out.repeat_interleave(k, dim=1))  # [Bc, W*k, H] a child is fed with its parent's h^
            ancs.append(f_anc.repeat_interleave(k, dim=1))  # [Bc, W*k, D]
            qsrc.append(n_q + torch.arange(w, device=dev).repeat_interleave(k).expand(bc, w * k))
            if probs is not None:
                qs.append(probs)
            n_q += w
            count += oks[-1].sum(1)
            start, n_nodes = n_nodes, n_nodes + w * k
            if level == depth:
                break
            # the next frontier: the best k nodes of this level by cumulative confidence (invalid ones sort last)
            lvl_score, lvl_ok = scores[-1], oks[-1]
            lvl_ok = lvl_ok & ~torch.isin(toks[-1], self.stop_ids)  # a stop token gets no children
            ranked = torch.where(lvl_ok, lvl_score, float("-inf"))  # [Bc, W*k]
            order = ranked.sort(dim=1, descending=True, stable=True).indices[:, :k]  # [Bc, k]
            slot = torch.arange(k, device=dev)
            left = (budget - count).clamp_min(0)  # [Bc] sampled rows: the budget decides before drawing
            n_slots = torch.where(greedy, k, (left + k - 1) // k)  # [Bc]
            f_ok = lvl_ok.gather(1, order) & (slot[None] < n_slots[:, None])  # [Bc, k]
            f_group = torch.where(greedy[:, None], k, (left[:, None] - k * slot[None]).clamp(0, k))
            if not bool(f_ok.any()):
                break
            f_node = start + order  # [Bc, k]
            f_score = lvl_score.gather(1, order)
            nxt = toks[-1].gather(1, order)
            hid = hins[-1].gather(1, order[..., None].expand(-1, -1, hins[-1].shape[-1]))
            anc = ancs[-1].gather(1, order[..., None].expand(-1, -1, d_max))  # [Bc, k, D]
            col = self._kv.seq_len - draft_start  # the slots' draft columns: col .. col + k - 1
            pos = torch.tensor([r.next_pos + level - 1 for r in rows], device=dev)  # level-l nodes: next_pos + l - 1
            f_out = self._feed_draft(sel, nxt, hid, pos, anc, f_ok, draft_start)  # [Bc, k, H]
            fed_nodes.append(torch.where(f_ok, f_node, -1))
            fed_cols.append((draft_start + col + slot).expand(bc, k))
            f_anc = anc.clone()
            f_anc[:, slot, col + slot] = True  # a child also sees its parent's column
        tokens, parents, score, ok = (torch.cat(x, 1) for x in (toks, pars, scores, oks))  # [Bc, M]
        # greedy rows: EAGLE-2's rerank to the best `budget` nodes; sampled rows keep everything they drew
        rank = torch.empty_like(score, dtype=torch.long)
        order = score.sort(dim=1, descending=True, stable=True).indices
        rank.scatter_(1, order, torch.arange(score.shape[1], device=dev).expand_as(order))
        keep = ok & (~greedy[:, None] | (rank < budget))  # [Bc, M]
        q = None
        if qs:
            src = torch.cat(qsrc, 1)  # [Bc, M] which slot's q each node was drawn from
            allq = torch.cat(qs, 1)  # [Bc, n_q, V]
            q = allq.gather(1, src[..., None].expand(-1, -1, allq.shape[-1]))  # [Bc, M, V]
            one_hot = torch.nn.functional.one_hot(tokens, self.vocab_size).to(q.dtype)
            q = torch.where(greedy[:, None, None], one_hot, q)
        tok, par, q, counts, order = _compact(tokens, parents, q, keep)
        node_col = torch.full((bc, tokens.shape[1] + 1), -1, dtype=torch.long, device=dev)  # [Bc, M + 1]; M: unfed
        for nodes, cols in zip(fed_nodes, fed_cols):
            node_col.scatter_(1, torch.where(nodes >= 0, nodes, tokens.shape[1]), cols)
        h_in = torch.cat(hins, 1)  # [Bc, M, H] the head output each node was drawn from

        def fed(b: int, path: list[int]) -> tuple[list[int], torch.Tensor]:
            old = order[b, path]  # the path's nodes before compaction
            return node_col[b, old[:-1]].tolist(), h_in[b, old].clone()  # [len(path), H]

        return tok, par, q, counts, f_out, fed


    def _grow_chain(self, rows: list[_Row], sel: torch.Tensor, depth: int):
        """``_grow`` for one child per node with room for all ``depth`` of them (a chain): the same tokens, q, draws
        and results, without the tree's bookkeeping (scores, reranking, compaction, ancestor sets). A row's chain
        ends after a stop token or a draw with no mass left; every column it fed is an ancestor of its next node."""
        dev, bc = self.device, len(rows)
        greedy = torch.tensor([r.temperature == 0 for r in rows], device=dev)  # [Bc] bool
        sampled_ids = [i for i, r in enumerate(rows) if r.temperature > 0]
        temps = torch.tensor([r.temperature or 1.0 for r in rows], device=dev)[:, None, None] if sampled_ids else None
        draft_start = self._kv.seq_len
        out = torch.stack([r.root for r in rows])[:, None]  # [Bc, 1, H] the head output the next node is drawn from
        alive = torch.ones(bc, 1, dtype=torch.bool, device=dev)  # [Bc, 1] rows whose chain still grows
        anc = torch.ones(bc, 1, max(depth - 1, 0), dtype=torch.bool, device=dev)  # [Bc, 1, D] every fed column
        toks, oks, hins, qs = [], [], [], []
        for level in range(1, depth + 1):
            logits = self.head.logits(out, self._int8)  # [Bc, 1, V] fp32
            if self.image_token_id is not None:
                logits[..., self.image_token_id] = float("-inf")
            kids = logits.topk(1, dim=-1).indices[..., 0]  # [Bc, 1] greedy rows: the argmax
            if sampled_ids:
                probs = (logits / temps).softmax(-1)  # [Bc, 1, V] the law sampled rows draw from
                qs.append(probs)
                growing = alive[:, 0].tolist()  # one host read per level
                active = [i for i in sampled_ids if growing[i]]  # a row draws only while its chain grows
                if active:
                    a = torch.tensor(active, device=dev)
                    drawn = sample_without_replacement(probs[a], 1, [rows[i].generator for i in active])
                    kids[a] = drawn[..., 0].to(dev)  # [Ba, 1], -1 = no mass left
            ok = alive & (kids >= 0)  # [Bc, 1]
            kids = kids.clamp_min(0)
            toks.append(kids)
            oks.append(ok)
            hins.append(out)
            if level == depth:
                break
            alive = ok & ~torch.isin(kids, self.stop_ids)  # a stop token gets no children
            if not bool(alive.any()):
                break
            pos = torch.tensor([r.next_pos + level - 1 for r in rows], device=dev)  # level-l nodes: next_pos + l - 1
            out = self._feed_draft(sel, kids, out, pos, anc, alive, draft_start)  # [Bc, 1, H]
        ok = torch.cat(oks, 1)  # [Bc, M] a prefix per row
        counts = ok.sum(1).tolist()
        n = max(max(counts), 1)
        live = torch.arange(n, device=dev)[None, :] < torch.tensor(counts, device=dev)[:, None]  # [Bc, N]
        tokens = torch.cat(toks, 1)[:, :n]  # [Bc, N]
        tok = torch.where(live, tokens, 0).cpu()
        par = torch.where(live, torch.arange(-1, n - 1, device=dev)[None, :], -1).cpu()  # node i's parent: i - 1
        q = None
        if qs:
            q = torch.cat(qs, 1)[:, :n]  # [Bc, N, V] node i drawn from level i's law
            one_hot = torch.nn.functional.one_hot(tokens, self.vocab_size).to(q.dtype)
            q = torch.where(greedy[:, None, None], one_hot, q)
        h_in = torch.cat(hins, 1)  # [Bc, M, H] the head output each node was drawn from

        def fed(b: int, path: list[int]) -> tuple[list[int], torch.Tensor]:
            return [draft_start + i for i in path[:-1]], h_in[b, path].clone()  # [len(path), H]

        return tok, par, q, counts, out, fed


def _lane_open(a: _Ahead, key: tuple[int, int] | None) -> bool:
    """Whether lane ``key`` (None: the chain itself; else a branch) of an outstanding chain can still grow."""
    return a.open if key is None else a.branches[key].open


def _compact(tokens, parents, q, keep):
    """Keep the ``keep`` nodes of each row in index order (parents first), remap parents.

    tokens/parents/keep [B, M] (parents: node index, -1 = root), q [B, M, V] or None -> tokens/parents [B, N] on
    the CPU, q [B, N, V] or None, counts (N = the largest count), order [B, N] (each kept node's index before).
    """
    counts = keep.sum(1).tolist()
    n = max(max(counts), 1)
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :n]  # [B, N] kept nodes first
    new_index = keep.long().cumsum(1) - 1  # [B, M] position of each kept node after compaction
    par = parents.gather(1, order)  # [B, N] old parent ids
    par = torch.where(par >= 0, new_index.gather(1, par.clamp_min(0)), -1)
    live = torch.arange(n, device=keep.device)[None, :] < torch.tensor(counts, device=keep.device)[:, None]
    tok = torch.where(live, tokens.gather(1, order), 0)
    par = torch.where(live, par, -1)
    if q is not None:
        q = q.gather(1, order[..., None].expand(-1, -1, q.shape[-1]))
    return tok.cpu(), par.cpu(), q, counts, order
