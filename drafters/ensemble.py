"""``ensemble``: In-batch Ensemble Drafting (IbED, Lee et al. 2024): one drafter model, several contexts of the
same request as rows of one batched forward, and the draft token sampled from the mixture of their distributions.

    q(x) = sum_m w_m q_m(x) / sum_m w_m          q_m = softmax(logits_m / T), image token masked    (Algorithm 1)

That q is the law the draft was really drawn from, so it is what goes to the verifier (``runtime/core/mixture.py``):
the output stays exactly the target's. Greedy rows draft the argmax of the mixture at temperature 1 (the paper's
greedy ensemble); their q is one-hot. Trees work too: a node's children are drawn from its mixture without
replacement, in draw order (the sibling law ``verify_tree`` assumes).

Members (``drafters/ensemble_members.py``): multimodal, text, caption, pooled; from config with weights (equal by
default). Past IbED, each request's weights adapt (``drafters/ensemble_weights.py``, option ``adapt``): the mixture
leans towards the members that predicted the request's committed tokens best so far (a Bayesian mixture with a
floor); the configured weights are the prior. By default the members other than the first join a request only on
demand (``drafters/ensemble_join.py``: a sampled request whose first member drafts poorly); ``join: at_once`` drafts
with all of them from the first block, as the paper does. The model is a ``MassvModel``
(``drafters/massv_model.py``: a small Llama + its projector over the target's vision features); its caption mode is
the captioner unless another one is given. ``massv`` (one multimodal member), ``pooled`` and ``caption`` are this
drafter with one member.

Batching. The runner is ``text_lm``'s (``drafters/text_lm.py``): one ``BatchedKV`` over every cache row, one
forward per draft level over all rows. Here a row is (request, member): rows = requests x members, each with its
own prompt and positions; after the prompt every member reads the same committed tokens and the same draft tokens.
``propose`` asks the text_lm runner for the member rows of the call; its ``_children`` (overridden) mixes each
request's member distributions, draws the request's children once and gives every member row the same tokens, so
the rows stay in lockstep and their drafts (tokens, tree, columns) are identical; the proposal keeps one row per
request. ``observe`` applies each verdict to all of its request's rows. A request without images has one row: every
member's context is then the same text, and so is every q_m.

Captions are made once per request in ``begin`` (one batched greedy decode over all images of the call), timed,
and reported by ``pop_begin_times`` (the engine books them as "caption" instead of "draft"). An image seen before
(the same features, by sha256: a chat re-sends its image every turn) takes its caption from a cache of the last
``caption_cache`` images instead (LRU; 0 = off). A caption is a greedy decode of the image's features alone, so a
cached one is the caption the captioner would make again.

    drafter = create({"kind": "ensemble", "path": "massv",
                      "members": ["multimodal", "text", "caption", {"kind": "pooled", "grid": 3}]}, target=target)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specula.drafters import lean_llama
from specula.drafters.ensemble_join import JoinRule, JoinStats
from specula.drafters.ensemble_members import DEFAULT_GRID, Member, member_context, parse_members
from specula.drafters.ensemble_weights import adapted_weights, check_adapt, committed_logprobs, posterior
from specula.drafters.image_runs import feature_lengths, per_image
from specula.drafters.massv_model import CONFIG_FILE, MassvModel
from specula.drafters.outcomes import best_outcome, node_rank
from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registration import register
from specula.drafters.text_lm import TextLMDrafter, _Row
from specula.runtime.core.mixture import mix_distributions  # pure torch, no Ray/gRPC
from specula.runtime.core.sampling import sample_without_replacement
from specula.targets.batching import length_groups
from specula.targets.kv import attention_mask

ALL_MEMBERS = ("multimodal", "text", "caption", "pooled")


@register("ensemble")
class EnsembleDrafter(TextLMDrafter):
    """Options: ``path`` (zoo name or directory of a MassvModel, default "massv"; a plain Llama directory serves
    text-only members) or ``model`` (a ``MassvModel`` or a ``LlamaForCausalLM``); ``members`` (list of kind names
    or ``{"kind", "weight", "grid"}``, default all four, equal weights); ``weights`` (one per member); ``grid``
    (pooled members' default grid, an int or [g_h, g_w]; default 6 -> 36 tokens); ``captioner`` (a path or a
    ``MassvModel``; default the drafting model); ``caption_max_tokens``; ``caption_cache`` (images whose
    captions are kept for later requests, LRU; default 256, 0 = off); and ``text_lm``'s ``structure``,
    ``branching``, ``depth``, ``seed``, ``image_token_id``, ``kv_policy``, ``device``, ``dtype``,
    ``attn_implementation``. ``vocab_size`` (if given) must match. ``adapt`` (eta, default 1.0; 0 = the fixed
    weights of the paper) and ``adapt_floor`` (default 0.1): per-request weights from each member's likelihood of
    the committed tokens (``drafters/ensemble_weights.py``). ``prune_below`` (default 1e-3; 0 = never): a member
    whose adapted posterior falls below that fraction of the leading member's leaves the request (its row is
    released, the mixture is renormalised over the others), so a request whose best member has shown itself drafts
    at about that member's cost. ``join`` ("on_demand", the default, or "at_once" as IbED), ``join_after``
    (default 2 blocks), ``join_below`` (default 0.7) and ``join_greedy`` (default false): on demand, the first
    member drafts alone and the others join a sampled request once that member's acceptance rate there falls below
    ``join_below`` after at least ``join_after`` verified blocks; a greedy request keeps the first member alone
    unless ``join_greedy`` (``drafters/ensemble_join.py``). Resources: ``target``, ``tokenizer`` (unused)."""

    KIND = "ensemble"
    DEFAULT_MEMBERS: tuple = ALL_MEMBERS

    def __init__(self, path: str | Path = "massv", model: nn.Module | None = None, members: Sequence | None = None,
                 weights: Sequence[float] | None = None, grid=DEFAULT_GRID, captioner=None,
                 caption_max_tokens: int | None = None, caption_cache: int = 256, vocab_size: int | None = None,
                 adapt: float = 1.0, adapt_floor: float = 0.1, prune_below: float = 1e-3, join: str = "on_demand",
                 join_after: int = 2, join_below: float = 0.7, join_greedy: bool = False, dtype: str | None = None,
                 attn_implementation: str = "sdpa", image_token_id: int | None = None, device: str | None = None,
                 target=None, tokenizer=None, **options):
        options.update(image_token_id=image_token_id, device=device, target=target, tokenizer=tokenizer)
        info = getattr(target, "info", None)
        self._image_tokens = getattr(info, "visual_tokens_per_image", None)  # LLaVA's fixed T; None: one per run
        kind = self.KIND
        self.members: tuple[Member, ...] = parse_members(
            list(self.DEFAULT_MEMBERS) if members is None else members, weights, grid, where=kind)
        self.adapt, self.adapt_floor = check_adapt(adapt, adapt_floor, kind)
        if isinstance(prune_below, bool) or not isinstance(prune_below, (int, float)) or not 0 <= prune_below < 1:
            raise ValueError(f"{kind}: prune_below must be a number in [0, 1), got {prune_below!r}")
        self.prune_below = float(prune_below)
        self.join = JoinRule.parse(join, join_after, join_below, join_greedy, kind)
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"{kind}: unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16'")
        torch_dtype = getattr(torch, str(dtype)) if dtype is not None else None
        if model is None:
            model = _load(path, torch_dtype, attn_implementation)
        self.massv = model if isinstance(model, MassvModel) else None
        lm = model.lm if self.massv is not None else model
        if options.get("image_token_id") is None and options.get("target") is None:
            own = getattr(lm, "specula_info", {}).get("image_token_id")
            for m in (captioner, self.massv):
                own = m.config.image_token_id if isinstance(m, MassvModel) else own
            if own is not None:
                options["image_token_id"] = own
        super().__init__(model=lm, dtype=dtype, **options)
        # drafting ahead (chains): ``extend`` / ``observe_ahead`` / ``branch`` / ``grow`` run text_lm's on every
        # member row of a request, each next node drawn once from the request's mixture; a rejection outcome is
        # ranked by the mixture of the members' rows at its node (every member row keeps its own per node)
        self.keep_tree_logits = self.adapt > 0 and len(self.members) > 1  # ``_learn`` reads every node's row
        if self.massv is not None:
            self.massv.to(self.device, self.dtype)
            if self.massv.config.image_token_id != self.image_token_id:
                raise ValueError(f"{kind}: the model's image token {self.massv.config.image_token_id} != "
                                 f"{self.image_token_id}")
        if vocab_size is not None and int(vocab_size) != self.vocab_size:
            raise ValueError(f"{kind}: drafter vocabulary {self.vocab_size} != the target's {vocab_size}")
        if any(m.kind in ("multimodal", "pooled") for m in self.members) and self.massv is None:
            raise ValueError(f"{kind}: members {[m.name for m in self.members]} read images; the model has no "
                             f"projector (give a massv model, not a plain LM)")
        self.captioner = None
        if any(m.kind == "caption" for m in self.members):
            cap = captioner if captioner is not None else self.massv
            if isinstance(cap, (str, Path)):
                cap = _load(cap, torch_dtype, attn_implementation)
            if not isinstance(cap, MassvModel) or not cap.config.caption_prompt:
                raise ValueError(f"{kind}: a caption member needs a captioner: a massv model with a caption_prompt")
            self.captioner = cap.to(self.device, self.dtype).eval()
            if cap.config.image_token_id != self.image_token_id:
                raise ValueError(f"{kind}: the captioner's image token differs from the drafter's")
            if self.massv is not None and cap.config.feature != self.massv.config.feature:
                raise ValueError(f"{kind}: the captioner reads {cap.config.feature!r} features, the drafter "
                                 f"{self.massv.config.feature!r}; one request carries one kind")
        if caption_max_tokens is not None and (isinstance(caption_max_tokens, bool)
                                               or not isinstance(caption_max_tokens, int) or caption_max_tokens < 1):
            raise ValueError(f"{kind}: caption_max_tokens must be an integer >= 1, got {caption_max_tokens!r}")
        self.caption_max_tokens = caption_max_tokens
        if isinstance(caption_cache, bool) or not isinstance(caption_cache, int) or caption_cache < 0:
            raise ValueError(f"{kind}: caption_cache must be an integer >= 0, got {caption_cache!r}")
        self.caption_cache = caption_cache
        self._caption_lru: OrderedDict[bytes, list[int]] = OrderedDict()  # feature sha256 -> caption tokens
        self.spec = DrafterSpec(kind=kind, structure=self.spec.structure, needs=self._needs())
        self._groups_of: dict[str, list[str]] = {}  # request id -> its cache row keys, member order
        self._weights_of: dict[str, list[float]] = {}  # request id -> configured member weights (the prior)
        self._loglik_of: dict[str, list[float]] = {}  # request id -> per member, log-lik of the committed tokens
        self._call_groups: list[tuple[int, int, list[float]]] | None = None  # (first row, rows, weights) per request
        self._begin_times: dict[str, dict[str, float]] = {}
        self._waiting: dict[str, tuple[list[int], list[torch.Tensor], int]] = {}  # request id -> (prompt, its
        # image features, the first member's context length) while its other members wait to join (``join``)
        self._join_stats: dict[str, JoinStats] = {}

    def _needs(self) -> frozenset[str]:
        model = self.massv if self.massv is not None else self.captioner
        if model is None or not any(m.sees_images for m in self.members):
            return frozenset()
        return frozenset({"pre_projector" if model.config.feature == "pre_projector" else "visual"})

    # ------------------------------------------------------------------------------------------------ protocol

    @torch.no_grad()
    def begin(self, contexts: Sequence[DraftContext]) -> None:
        """Caption the images (if a member needs it), build every member's context, prefill all rows at once."""
        contexts = list(contexts)
        if not contexts:
            return
        kind = self.KIND
        ids = [c.request_id for c in contexts]
        if len(set(ids)) != len(ids) or any(i in self._groups_of for i in ids):
            raise ValueError(f"{kind}.begin: request ids must be new and unique, got {ids}")
        for c in contexts:
            if not float(c.temperature) >= 0:
                raise ValueError(f"{kind}.begin: request {c.request_id!r} has temperature {c.temperature!r}")
        feats = [self._features(c) for c in contexts]
        waits = [f is not None and len(self.members) > 1 and self.join.waits(float(c.temperature))
                 for c, f in zip(contexts, feats)]  # on demand: the others join later, if at all (``_join_due``)
        live = [self.members if self.join.at_once and f is not None else self.members[:1] for f in feats]
        captions = self._captions([c.request_id for c in contexts], _if_captioned(feats, live), book=True)
        rows: list[tuple[str, list[int], torch.Tensor | None]] = []  # (key, tokens, visual rows)
        groups, weights = {}, {}
        for c, f, cap, members, w in zip(contexts, feats, captions, live, waits):  # no image: one context, one row
            prompt = c.prompt_ids.tolist()
            keys = []
            for j, m in enumerate(members):
                toks, vis = member_context(m, prompt, f, cap, self.image_token_id)
                keys.append(f"{c.request_id}\x00{j}")
                rows.append((keys[-1], toks, vis))
            groups[c.request_id] = keys
            weights[c.request_id] = [m.weight for m in members]
            if w:
                self._waiting[c.request_id] = (prompt, f, len(rows[-1][1]))
                self._join_stats[c.request_id] = JoinStats()
        last, order = self._prefill(rows)  # [rows, V]; the order the rows joined the cache
        self._groups_of.update(groups)
        self._weights_of.update(weights)
        first_row = 0
        for c in contexts:  # the first token is the target's: each member's likelihood of it is a free first point
            n = len(groups[c.request_id])
            ll = [0.0] * n
            if n > 1 and self.adapt > 0 and all(len(rows[first_row + j][1]) for j in range(n)):
                ll = committed_logprobs(last[first_row:first_row + n, None], [int(c.first_token)],
                                        float(c.temperature) or 1.0, self.image_token_id)
            self._loglik_of[c.request_id] = ll
            first_row += n
        by_id = {c.request_id: (c, self._generator(c)) for c in contexts}  # one generator per request
        for key, toks, _ in (rows[i] for i in order):  # self._rows keeps the cache's row order
            c, gen = by_id[key.split("\x00")[0]]
            self._rows[key] = _Row(toks + [int(c.first_token)], [int(c.first_token)], len(toks),
                                   float(c.temperature), gen)

    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        return self._per_request(request_ids, "propose", lambda keys: super(EnsembleDrafter, self).propose(keys, gamma))

    def _per_request(self, request_ids: Sequence[str], op: str, run) -> Proposal:
        """Run text_lm's ``op`` (``run(keys)``) on the member rows of ``request_ids`` and keep one row per request:
        every member row of a request holds the same drafts, drawn from the request's mixture (``_children``)."""
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.KIND}.{op}: duplicate request ids {list(ids)}")
        keys, groups = [], []
        for rid in ids:
            ks = self._keys(rid)
            groups.append((len(keys), len(ks), self.member_weights(rid)))
            keys += ks
        self._call_groups = groups  # extend regroups the rows it grows (``_grouping``)
        try:
            prop = run(keys)
        finally:
            self._call_groups = None
        first = torch.tensor([g[0] for g in groups], dtype=torch.long)  # [B] the first row of each request
        q = prop.q[first.to(prop.q.device)] if prop.q is not None else None  # [B, N, V] the mixtures
        parents = prop.parents[first] if prop.parents is not None else None
        return Proposal(ids, prop.tokens[first], tuple(prop.counts[g[0]] for g in groups), parents, q)

    def observe(self, verdicts: Sequence[Verdict]) -> None:
        learnt, seen = self._learn(verdicts), self._blocks_seen(verdicts, ahead=False)
        super().observe([replace(v, request_id=k) for v in verdicts for k in self._keys(v.request_id)])
        self._apply(learnt)
        self._prune(learnt)
        self._join_due(seen)

    def extend(self, request_ids: Sequence[str], n: int) -> Proposal:
        """Draft ``n`` more nodes of each request's outstanding chain (``Lookahead``), every member row in lockstep."""
        return self._per_request(request_ids, "extend", lambda keys: super(EnsembleDrafter, self).extend(keys, n))

    def observe_ahead(self, verdicts: Sequence[Verdict]) -> None:
        learnt, seen = self._learn(verdicts), self._blocks_seen(verdicts, ahead=True)
        super().observe_ahead([replace(v, request_id=k) for v in verdicts for k in self._keys(v.request_id)])
        self._apply(learnt)
        self._prune(learnt)
        self._join_due(seen)

    def branch(self, rows: Sequence[tuple[str, int]]) -> list[tuple[int, int] | None]:
        """text_lm's ``branch``, ranked by each request's mixture (at the weights of now: the ranking only picks
        which outcome to draft for) and opened on every member row of the request alike."""
        rows = [(rid, int(last)) for rid, last in rows]
        for rid, _ in rows:
            self._keys(rid)
        out: list[tuple[int, int] | None] = []
        for rid, last in rows:
            members = [self._rows[k] for k in self._keys(rid)]
            d = members[0].draft
            best = None
            if self.predraft and d is not None:
                temp, w = members[0].temperature or 1.0, self.member_weights(rid)
                best = best_outcome(lambda k: self._mixed_rank(members, k, temp, w), min(last, d.main - 1),
                                    d.opened)
            if best is not None:
                for r in members:
                    self._open_branch(r.draft, *best)
            out.append(best)
        return out

    def grow(self, request_ids: Sequence[str]) -> list[list[tuple[tuple[int, int] | None, int, torch.Tensor | None]]]:
        """text_lm's ``grow`` over every member row of each request (one forward), each lane's next node drawn once
        from the request's mixture (``_grow_children``); one list per request."""
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"{self.KIND}.grow: duplicate request ids {list(ids)}")
        keys, first = [], []
        for rid in ids:
            first.append(len(keys))
            keys += self._keys(rid)
        out = super().grow(keys)
        return [out[i] for i in first]

    def _mixed_rank(self, members: list[_Row], k: int, temperature: float, weights: list[float]
                    ) -> tuple[float, list[tuple[int, float]]]:
        """Main node k's ``outcomes.node_rank`` under the mixture of the members' rows at k (cached on the first
        member row's draft). A branch's first node ranks as (1, [])."""
        d = members[0].draft
        if k not in d.ranked:
            rows = [r.draft.logits[k] for r in members]
            if rows[0] is None:
                d.ranked[k] = (1.0, [])
            else:
                lg = torch.stack(rows).float()  # [M, V]
                lg[:, self.image_token_id] = float("-inf")
                mixed = mix_distributions(torch.softmax(lg / temperature, dim=-1), weights)  # [V]
                # node_rank takes logits: temperature * log(mixture) gives back the mixture under its softmax
                d.ranked[k] = node_rank(temperature * torch.log(mixed), d.tokens[k], temperature, self.image_token_id)
        return d.ranked[k]

    def _grow_children(self, row_ids: Sequence[str], rows: list[_Row], logits: torch.Tensor, widths: list[int]
                       ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """``grow``'s draws per request: its member rows (contiguous, the same lanes) draw each lane's next node
        once from the request's mixture (``_children``) and all get the same tokens and q."""
        out: list = [None] * len(rows)
        j = 0
        while j < len(rows):
            rid = row_ids[j].split("\x00")[0]
            e = j
            while e < len(rows) and row_ids[e].split("\x00")[0] == rid:
                e += 1
            n = widths[j]
            if any(widths[x] != n for x in range(j, e)):
                raise RuntimeError(f"{self.KIND}: request {rid!r}'s member rows grow different lanes")
            self._grouping(row_ids[j:e])
            try:
                kids, probs = self._children(
                    logits[j:e, :n], 1, torch.tensor([r.temperature or 1.0 for r in rows[j:e]], device=self.device),
                    torch.tensor([r.temperature == 0 for r in rows[j:e]]), [r.generator for r in rows[j:e]])
            finally:
                self._call_groups = None
            for x in range(j, e):
                out[x] = (kids[x - j, :, 0], probs[x - j] if probs is not None else None)
            j = e
        return out

    def _grouping(self, row_ids: Sequence[str]) -> None:
        """``extend``'s rows -> ``_call_groups``: a request's member rows are contiguous and grow together (they
        draw the same tokens, so they close together)."""
        groups: list[tuple[int, int, list[float]]] = []
        for i, key in enumerate(row_ids):
            rid = key.split("\x00")[0]
            if groups and row_ids[groups[-1][0]].split("\x00")[0] == rid:
                s, n, w = groups[-1]
                groups[-1] = (s, n + 1, w)
            else:
                groups.append((i, 1, self.member_weights(rid)))
        for s, n, w in groups:
            if n != len(w):
                raise RuntimeError(f"{self.KIND}: request {row_ids[s]!r} drafts ahead with {n} of its {len(w)} "
                                   f"member rows")
        self._call_groups = groups

    def release(self, request_ids: Sequence[str]) -> None:
        keys = [k for r in request_ids if r in self._groups_of for k in self._groups_of[r]]
        for r in request_ids:
            self._groups_of.pop(r, None)
            self._weights_of.pop(r, None)
            self._loglik_of.pop(r, None)
            self._begin_times.pop(r, None)
            self._waiting.pop(r, None)
            self._join_stats.pop(r, None)
        super().release(keys)

    def context(self, request_id: str, member: int = 0) -> list[int]:
        """The committed context of one member row of a request (its prompt form + committed tokens)."""
        return super().context(self._keys(request_id)[member])

    def live_members(self, request_id: str) -> list[str]:
        """The names of the members still drafting for the request (member order; ``prune_below``)."""
        return [self.members[int(k.split("\x00")[1])].name for k in self._keys(request_id)]

    def member_weights(self, request_id: str) -> list[float]:
        """The weights the request's next draft is mixed with (sum 1; member order; one weight without images)."""
        prior = self._weights_of.get(request_id)
        if prior is None:
            raise ValueError(f"{self.KIND}: unknown request id {request_id!r}")
        return adapted_weights(prior, self._loglik_of[request_id], self.adapt, self.adapt_floor)

    def pop_begin_times(self) -> dict[str, dict[str, float]]:
        """Drafter-side parts of the last ``begin`` calls per request (seconds, e.g. {"caption": 0.02}); cleared."""
        out, self._begin_times = self._begin_times, {}
        return out

    # ------------------------------------------------------------------------------------------------ internals

    def _keys(self, request_id: str) -> list[str]:
        keys = self._groups_of.get(request_id)
        if keys is None:
            raise ValueError(f"{self.KIND}: unknown request id {request_id!r}")
        return keys

    def _learn(self, verdicts: Sequence[Verdict]) -> dict[str, list[float]]:
        """Each member's log-likelihood of what each verdict commits (``ensemble_weights``), read from the member
        rows' outstanding drafts (every node keeps the member's logits it was drawn from). Nothing changes here:
        ``_apply`` adds it once the verdicts are known to be valid. A verdict that does not fit its draft is left
        to the base class to refuse."""
        out: dict[str, list[float]] = {}
        if self.adapt == 0:
            return out
        for v in verdicts:
            keys = self._groups_of.get(v.request_id)
            if keys is None or len(keys) < 2:
                continue
            path, toks = [int(i) for i in v.accepted], [int(t) for t in v.tokens]
            rows = [self._rows[k] for k in keys]
            drafts = [r.draft for r in rows]  # the member rows draft in lockstep: the same nodes
            d = drafts[0]
            if any(x is None for x in drafts) or len(path) != len(toks) \
                    or any(not 0 <= i < len(d.logits) or d.logits[i] is None for i in path):
                continue  # no draft (a plain step) or a malformed verdict
            last = path[-1] if path else -1
            nxt = next((i for i, p in enumerate(d.parents) if p == last and i < len(d.logits)
                        and d.logits[i] is not None), None)  # a node drawn where the next token lands
            nodes, counted = (path + [nxt], toks + [int(v.next_token)]) if nxt is not None else (path, toks)
            if not nodes:
                continue
            logits = torch.stack([torch.stack([x.logits[i] for i in nodes]) for x in drafts])  # [M, P, V]
            out[v.request_id] = committed_logprobs(logits, counted, rows[0].temperature or 1.0, self.image_token_id)
        return out

    def _blocks_seen(self, verdicts: Sequence[Verdict], ahead: bool) -> dict[str, tuple[int, bool]]:
        """(accepted, missed) of each verdict whose request's other members wait and whose draft it verifies: the
        draft tokens kept, and whether the target turned one down (a drafted node after the accepted path; drafting
        ahead, ``observe_ahead``: the chain's node there did not match the next token, so the verdict landed on a
        rejection branch). Read before the base class moves the drafts on; counted by ``_join_due``."""
        out = {}
        for v in verdicts:
            if v.request_id not in self._waiting:
                continue
            d = self._rows[self._keys(v.request_id)[0]].draft
            if d is None or not d.tokens:
                continue
            path = [int(i) for i in v.accepted]
            if ahead:  # accepts nodes 0..k-1 of the chain, k < its length
                k = len(path)
                missed = not (k < len(d.tokens) and d.tokens[k] == int(v.next_token))
            else:
                last = path[-1] if path else -1
                missed = any(p == last for p in d.parents)
            out[v.request_id] = (len(path), missed)
        return out

    @torch.no_grad()
    def _join_due(self, seen: dict[str, tuple[int, bool]]) -> None:
        """Count the verified blocks and bring in the waiting members of the requests whose first member drafts
        poorly (``ensemble_join``), once no row of theirs holds an outstanding draft: one prefill of their contexts,
        the committed tokens queued as each new row's tail."""
        due = []
        for rid, (accepted, missed) in seen.items():
            stats = self._join_stats[rid]
            stats.add(accepted, missed)
            if self.join.due(stats) and all(self._rows[k].draft is None for k in self._keys(rid)):
                due.append(rid)
        if not due:
            return
        waiting = [self._waiting.pop(rid) for rid in due]
        for rid in due:
            del self._join_stats[rid]
        rest = self.members[1:]
        captions = self._captions(due, _if_captioned([f for _, f, _ in waiting], [rest] * len(due)), book=False)
        rows: list[tuple[str, list[int], torch.Tensor | None]] = []  # (key, member context, visual rows)
        for rid, (prompt, f, _), cap in zip(due, waiting, captions):
            for j, m in enumerate(rest, start=1):
                rows.append((f"{rid}\x00{j}", *member_context(m, prompt, f, cap, self.image_token_id)))
        _, order = self._prefill(rows)
        lead = {rid: self._rows[self._keys(rid)[0]] for rid in due}
        answer = {rid: lead[rid].context[n:] for rid, (_, _, n) in zip(due, waiting)}  # committed since the prompt
        for key, toks, _ in (rows[i] for i in order):  # self._rows keeps the cache's row order
            rid = key.split("\x00")[0]
            first = lead[rid]
            self._rows[key] = _Row(toks + answer[rid], list(answer[rid]), len(toks), first.temperature,
                                   first.generator)
        for rid in due:  # every member now, in member order; the mixture starts again from the configured weights
            self._groups_of[rid] = [f"{rid}\x00{j}" for j in range(len(self.members))]
            self._weights_of[rid] = [m.weight for m in self.members]
            self._loglik_of[rid] = [0.0] * len(self.members)

    def _apply(self, learnt: dict[str, list[float]]) -> None:
        for rid, gains in learnt.items():
            self._loglik_of[rid] = [a + b for a, b in zip(self._loglik_of[rid], gains)]

    def _prune(self, requests) -> None:
        """Drop the member rows of these requests whose posterior fell below ``prune_below`` x the leader's, once
        none of the request's rows holds an outstanding draft. The weights depend only on committed tokens, and so
        does this: q stays the mixture each draft is drawn from, now over the members left."""
        if not self.prune_below or self.adapt == 0:
            return
        drop: list[str] = []
        for rid in requests:
            keys, prior, ll = self._groups_of[rid], self._weights_of[rid], self._loglik_of[rid]
            if len(keys) < 2 or any(self._rows[k].draft is not None for k in keys):
                continue
            post = posterior(prior, ll, self.adapt)  # the same posterior the mixture's weights lean on
            if post is None:
                continue
            keep = [j for j, p in enumerate(post) if p >= self.prune_below * max(post)]
            if len(keep) == len(keys):
                continue
            drop += [k for j, k in enumerate(keys) if j not in keep]
            self._groups_of[rid] = [keys[j] for j in keep]
            self._weights_of[rid] = [prior[j] for j in keep]
            self._loglik_of[rid] = [ll[j] for j in keep]
        if drop:
            TextLMDrafter.release(self, drop)

    def _features(self, c: DraftContext) -> list[torch.Tensor] | None:
        """The target features of the request's images, one [T_img, D] per image in prompt order (the engine's
        [N_img, T_max, D] without its padding: ``image_runs``), or None (no image, or no member reads them)."""
        n = int((c.prompt_ids == self.image_token_id).sum())
        if not n or not self.spec.needs:
            return None
        model = self.massv if self.massv is not None else self.captioner
        cfg = model.config
        field = "extra['pre_projector']" if cfg.feature == "pre_projector" else "visual"
        f = c.extra.get("pre_projector") if cfg.feature == "pre_projector" else c.visual
        got = None if f is None else tuple(f.shape)
        try:
            if f is not None and f.shape[-1] != cfg.feature_dim:
                raise ValueError(f"width {f.shape[-1]} != D={cfg.feature_dim}")
            lengths = feature_lengths(c.prompt_ids, self.image_token_id, f, self._image_tokens)
        except ValueError as e:
            raise ValueError(f"{self.KIND}.begin: {c.request_id!r} has {n} image tokens and needs DraftContext."
                             f"{field} [N_img, T_max, D={cfg.feature_dim}] (one row per image, padded to the "
                             f"longest), got {got}: {e}") from None
        return per_image(f.to(self.device, self.dtype), lengths)

    def _captions(self, request_ids: Sequence[str], feats, book: bool) -> list[list[list[int]] | None]:
        """One caption (token list) per image of each request with features (None: no caption wanted): cached ones
        from the cache, the others in one batched greedy decode per image size. ``book``: time it for
        ``pop_begin_times`` (in ``begin``; a caption made when members join is drafting time)."""
        out: list[list[list[int]] | None] = [None] * len(request_ids)
        todo = [i for i, f in enumerate(feats) if f is not None]
        if self.captioner is None or not todo:
            return out
        t0 = time.perf_counter()
        keys = {i: [_image_key(f) for f in feats[i]] if self.caption_cache else [None] * len(feats[i])
                for i in todo}
        known: dict[bytes, list[int]] = {}  # captions of keyed images: from the cache, or decoded in this call
        by_len: dict[int, list[tuple[int, int]]] = {}  # (context, image) to decode, by token count
        for i in todo:
            for j, key in enumerate(keys[i]):
                if key is not None and key in self._caption_lru:
                    self._caption_lru.move_to_end(key)
                    known[key] = self._caption_lru[key]
                elif key is None or key not in known:
                    if key is not None:
                        known[key] = []  # placeholder: a repeat of this image in the call reuses its decode
                    by_len.setdefault(feats[i][j].shape[0], []).append((i, j))
        fresh: dict[tuple[int, int], list[int]] = {}
        for group in by_len.values():
            caps = self.captioner.caption(torch.stack([feats[i][j] for i, j in group]), self.caption_max_tokens,
                                          int8=self._int8)  # the drafter's own weights choice
            for (i, j), cap in zip(group, caps):
                fresh[i, j] = cap
                if keys[i][j] is not None:
                    known[keys[i][j]] = self._caption_lru[keys[i][j]] = cap
                    while len(self._caption_lru) > self.caption_cache:
                        self._caption_lru.popitem(last=False)
        for i in todo:
            out[i] = [fresh[i, j] if (i, j) in fresh else known[key] for j, key in enumerate(keys[i])]
        spent = time.perf_counter() - t0
        n_img = sum(len(feats[i]) for i in todo)
        for i in todo if book else ():  # the batch's time, shared in proportion to each request's images
            self._begin_times.setdefault(request_ids[i], {})["caption"] = spent * len(feats[i]) / n_img
        return out

    def _prefill(self, rows: list[tuple[str, list[int], torch.Tensor | None]]) -> tuple[torch.Tensor, list[int]]:
        """Prefill every new row's context, rows of similar length in one forward each (``length_groups``: a text
        member's few tokens are not padded to the image member's hundreds), each group joined to the cache in turn
        -> each row's logits after its context [B, V] fp32 in ``rows`` order (an empty context's row is
        meaningless), and the order the rows joined the cache."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        order: list[int] = []
        for group in length_groups([len(t) for _, t, _ in rows]):
            for i, row_logits in zip(group, self._prefill_group([rows[i] for i in group])):
                out[i] = row_logits
            order += group
        return torch.stack(out), order

    def _prefill_group(self, rows: list[tuple[str, list[int], torch.Tensor | None]]) -> torch.Tensor:
        """One forward over these rows' contexts, right-padded (input embeddings: the projector's output at image
        tokens), joined to the cache -> each row's logits after its context [B, V] fp32."""
        b, seq = len(rows), max([len(t) for _, t, _ in rows] + [1])  # an empty prompt gets one invalid slot
        tokens = torch.zeros(b, seq, dtype=torch.long)  # [B, L]
        for i, (_, t, _) in enumerate(rows):
            tokens[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        lengths = torch.tensor([len(t) for _, t, _ in rows])  # [B]
        valid = torch.arange(seq)[None, :] < lengths[:, None]  # [B, L] bool
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]  # [B, L, L]
        pos = torch.arange(seq).expand(b, seq)  # [B, L]
        tokens = tokens.to(self.device)
        if self.massv is not None:
            embeds = self.massv.embed(tokens, [v for _, _, v in rows])  # [B, L, H]
        else:
            embeds = self._body.get_input_embeddings()(tokens)
        cache = self._kv.new_cache()
        if self._lean:  # the same math without HF's per-call overhead (drafters/lean_llama.py)
            hidden = lean_llama.model_forward(self._body, allowed[:, None].to(self.device), pos.to(self.device), cache,
                                              inputs_embeds=embeds, int8=self._int8)  # [B, L, H]
        else:
            hidden = self._body(inputs_embeds=embeds, position_ids=pos.to(self.device), past_key_values=cache,
                                use_cache=True, attention_mask=attention_mask(allowed[:, None].to(self.device),
                                                                              self._attn, self.dtype)).last_hidden_state
        self._kv.join(cache, valid.to(self.device))
        last = hidden[torch.arange(b), (lengths - 1).clamp_min(0).to(self.device)]  # [B, H]
        return self._head(last).float()  # [B, V]

    def _children(self, logits, k: int, temps, greedy, gens):
        """``text_lm``'s children, drawn from each request's mixture (module docstring).

        logits [Bc, W, V] fp32 over the call's member rows (request by request) -> tokens [Bc, W, k] (-1 where no
        mass is left) and the mixture each was drawn from [Bc, W, V] (None if every row is greedy); rows of one
        request get the same tokens and the same mixture.
        """
        groups = self._call_groups
        if all(n == 1 for _, n, _ in groups):  # one row per request (massv, text-only requests): q = q_1, no mixing
            return super()._children(logits, k, temps, greedy, gens)
        logits = logits.clone()
        logits[..., self.image_token_id] = float("-inf")
        probs = torch.softmax(logits / temps[:, None, None], dim=-1)  # [Bc, W, V] q_m (T = 1 for greedy rows)
        mixed = torch.stack([mix_distributions(probs[s:s + n], w) for s, n, w in groups])  # [B, W, V]
        first = [s for s, _, _ in groups]
        g_greedy = greedy[first]  # [B] bool
        top = mixed.topk(k, dim=-1).indices  # [B, W, k]
        if bool(g_greedy.all()):
            kids, q = top, None
        else:
            drawn = sample_without_replacement(mixed, k, [gens[s] for s in first])  # [B, W, k]
            kids, q = torch.where(g_greedy.to(mixed.device)[:, None, None], top, drawn), mixed
        owner = torch.tensor([i for i, (_, n, _) in enumerate(groups) for _ in range(n)],
                             device=mixed.device)  # [Bc] request of each row
        return kids[owner], (q[owner] if q is not None else None)


def _if_captioned(feats: list, members: list[Sequence[Member]]) -> list:
    """Each request's image features where its members include a caption member, else None (no caption made)."""
    return [f if any(m.kind == "caption" for m in ms) else None for f, ms in zip(feats, members)]


def _image_key(features: torch.Tensor) -> bytes:
    """The cache key of one image: sha256 of its features' bytes ([T, D]) with their shape and dtype."""
    f = features.detach().contiguous().cpu()
    h = hashlib.sha256(f"{tuple(f.shape)}{f.dtype}".encode())
    h.update(f.view(torch.uint8).numpy().tobytes() if f.numel() else b"")
    return h.digest()


def _load(path, dtype, attn_implementation) -> nn.Module:
    """A MassvModel from a massv directory, else a plain LlamaForCausalLM (text-only members)."""
    from specula.drafters.text_lm import _load as load_lm
    from specula.zoo.store import resolve

    d = resolve(path)
    if (d / CONFIG_FILE).exists():
        return MassvModel.load(d, dtype, attn_implementation)
    model, info = load_lm(d, dtype, attn_implementation)
    model.specula_info = info  # image_token_id of a text_lm export
    return model

