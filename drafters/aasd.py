"""``aasd``: AASD (Yang et al.), a one-layer drafter that attends the target's own last-layer KV cache.

The draft model (``drafters/aasd_head.py``) reads no hidden state: its context is the target's last-layer keys and
values of every committed position (text as is, each image compressed to k entries by the learned KV projector),
and its own keys/values for the chain it is drafting (eq. 4-5). Chain drafting, gamma forwards of one token:

    pending x_s (position s)   attends [K_ctx ; k'_s]                        -> q_1 -> d_1
    d_1 (position s + 1)       attends [K_ctx ; k'_s, k'_{s+1}]              -> q_2 -> d_2     ...

d_j is drawn from q_j = softmax(lm_head(h^) / T) at the request's temperature (T = 0: the argmax, q one-hot, ``q=None``
when every row is greedy), with the row's own generator: ``Proposal.q`` is exactly the law each token was drawn from.

Cache (one ``targets.kv.BatchedKV`` over a one-layer ``growable_cache``, keys post-RoPE, positions per row):

- ``begin``: the prompt's context from ``DraftContext.extra["last_k"/"last_v"]`` [H_kv, L, D] (valid slots); the
  first token is pending at position L.
- ``propose``: gamma one-token forwards; the draft's own columns are never valid (each query names its chain's
  columns explicitly), as ``eagle``'s.
- ``observe``: the verdict's target K/V at the pending token and the accepted drafts (``Verdict.extra``, [H_kv,
  1 + k, D]) are appended as valid slots, so the context is always exactly the target's cache of the committed
  sequence (images compressed); ``next_token`` becomes pending. ``BatchedKV.maybe_compact`` drops the holes,
  whether or not proposals are outstanding: a draft's columns are dead once its chain is drawn.

``spec.needs`` = {"last_kv"}. Chains only (``structure="tree"`` is refused), as in the paper. Positions are sequence
indices: exact for LLaVA; a Qwen2.5-VL target (mrope, compressed image positions) would see its text keys at
shifted relative distances (still lossless, only less accurate).

    drafter = create({"kind": "aasd", "path": "aasd"}, target=target)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specula.drafters import lean_llama, stopping
from specula.drafters.aasd_head import AasdHead, context_kv
from specula.drafters.eagle import _int
from specula.drafters.protocol import DraftContext, DrafterSpec, Proposal, Verdict
from specula.drafters.registration import register
from specula.drafters.seeding import request_generator
from specula.runtime.core.sampling import sample  # pure torch, no Ray/gRPC
from specula.targets.kv import BatchedKV, KVPolicy, attention_mask, growable_cache


@dataclass
class _Row:
    pending: int  # committed token not yet in the context (its target K/V come with the next verdict)
    next_pos: int  # position of the pending token
    temperature: float
    generator: torch.Generator
    draft: list[int] | None = None  # outstanding chain


@register("aasd")
class AasdDrafter:
    """Options: ``path`` (zoo name or directory, default "aasd") or ``head`` (an ``AasdHead``); ``structure``
    "chain" only; ``seed``; ``device`` / ``dtype`` of the head (default: the target's device, float32);
    ``kv_policy``; ``stop_token_ids`` (default: the target's EOS ids; ``[]`` = never stop: ``drafters/stopping.py``);
    ``quantize`` "auto" (default: int8 weights for the head's decoder layer and the target's lm_head it reads,
    through a copy of its own, on a CPU), "int8" or "none" (``drafters/int8_weights.py``; changes what is drafted,
    never the output).
    Resources: ``target`` (its embedding and lm_head are shared), ``tokenizer`` (unused)."""

    KIND = "aasd"

    def __init__(self, path: str | Path | None = None, head: AasdHead | None = None, structure: str = "chain",
                 seed: int = 0, device: str | None = None, dtype: str | None = None,
                 kv_policy: KVPolicy | None = None, stop_token_ids: Sequence[int] | None = None, quantize: str = "auto",
                 target=None, tokenizer=None, **unknown):
        if unknown:
            raise ValueError(f"aasd: unknown options {sorted(unknown)}")
        if structure != "chain":
            raise ValueError(f"aasd: structure must be 'chain' (the paper drafts chains), got {structure!r}")
        self.seed = _int("aasd", "seed", seed, 0)
        if dtype is not None and not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"aasd: unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16'")
        dt = getattr(torch, str(dtype)) if dtype is not None else None
        if head is None:
            head = AasdHead.load("aasd" if path is None else path, target, device=device, dtype=dt)
        else:
            if not isinstance(head, AasdHead):
                raise ValueError(f"aasd: head must be an AasdHead, got {type(head).__name__}")
            if dt is not None or device is not None:
                head.to(device=device, dtype=dt)
            if target is not None:
                model = target.model
                emb = model.get_input_embeddings()
                head.attach(emb, model.get_output_embeddings(), copy=head.norm.weight.device != emb.weight.device)
            if not head.attached:
                raise ValueError("aasd: give a target (its embedding and lm_head) or an attached head")
        self.head = head.eval()
        cfg = head.config
        if target is not None:
            info = target.info
            if (info.vocab_size, info.hidden_size, info.num_kv_heads, info.head_dim) != (
                    cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim):
                raise ValueError(f"aasd: head (V={cfg.vocab_size}, H={cfg.hidden_size}, H_kv={cfg.num_key_value_heads}"
                                 f", D={cfg.head_dim}) does not fit the target (V={info.vocab_size}, "
                                 f"H={info.hidden_size}, H_kv={info.num_kv_heads}, D={info.head_dim})")
        self.vocab_size = cfg.vocab_size
        self.image_token_id = cfg.image_token_id
        self.stop_ids = stopping.stop_ids("aasd", stop_token_ids, target)  # [n_stop]
        self.spec = DrafterSpec(kind="aasd", structure="chain", needs=frozenset({"last_kv"}))
        p = head.norm.weight
        self.device, self.dtype = p.device, p.dtype
        self.stop_ids = self.stop_ids.to(self.device)  # compared with drafted tokens on the head's device
        self._int8 = lean_llama.int8_drafting(quantize, self.device, [head.layer], "aasd")
        self._attn = head.llama_config._attn_implementation
        lc = head.llama_config
        self._kv = BatchedKV(lambda: growable_cache(lc), kv_policy or KVPolicy())  # appends in place, no O(S) copy
        self._rows: dict[str, _Row] = {}  # insertion order == row order of self._kv
        self._seeder = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------------------------ protocol

    @torch.no_grad()
    def begin(self, contexts: Sequence[DraftContext]) -> None:
        """The prompts' target K/V (images compressed) become each row's context; the first token is pending."""
        contexts = list(contexts)
        if not contexts:
            return
        ids = [c.request_id for c in contexts]
        if len(set(ids)) != len(ids) or any(i in self._rows for i in ids):
            raise ValueError(f"aasd.begin: request ids must be new and unique, got {ids}")
        cfg = self.head.config
        shape = (cfg.num_key_value_heads, None, cfg.head_dim)
        ctx = []
        for c in contexts:  # check them all before changing anything
            n = int(c.prompt_ids.shape[0])
            k, v = c.extra.get("last_k"), c.extra.get("last_v")
            if k is None or v is None or tuple(k.shape) != (shape[0], n, shape[2]) or v.shape != k.shape:
                got = None if k is None or v is None else (tuple(k.shape), tuple(v.shape))
                raise ValueError(f"aasd.begin: {c.request_id!r} needs extra last_k / last_v [H_kv={shape[0]}, L={n}, "
                                 f"D={shape[2]}] (the target's last-layer cache of the prompt), got {got}")
            if not float(c.temperature) >= 0:
                raise ValueError(f"aasd.begin: request {c.request_id!r} has temperature {c.temperature!r}")
            ctx.append(context_kv(self.head, c.prompt_ids, k.to(self.device, self.dtype),
                                  v.to(self.device, self.dtype)))
        b, s = len(ctx), max(k.shape[1] for k, _, _ in ctx)
        kk = torch.zeros(b, shape[0], s, shape[2], dtype=self.dtype, device=self.device)  # [B, H_kv, S, D]
        vv = torch.zeros_like(kk)
        valid = torch.zeros(b, s, dtype=torch.bool, device=self.device)  # [B, S]
        for i, (k, v, _) in enumerate(ctx):
            kk[i, :, : k.shape[1]], vv[i, :, : k.shape[1]], valid[i, : k.shape[1]] = k, v, True
        cache = self._kv.new_cache()
        cache.update(kk, vv, 0)
        self._kv.join(cache, valid)
        for c in contexts:
            self._rows[c.request_id] = _Row(int(c.first_token), int(c.prompt_ids.shape[0]), float(c.temperature),
                                            self._generator(c))

    @torch.no_grad()
    def propose(self, request_ids: Sequence[str], gamma: int) -> Proposal:
        ids = tuple(request_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"aasd.propose: duplicate request ids {list(ids)}")
        rows = [self._row(r) for r in ids]
        if any(r.draft is not None for r in rows):
            raise ValueError("aasd.propose: a row's previous proposal was not observed")
        bc = len(ids)
        if gamma < 1 or not bc:
            return Proposal(ids, torch.zeros(bc, 1, dtype=torch.long), (0,) * bc)
        dev, b = self.device, self._kv.batch_size
        index = {rid: i for i, rid in enumerate(self._rows)}
        sel = torch.tensor([index[r] for r in ids], dtype=torch.long, device=dev)  # [Bc] cache rows
        greedy = torch.tensor([r.temperature == 0 for r in rows], device=dev)  # [Bc]
        temps = torch.tensor([r.temperature or 1.0 for r in rows], device=dev)[:, None]  # [Bc, 1]
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
        draft_start = self._kv.seq_len
        tok = torch.tensor([r.pending for r in rows], dtype=torch.long, device=dev)  # [Bc] the token fed next
        pos0 = torch.tensor([r.next_pos for r in rows], device=dev)  # [Bc]
        toks, qs = [], []
        for j in range(gamma):
            t = torch.zeros(b, 1, dtype=torch.long, device=dev)
            p = torch.zeros(b, 1, dtype=torch.long, device=dev)
            t[sel, 0], p[sel, 0] = tok, pos0 + j
            s = self._kv.seq_len
            cached = self._kv.valid[:, None, :].clone()  # [B, 1, S]
            cached[sel, :, draft_start:] = True  # the chain's own columns (all ancestors)
            allowed = torch.cat([cached, torch.ones(b, 1, 1, dtype=torch.bool, device=dev)], dim=2)  # [B, 1, S + 1]
            mask = attention_mask(allowed[:, None], self._attn, self.dtype)
            out = self.head(t, p, mask, self._kv.cache, self._int8)[sel, 0]  # [Bc, H]
            self._kv.extend_valid(torch.zeros(b, 1, dtype=torch.bool, device=dev))  # never valid
            assert self._kv.seq_len == s + 1
            logits = self.head.logits(out, self._int8)  # [Bc, V] fp32
            if self.image_token_id is not None:
                logits[:, self.image_token_id] = float("-inf")
            tok = logits.argmax(-1)  # [Bc] greedy rows
            if sampled:
                probs = (logits / temps).softmax(-1)  # [Bc, V] the law sampled rows draw from
                a = torch.tensor(sampled, device=dev)
                tok[a] = sample(probs[a], [rows[i].generator for i in sampled]).to(dev)
                one_hot = torch.nn.functional.one_hot(tok, self.vocab_size).to(probs.dtype)
                qs.append(torch.where(greedy[:, None], one_hot, probs))
            toks.append(tok)
            if stopping.all_stopped(torch.stack(toks, 1), self.stop_ids):
                break  # every chain has drafted a stop token: nothing after it could be used
        tokens = torch.stack(toks, 1).cpu()  # [Bc, N], N <= gamma
        counts = stopping.chain_counts(tokens, self.stop_ids)  # a chain ends at its first stop token
        for r, t, n in zip(rows, tokens.tolist(), counts):
            r.draft = t[:n]
        return Proposal(ids, tokens, counts, None, torch.stack(qs, 1) if qs else None)

    @torch.no_grad()
    def observe(self, verdicts: Sequence[Verdict]) -> None:
        cfg = self.head.config
        for v in verdicts:  # check them all before changing anything
            row, path = self._row(v.request_id), [int(i) for i in v.accepted]
            if len(v.tokens) != len(path) or path != list(range(len(path))):
                raise ValueError(f"aasd.observe: {v.request_id!r}: path {path} is not a chain prefix with its tokens")
            if path and (row.draft is None or row.draft[: len(path)] != [int(t) for t in v.tokens]):
                raise ValueError(f"aasd.observe: {v.request_id!r}: verdict tokens differ from the drafts")
            want = (cfg.num_key_value_heads, 1 + len(path), cfg.head_dim)
            k, vv = v.extra.get("last_k"), v.extra.get("last_v")
            if k is None or vv is None or tuple(k.shape) != want or vv.shape != k.shape:
                got = None if k is None or vv is None else tuple(k.shape)
                raise ValueError(f"aasd.observe: {v.request_id!r} needs extra last_k / last_v {list(want)} (the "
                                 f"target's last-layer K/V at the pending token and the accepted drafts), got {got}")
        if verdicts:
            index = {rid: i for i, rid in enumerate(self._rows)}
            m = max(1 + len(v.accepted) for v in verdicts)
            b = self._kv.batch_size
            kk = torch.zeros(b, cfg.num_key_value_heads, m, cfg.head_dim, dtype=self.dtype, device=self.device)
            vv = torch.zeros_like(kk)  # [B, H_kv, m, D]
            valid = torch.zeros(b, m, dtype=torch.bool, device=self.device)  # [B, m]
            for v in verdicts:
                i, n = index[v.request_id], 1 + len(v.accepted)
                kk[i, :, :n] = v.extra["last_k"].to(self.device, self.dtype)
                vv[i, :, :n] = v.extra["last_v"].to(self.device, self.dtype)
                valid[i, :n] = True
                row = self._rows[v.request_id]
                row.pending, row.next_pos, row.draft = int(v.next_token), row.next_pos + n, None
            self._kv.cache.update(kk, vv, 0)
            self._kv.extend_valid(valid)
        # moves columns, proposals outstanding or not: no state keeps a draft column once its proposal is drawn
        # (waiting for a moment with none outstanding let the cache grow without bound under concurrent sessions)
        self._kv.maybe_compact()

    def release(self, request_ids: Sequence[str]) -> None:
        drop = {r for r in request_ids if r in self._rows}
        if not drop:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in drop]
        self._kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        for rid in drop:
            del self._rows[rid]
        self._kv.maybe_compact()

    # ------------------------------------------------------------------------------------------------ internals

    def _row(self, request_id: str) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"aasd: unknown request id {request_id!r}")
        return row

    def _generator(self, c: DraftContext) -> torch.Generator:
        return request_generator("aasd", self.seed, c.seed, self._seeder)
