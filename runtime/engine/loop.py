"""The speculative decoding loop, single process, batched: the one implementation every runtime calls.

    prefill -> repeat { drafter proposes a block (chain or tree) -> target verifies -> sampler decides
                        -> target commits -> drafter observes the verdict } until EOS, max_tokens or a stop string

Rows join between steps (``add``) and leave when they finish or are cancelled (continuous batching). With no
drafter (or gamma 0) the same loop is plain target decoding, which is the reference speculative output must equal.
Host syncs per step: the accept decision (accepted counts and next tokens) comes to the host once per block.

    engine = SpecEngine(target, drafter=create({"kind": "ngram"}), gamma=5, eos_token_ids=(2,))
    results = engine.generate([GenerationRequest("r1", input_ids, pixel_values, SamplingParams(seed=0))])
    results["r1"].tokens
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specula.drafters.protocol import PREFILL_FREE, DraftContext, Proposal, Verdict
from specula.runtime.engine.metrics import RequestMetrics
from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import SamplingParams, logits_to_probs, sample_next
from specula.runtime.core.tree_rejection import verify_tree
from specula.targets.types import Accept, DraftBlock, PrefillRequest, VisualFeatures


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    input_ids: torch.Tensor  # [L] int64, image tokens already expanded by the processor
    pixel_values: torch.Tensor | None = None  # [N_img, 3, S, S] (LLaVA) / flattened patches (Qwen2.5-VL)
    params: SamplingParams = field(default_factory=SamplingParams)
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] Qwen2.5-VL only
    # precomputed projected visual embeddings ([N_img, T_img, H] or VisualFeatures, e.g. from a VisionEncoder);
    # when given, the target consumes these and pixel_values only feed a drafter that needs "pixels"
    visual: torch.Tensor | VisualFeatures | None = None
    # the drafter this request chose by name (DraftContext.drafter: a MultiDrafter routes on it); None = the default
    drafter: str | None = None
    # False: its caller wants the whole answer only (not streamed, no stop string to watch), so the served verifier
    # sends the first token's chunk and the last one, none between (VerifierEngine.astream); output is the same
    streamed: bool = True


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request gained in one step (streaming unit)."""

    request_id: str
    tokens: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "length" | "stop" | "cancelled"


@dataclass
class GenerationResult:
    request_id: str
    tokens: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    text: str | None = None


@dataclass
class _Row:
    req: GenerationRequest
    generator: torch.Generator
    tokens: list[int]
    metrics: RequestMetrics
    text: str = ""
    finish_reason: str | None = None


class SpecEngine:
    """Batched speculative decoding over a Target and (optionally) a Drafter.

    Args:
        target: a ``specula.targets.Target``.
        drafter: a ``specula.drafters.Drafter`` or None for plain decoding.
        gamma: draft tokens per block for chain drafters (tree drafters get the same budget: nodes per block).
        eos_token_ids: generation ends after any of these (default: the target's).
        decode: ids -> text, needed for stop strings and returned text.
        siblings: how a tree drafter drew sibling candidates ("without_replacement" or "independent").
        adaptive: choose each step's draft length in 0 .. gamma by expected goodput (``adaptive.GoodputPolicy``:
            fewer drafts for rows that keep rejecting them and as the batch grows, none when plain steps pay more);
            only what is drafted changes, never the output.
        begin_after: a row's drafter begins once the row has this many tokens (0 or 1: right after the prefill);
            until then the row decodes plainly and its verdicts are kept, then replayed to the drafter after its
            ``begin``, so it ends up where an eager begin would have left it. Answers shorter than this never pay
            the drafter's begin (its prompt prefill) or a block. Not for a drafter that begins before the prefill
            (``prepare``: the data plane's RemoteDrafter), which always begins at once. Lossless either way.
    """

    def __init__(self, target, drafter=None, gamma: int = 5, eos_token_ids: Sequence[int] | None = None,
                 decode: Callable[[list[int]], str] | None = None, siblings: str = "without_replacement",
                 adaptive: bool = False, begin_after: int = 0):
        if gamma < 0:
            raise ValueError(f"gamma must be >= 0, got {gamma}")
        if begin_after < 0:
            raise ValueError(f"begin_after must be >= 0, got {begin_after}")
        self.target, self.drafter, self.gamma = target, drafter, gamma
        lazy = drafter is not None and gamma > 0 and begin_after > 1 and not hasattr(drafter, "prepare")
        self.begin_after = begin_after if lazy else 0
        # rows whose drafter has not begun: their DraftContext and the verdicts of their plain steps so far
        self._unbegun: dict[str, tuple[DraftContext, list[Verdict]]] = {}
        self.policy = None
        if adaptive and drafter is not None and gamma > 0:
            from specula.runtime.engine.adaptive import GoodputPolicy

            self.policy = GoodputPolicy(gamma, tree=drafter.spec.structure == "tree")
        self.eos = frozenset(eos_token_ids if eos_token_ids is not None else target.info.eos_token_ids)
        self.decode, self.siblings = decode, siblings
        self.rows: dict[str, _Row] = {}
        self._cancelled: set[str] = set()
        self._pending_events: list[TokenEvent] = []
        self.finished: dict[str, GenerationResult] = {}

    # ------------------------------------------------------------------------------------------- admission

    def add(self, requests: Sequence[GenerationRequest]) -> list[TokenEvent]:
        """Prefill new requests and emit their first token; they join the live batch."""
        if not requests:
            return []
        for r in requests:
            if r.request_id in self.rows:
                raise ValueError(f"request id {r.request_id!r} is already live")
            if r.params.stop and self.decode is None:
                raise ValueError("stop strings need a decode function (SpecEngine(decode=...))")
        tv = time.perf_counter()
        requests = self._encode_once(requests)
        tp = time.perf_counter()
        if self.drafter is not None and self.gamma > 0 and hasattr(self.drafter, "prepare"):
            early = [c for r in requests if (c := self._early_context(r)) is not None]
            if early:  # a drafter that can start before the prefill (RemoteDrafter: an early Begin)
                self.drafter.prepare(early, self.gamma)
        t0 = time.perf_counter()
        out = self.target.prefill([PrefillRequest(r.request_id, r.input_ids,
                                                  r.pixel_values if r.visual is None else None,
                                                  r.image_grid_thw, r.visual) for r in requests])
        t1 = time.perf_counter()
        params = [r.params for r in requests]
        gens = [r.params.make_generator() for r in requests]
        first = sample_next(out.logits, params, gens).tolist()  # [B]
        self.target.commit([Accept(r.request_id, (), t) for r, t in zip(requests, first)])
        t2 = time.perf_counter()
        events = []
        for b, (r, g, tok) in enumerate(zip(requests, gens, first)):
            m = RequestMetrics()
            m.time["prefill"] += (t1 - t0 + tp - tv) / len(requests)  # the vision tower run for both, if any
            m.time["sample"] += (t2 - t1) / len(requests)
            m.time["draft_begin"] += (t0 - tp) / len(requests)  # early Begins (prepare), if any
            self.rows[r.request_id] = _Row(r, g, [], m)
        if self.drafter is not None:
            t3 = time.perf_counter()
            contexts = [self._context(r, tok, out, b) for b, (r, tok) in enumerate(zip(requests, first))]
            if self.begin_after:  # begun later (_begin_due), by then the row's answer is known to run on
                for c in contexts:
                    self._unbegun[c.request_id] = (_own(c), [])
                share = (time.perf_counter() - t3) / len(requests)
                for r in requests:
                    self.rows[r.request_id].metrics.time["draft"] += share
            else:
                self._begin(contexts, t3)
        for r, tok in zip(requests, first):
            ev = self._emit(self.rows[r.request_id], [tok])
            events.append(ev)
        self._retire([e for e in events if e.finished])
        return events

    def _begin(self, contexts: list[DraftContext], t0: float) -> None:
        """``drafter.begin`` for these rows, its time booked to them (from ``t0``)."""
        self.drafter.begin(contexts)
        # drafter-side parts of begin it timed itself (e.g. captioning) are booked apart from "draft_begin"
        side = self.drafter.pop_begin_times() if hasattr(self.drafter, "pop_begin_times") else {}
        rest = (time.perf_counter() - t0 - sum(v for p in side.values() for v in p.values())) / len(contexts)
        for c in contexts:
            m = self.rows[c.request_id].metrics
            m.time["draft_begin"] += rest
            for k, v in side.get(c.request_id, {}).items():
                m.time[k] += v

    def _begin_due(self, ids: list[str]) -> None:
        """Begin the drafter for rows that reached ``begin_after`` tokens, and replay their plain steps' verdicts
        to it, step by step, as it would have observed them."""
        due = [rid for rid in ids if rid in self._unbegun and len(self.rows[rid].tokens) >= self.begin_after]
        if not due:
            return
        t0 = time.perf_counter()
        held = [self._unbegun.pop(rid) for rid in due]
        self._begin([c for c, _ in held], t0)
        t1 = time.perf_counter()
        for i in range(max(len(v) for _, v in held)):
            self.drafter.observe([v[i] for _, v in held if len(v) > i])
        share = (time.perf_counter() - t1) / len(due)
        for rid in due:
            self.rows[rid].metrics.time["draft"] += share

    def _propose(self, ids: list[str], drafting: list[str], gamma: int):
        """The drafter's proposal for ``drafting`` (``ids`` less the rows not begun), widened to every row of the
        step: a row not begun gets count 0 (a plain step for it), its padding a one-hot q on token 0."""
        prop = self.drafter.propose(drafting, gamma)
        if len(drafting) == len(ids):
            return prop
        pos = {rid: i for i, rid in enumerate(prop.request_ids)}
        b, n = len(ids), prop.tokens.shape[1]
        idx = torch.tensor([j for j, rid in enumerate(ids) if rid in pos], device=prop.tokens.device)
        tokens = prop.tokens.new_zeros((b, n)).index_copy_(0, idx, prop.tokens)  # [B, N]
        q = parents = None
        if prop.q is not None:
            q = prop.q.new_zeros((b, n, prop.q.shape[-1]))  # [B, N, V]
            q[:, :, 0] = 1.0
            q.index_copy_(0, idx.to(q.device), prop.q)
        if prop.parents is not None:  # a valid chain for the rows not drafted
            parents = (torch.arange(n, device=prop.parents.device) - 1).repeat(b, 1)  # [B, N]
            parents.index_copy_(0, idx.to(parents.device), prop.parents)
        counts = tuple(prop.counts[pos[rid]] if rid in pos else 0 for rid in ids)
        return Proposal(tuple(ids), tokens, counts, parents, q)

    def _context(self, r: GenerationRequest, first: int, out, b: int) -> DraftContext:
        needs = self.drafter.spec.needs
        n = out.features.lengths[b]
        hidden = out.features.hidden[b, :n] if "hidden" in needs else None  # [L, H]
        extra = {}
        if "last_kv" in needs:
            extra["last_k"] = out.features.last_k[b, :, :n]  # [H_kv, L, D]
            extra["last_v"] = out.features.last_v[b, :, :n]
        visual = None
        if "visual" in needs and r.visual is not None:
            visual = r.visual.features if isinstance(r.visual, VisualFeatures) else r.visual
        elif "visual" in needs and r.pixel_values is not None:
            visual = self.target.encode_images(r.pixel_values, "projected").features
        pre = r.visual.pre_projector if isinstance(r.visual, VisualFeatures) else None
        if "pre_projector" in needs and pre is not None:  # [N_img, T_img, D_vis] from the vision stage
            extra["pre_projector"] = pre
        elif "pre_projector" in needs and r.pixel_values is not None:  # computed here, for a drafter's projector
            extra["pre_projector"] = self.target.encode_images(r.pixel_values, "pre_projector",
                                                               image_grid_thw=r.image_grid_thw).features
        return DraftContext(r.request_id, r.input_ids, first, r.params.temperature, r.params.seed,
                            pixel_values=r.pixel_values if "pixels" in needs else None, visual=visual,
                            hidden=hidden, extra=extra, drafter=r.drafter)

    def _encode_once(self, requests: Sequence[GenerationRequest]) -> list[GenerationRequest]:
        """When the drafter needs visual features ("visual", "pre_projector"), encode the images of the requests
        that bring pixels here, in one vision-tower pass over the batch (as the prefill would), and hand the result
        to the prefill and the drafter alike: otherwise the drafter's features cost a second tower pass. The
        prefill then consumes the same projected features it would have computed itself. Input the target would
        refuse is left as it is, for the prefill's own error."""
        needs = set(self.drafter.spec.needs) if self.drafter is not None and self.gamma > 0 else set()
        todo = [i for i, r in enumerate(requests) if r.pixel_values is not None and r.visual is None]
        if not todo or not needs & {"visual", "pre_projector"}:
            return list(requests)
        grids = [requests[i].image_grid_thw for i in todo]
        if any(g is None for g in grids) and any(g is not None for g in grids):
            return list(requests)
        variants = ("projected", "pre_projector") if "pre_projector" in needs else ("projected",)
        try:
            grid = None if grids[0] is None else torch.cat([torch.as_tensor(g).to(torch.long) for g in grids])
            counts = [int(requests[i].pixel_values.shape[0]) if g is None else int(g.shape[0])
                      for i, g in zip(todo, grids)]
            outs = self.target.encode_image_variants(torch.cat([requests[i].pixel_values for i in todo]), variants,
                                                     image_grid_thw=grid)
        except (ValueError, RuntimeError, TypeError):
            return list(requests)
        proj, pre = outs[0], (outs[1] if len(outs) > 1 else None)
        if sum(counts) != proj.num_images:
            return list(requests)
        out, a = list(requests), 0
        for i, n in zip(todo, counts):
            b = a + n
            t = max(proj.lengths[a:b])  # padded to this request's longest image, as encoding it alone would be
            vf = VisualFeatures("projected", proj.features[a:b, :t], proj.lengths[a:b], proj.grid_hw[a:b],
                                None if grid is None else grid[a:b], None if pre is None else pre.features[a:b, :t])
            out[i] = dataclasses.replace(requests[i], visual=vf)
            a = b
        return out

    def _early_context(self, r: GenerationRequest) -> DraftContext | None:
        """The request's DraftContext before the prefill (first_token -1), when its drafter needs nothing the
        prefill makes: no hidden states or KV, and visual features only if the request brings them."""
        needs = self.drafter.spec.needs
        if set(needs) - PREFILL_FREE:
            return None
        visual = None
        if "visual" in needs:
            if r.visual is None:
                return None
            visual = r.visual.features if isinstance(r.visual, VisualFeatures) else r.visual
        return DraftContext(r.request_id, r.input_ids, -1, r.params.temperature, r.params.seed,
                            pixel_values=r.pixel_values if "pixels" in needs else None, visual=visual,
                            drafter=r.drafter)

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drop rows after a failure (no result, no event): free their target and drafter state if held.

        For a driver that caught an exception from ``add`` or ``step``; the rows' callers get the error instead.
        """
        ids = list(dict.fromkeys(request_ids))
        held = set(self.target.live_ids)
        self.target.release([r for r in ids if r in held])
        if self.drafter is not None:
            # rows the drafter holds; one that can begin before the prefill (prepare) may hold rows add never made
            early = hasattr(self.drafter, "prepare")
            self.drafter.release([r for r in ids if (r in self.rows or early) and self._unbegun.pop(r, None) is None])
        if self.policy is not None:
            self.policy.release(ids)
        for rid in ids:
            self.rows.pop(rid, None)
            self._cancelled.discard(rid)

    def cancel(self, request_id: str) -> None:
        """Stop a request at the next step boundary; its KV cache and drafter state are freed."""
        if request_id in self.rows:
            self._cancelled.add(request_id)

    # ------------------------------------------------------------------------------------------- stepping

    def step(self) -> list[TokenEvent]:
        """One block for every live row; returns the tokens each row gained."""
        events = self._drain_cancelled()
        ids = [rid for rid in self.rows]
        if not ids:
            return events
        rows = [self.rows[r] for r in ids]
        params = [row.req.params for row in rows]
        budget = [row.req.params.max_tokens - len(row.tokens) for row in rows]  # >= 1 for live rows
        gamma = self.gamma if self.drafter is not None else 0
        drafting = ids
        if gamma > 0 and self._unbegun:
            self._begin_due(ids)
            drafting = [rid for rid in ids if rid not in self._unbegun]
            gamma = gamma if drafting else 0
        if gamma > 0 and self.policy is not None:
            gamma = self.policy.choose(drafting, len(ids))  # 0: a plain step, the drafter only observes
        t0 = time.perf_counter()
        prop = self._propose(ids, drafting, gamma) if gamma > 0 else None
        t1 = time.perf_counter()
        if prop is None or max(prop.counts, default=0) == 0:
            verdicts, out, t2, t3 = self._plain_step(ids, params, rows)
        else:
            verdicts, out, t2, t3 = self._spec_step(ids, params, rows, prop, budget)
        t4 = time.perf_counter()
        if self.drafter is not None:
            records = [self._verdict_record(v, out, b) for b, v in enumerate(verdicts)]
            for rec in records:
                if rec.request_id in self._unbegun:  # replayed when its drafter begins
                    self._unbegun[rec.request_id][1].append(rec)
            records = [rec for rec in records if rec.request_id not in self._unbegun]
            if records:
                self.drafter.observe(records)
        t5 = time.perf_counter()
        if self.policy is not None:
            # the step's whole cost past the proposal (forward, sampling, commit, the drafter observing) is the
            # verify side: it is what a plain step costs too, so the choice weighs whole steps
            self.policy.record_step(ids, gamma, t1 - t0, t5 - t1, [v[5] for v in verdicts],
                                    [len(v[1]) for v in verdicts], width=max(v[4] for v in verdicts),
                                    drafting=len(drafting) if gamma > 0 else 0)
        share = 1.0 / len(ids)
        for row, (rid, path, toks, nxt, n_draft, depth) in zip(rows, verdicts):
            m = row.metrics
            m.time["draft"] += (t1 - t0 + t5 - t4) * share
            m.time["verify"] += (t2 - t1) * share
            m.time["sample"] += (t3 - t2) * share
            m.time["commit"] += (t4 - t3) * share
            event = self._emit(row, list(toks) + [nxt])
            # drafts accepted past EOS / max_tokens / a stop are never emitted: they do not count as accepted
            m.record_block(n_draft, min(len(path), len(event.tokens)), depth)
            events.append(event)
        self._retire([e for e in events if e.finished])
        return events

    def _plain_step(self, ids, params, rows):
        out = self.target.decode_step(ids)
        t2 = time.perf_counter()
        nxt = sample_next(out.logits[:, 0], params, [r.generator for r in rows]).tolist()  # [B]
        t3 = time.perf_counter()
        self.target.commit([Accept(rid, (), t) for rid, t in zip(ids, nxt)])
        return [(rid, (), (), t, 0, 0) for rid, t in zip(ids, nxt)], out, t2, t3

    def _spec_step(self, ids, params, rows, prop, budget):
        if prop.request_ids != tuple(ids):
            raise ValueError(f"drafter proposed for {prop.request_ids}, asked for {tuple(ids)}")
        # never draft past max_tokens: a row emits at most (drafts + 1) tokens per block
        counts = [max(0, min(c, b - 1)) for c, b in zip(prop.counts, budget)]
        width = max(max(counts), 1)
        tokens = prop.tokens[:, :width]  # [B, N]
        q = prop.q[:, :width] if prop.q is not None else None  # [B, N, V]
        # parents precede children, so keeping a tree's first nodes keeps a valid tree
        parents = prop.parents[:, :width] if prop.parents is not None else None
        out = self.target.verify(DraftBlock(tuple(ids), tokens, parents, tuple(counts)))
        t2 = time.perf_counter()
        p = logits_to_probs(out.logits, params)  # [B, N + 1, V]
        greedy = [pp.is_greedy for pp in params]
        gens = [r.generator for r in rows]
        if parents is None:
            v = verify_chain(tokens, q, p, num_draft=counts, generators=gens, greedy=greedy)
            accepted, nxt = v.accepted.tolist(), v.next_token.tolist()
            paths = [tuple(range(a)) for a in accepted]
        else:
            v = verify_tree(parents, tokens, q, p, counts=counts, generators=gens, greedy=greedy,
                            siblings=self.siblings)
            paths, nxt = v.paths(), v.next_token.tolist()
        t3 = time.perf_counter()
        self.target.commit([Accept(rid, path, t) for rid, path, t in zip(ids, paths, nxt)])
        tok_rows = tokens.tolist()
        depths = counts if parents is None else [_depth(parents[b].tolist()[: c]) for b, c in enumerate(counts)]
        verdicts = [(rid, path, tuple(tok_rows[b][i] for i in path), nxt[b], counts[b], depths[b])
                    for b, (rid, path) in enumerate(zip(ids, paths))]
        return verdicts, out, t2, t3

    def _verdict_record(self, v, out, b: int) -> Verdict:
        rid, path, toks, nxt = v[:4]
        hidden = None
        if self.drafter is not None and "hidden" in self.drafter.spec.needs:
            idx = torch.tensor([0] + [1 + i for i in path], device=out.features.hidden.device)
            hidden = out.features.hidden[b].index_select(0, idx)  # [1 + k, H]
        extra = {}
        if self.drafter is not None and "last_kv" in self.drafter.spec.needs:
            idx = torch.tensor([0] + [1 + i for i in path], device=out.features.last_k.device)
            extra["last_k"] = out.features.last_k[b].index_select(1, idx)  # [H_kv, 1 + k, D]
            extra["last_v"] = out.features.last_v[b].index_select(1, idx)
        return Verdict(rid, tuple(path), tuple(toks), int(nxt), hidden, extra)

    # ------------------------------------------------------------------------------------------- output

    def _emit(self, row: _Row, new: list[int]) -> TokenEvent:
        """Append tokens, cutting at EOS, max_tokens or a stop string; mark the row finished if so."""
        p = row.req.params
        kept, reason = [], None
        for t in new:
            kept.append(t)
            if t in self.eos:
                reason = "eos"
                break
            if len(row.tokens) + len(kept) >= p.max_tokens:
                reason = "length"
                break
        row.tokens.extend(kept)
        if p.stop and self.decode is not None:
            text = self.decode(row.tokens)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                row.text = text[: min(hits)]
                reason = "stop"
        row.metrics.emitted += len(kept)
        row.finish_reason = reason
        return TokenEvent(row.req.request_id, tuple(kept), reason is not None, reason)

    def _retire(self, finished: list[TokenEvent]) -> None:
        ids = [e.request_id for e in finished if e.request_id in self.rows]
        if not ids:
            return
        self.target.release(ids)
        if self.drafter is not None:
            begun = [rid for rid in ids if self._unbegun.pop(rid, None) is None]
            if begun:
                self.drafter.release(begun)
        if self.policy is not None:
            self.policy.release(ids)
        for rid in ids:
            row = self.rows.pop(rid)
            text = row.text if row.finish_reason == "stop" else (self.decode(row.tokens) if self.decode else None)
            self.finished[rid] = GenerationResult(rid, row.tokens, row.finish_reason, row.metrics, text)
            self._cancelled.discard(rid)

    def _drain_cancelled(self) -> list[TokenEvent]:
        events = []
        for rid in list(self._cancelled):
            if rid in self.rows:
                self.rows[rid].finish_reason = "cancelled"
                events.append(TokenEvent(rid, (), True, "cancelled"))
        self._retire(events)
        self._cancelled.clear()
        return events

    # ------------------------------------------------------------------------------------------- drivers

    def stream(self, requests: Sequence[GenerationRequest]) -> Iterator[TokenEvent]:
        """Run requests to completion, yielding tokens as they are accepted."""
        yield from self.add(requests)
        while self.rows:
            yield from self.step()

    def generate(self, requests: Sequence[GenerationRequest]) -> dict[str, GenerationResult]:
        """Run requests to completion (batched) and return the results by request id."""
        for _ in self.stream(requests):
            pass
        return {r.request_id: self.finished.pop(r.request_id) for r in requests}



def _own(c: DraftContext) -> DraftContext:
    """``c`` with its tensors copied out of the batch's prefill outputs (held until the row's drafter begins, they
    must not keep the whole batch's features alive)."""
    hidden = c.hidden.clone() if c.hidden is not None else None
    extra = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.extra.items()}
    return dataclasses.replace(c, hidden=hidden, extra=extra)


def _depth(parents: list[int]) -> int:
    """Depth of a tree given parents-first ``parents`` (-1 = root level)."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return max(d, default=0)
