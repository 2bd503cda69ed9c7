"""``flash``: FLASH (latent-aware visual compression + a semi-autoregressive head) over the target's hidden states.

The head (``drafters/flash_head.py``) reads the prompt as EAGLE pairs (h_i, x_{i+1}) with each image replaced by m
latent tokens compressed from its projected visual embeddings, and one forward at the last committed pair gives
the features of the next k tokens. Drafting is a chain of gamma tokens in ceil(gamma / k) head forwards:

    pass 1   root o (output at the last committed pair) -> h^_1 .. h^_k -> q_1 .. q_k -> d_1 .. d_k
    pass 2   feed the k pairs (h^_1, d_1) .. (h^_k, d_k) in one forward (causal) -> o at the last -> d_{k+1} ..

Token d_j is drawn from q_j = softmax(lm_head(h^_j) / T) at the request's temperature T (T = 0: the argmax, q
one-hot, ``q=None`` when every row is greedy), each from its own q_j, in order, with the row's generator; q_j was
computed before any draw of its pass and depends only on the committed sequence and the earlier passes' tokens, so
``Proposal.q[b, j]`` is exactly the law d_j was drawn from given everything before it (lossless under the
standard rejection rule). ``structure="tree"`` is refused: the paper drafts chains (Algorithm 1).

Everything else is ``eagle``'s (``drafters/eagle.py``): the batched cache of pairs with the target's own features
(``Verdict.hidden``), draft columns never valid, tails fed at the next proposal, compaction. Positions are the
draft sequence's own (an image takes m positions, not T_img), in training and here alike.

``spec.needs`` = {"hidden", "visual"}: ``DraftContext.visual`` [N_img, T_max, H], the projected embeddings of the
prompt's images in prompt order, padded to the longest. Each image's own count comes from the prompt ids
(``drafters/image_runs.py``): the head's fixed ``image_tokens`` (LLaVA), or one image per run of image tokens, any
size (Qwen2.5-VL, ``image_tokens`` None); an image of T_img tokens takes min(m, T_img) latent tokens
(``drafters/flash_head.py``).

    drafter = create({"kind": "flash", "path": "flash"}, target=target)   # k from the head (tokens_per_pass)
    engine = SpecEngine(target, drafter, gamma=5)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specula.drafters import stopping
from specula.drafters.eagle import EagleDrafter, _int, _Row
from specula.drafters.flash_head import FlashHead, draft_inputs, layout
from specula.drafters.image_runs import feature_lengths, per_image
from specula.drafters.protocol import DraftContext
from specula.drafters.registration import register
from specula.runtime.core.sampling import sample  # pure torch, no Ray/gRPC


@register("flash")
class FlashDrafter(EagleDrafter):
    """Options: ``path`` (zoo name or directory, default "flash") or ``head`` (a ``FlashHead``); ``structure``
    "chain" only; ``tokens_per_pass`` (default the head's k; fewer uses the first offsets only); ``seed``,
    ``device``, ``dtype``, ``kv_policy`` as ``eagle``. Resources: ``target``, ``tokenizer`` (unused)."""

    KIND = "flash"
    HEAD = FlashHead

    def __init__(self, path: str | Path | None = None, head: FlashHead | None = None, structure: str = "chain",
                 tokens_per_pass: int | None = None, **options):
        if structure != "chain":
            raise ValueError(f"flash: structure must be 'chain' (a semi-autoregressive head drafts chains), "
                             f"got {structure!r}")
        for tree_opt in ("top_k", "depth", "total_tokens"):
            if tree_opt in options:
                raise ValueError(f"flash: unknown options ['{tree_opt}'] (chains only)")
        super().__init__(path=path, head=head, structure=structure, **options)
        k = self.head.config.tokens_per_pass
        self.k = k if tokens_per_pass is None else _int("flash", "tokens_per_pass", tokens_per_pass, 1)
        if self.k > k:
            raise ValueError(f"flash: tokens_per_pass {self.k} > the head's {k}")
        # eagle's ``extend`` / ``grow`` draft one token per forward: not this head's passes
        self.lookahead = self.predraft = False

    def _needs(self) -> frozenset[str]:
        return frozenset({"hidden", "visual"})

    def _check_context(self, c: DraftContext) -> None:
        if self.image_token_id is None:
            return
        n = int((c.prompt_ids == self.image_token_id).sum())
        if not n:
            return
        self._images(c)

    def _images(self, c: DraftContext) -> list[torch.Tensor]:
        """The request's images' own visual embeddings, one [T_img, H] each in prompt order (refused, named, when
        they do not fit the prompt's image runs)."""
        cfg = self.head.config
        H, t = cfg.hidden_size, cfg.image_tokens
        got = None if c.visual is None else tuple(c.visual.shape)
        try:
            if c.visual is not None and c.visual.shape[-1] != H:
                raise ValueError(f"width {c.visual.shape[-1]} != H={H}")
            lengths = feature_lengths(c.prompt_ids, self.image_token_id, c.visual, t)
        except ValueError as e:
            n = int((c.prompt_ids == self.image_token_id).sum())
            size = f"T_img={t}" if t is not None else "T_max"
            raise ValueError(f"flash.begin: {c.request_id!r} has {n} image tokens and needs their visual embeddings "
                             f"[N_img, {size}, H={H}] (one row per image, padded to the longest), got {got}: {e}"
                             ) from None
        return per_image(c.visual, lengths)

    # ------------------------------------------------------------------------------------------------ protocol

    @torch.no_grad()
    def begin(self, contexts: Sequence[DraftContext]) -> None:
        """Feed each prompt's draft sequence: EAGLE pairs at text positions, m latent tokens per image."""
        contexts = list(contexts)
        if not contexts:
            return
        ids = [c.request_id for c in contexts]
        if len(set(ids)) != len(ids) or any(i in self._rows for i in ids):
            raise ValueError(f"flash.begin: request ids must be new and unique, got {ids}")
        cfg = self.head.config
        H = cfg.hidden_size
        for c in contexts:
            n = int(c.prompt_ids.shape[0])
            if c.hidden is None or tuple(c.hidden.shape) != (n, H) or n < 1:
                got = None if c.hidden is None else tuple(c.hidden.shape)
                raise ValueError(f"flash.begin: {c.request_id!r} needs hidden [L={n}, H={H}] (target final-norm "
                                 f"states of the prompt), got {got}")
            if not float(c.temperature) >= 0:
                raise ValueError(f"flash.begin: request {c.request_id!r} has temperature {c.temperature!r}")
            self._check_context(c)
        seqs = []
        for c in contexts:
            nxt = torch.cat([c.prompt_ids[1:].cpu(), torch.tensor([int(c.first_token)])])  # [L] x_{i+1}
            hid = c.hidden[None].to(self.device, self.dtype)  # [1, L, H]
            pairs = self.head.pair_inputs(nxt[None], hid, self._int8)[0]  # [L, H]
            lay = layout(c.prompt_ids, self.image_token_id, cfg.image_tokens, cfg.visual_tokens)
            comp = self.head.compress_images(self._images(c)) if lay.image_slot.numel() else None  # [sum m_img, H]
            seqs.append(draft_inputs(self.head, pairs, comp, lay))  # [L', H]
        b, seq = len(seqs), max(len(s) for s in seqs)
        x = torch.zeros(b, seq, H, dtype=self.dtype, device=self.device)  # [B, L', H]
        lengths = torch.tensor([len(s) for s in seqs])  # [B]
        for i, s in enumerate(seqs):
            x[i, : len(s)] = s
        valid = torch.arange(seq)[None, :] < lengths[:, None]  # [B, L'] bool
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        allowed = (causal[None] & valid[:, None, :]) | torch.eye(seq, dtype=torch.bool)[None]  # [B, L', L']
        from specula.targets.kv import attention_mask

        cache = self._kv.new_cache()
        mask = attention_mask(allowed[:, None].to(self.device), self._attn, self.dtype)
        out = self.head.decode(x, torch.arange(seq).expand(b, seq).to(self.device), mask, cache,
                               self._int8)  # [B, L', H]
        self._kv.join(cache, valid.to(self.device))
        for i, c in enumerate(contexts):
            n = int(lengths[i])
            self._rows[c.request_id] = _Row(x.new_zeros(0, H), [], n, float(c.temperature), self._generator(c),
                                            root=out[i, n - 1].clone())

    # ------------------------------------------------------------------------------------------------ internals

    def _grow(self, rows: list[_Row], sel: torch.Tensor, k: int, depth: int, budget: int):
        """A chain of ``depth`` (= gamma) tokens in passes of ``self.k`` (module docstring). Returns tokens [Bc, N]
        int64 (CPU), parents [Bc, N] int64 (CPU), q [Bc, N, V] fp32 or None, counts, the last layer output
        [Bc, 1, H] and no ``fed`` (what ``EagleDrafter.propose`` expects; unused here, as lookahead is off)."""
        gamma, dev, bc = depth, self.device, len(rows)
        greedy = torch.tensor([r.temperature == 0 for r in rows], device=dev)  # [Bc] bool
        temps = torch.tensor([r.temperature or 1.0 for r in rows], device=dev)[:, None]  # [Bc, 1]
        sampled = [i for i, r in enumerate(rows) if r.temperature > 0]
        draft_start = self._kv.seq_len
        o = torch.stack([r.root for r in rows])  # [Bc, H] output at the last fed pair
        pos = torch.tensor([r.next_pos for r in rows], device=dev)  # [Bc] position of the next pair to feed
        toks, qs = [], []
        while sum(t.shape[1] for t in toks) < gamma:
            n = min(self.k, gamma - sum(t.shape[1] for t in toks))
            feats = self.head.expand(o)[:, :n]  # [Bc, n, H] h^ for the next n tokens
            logits = self.head.logits(feats, self._int8)  # [Bc, n, V] fp32
            if self.image_token_id is not None:
                logits[..., self.image_token_id] = float("-inf")
            tok = logits.argmax(-1)  # [Bc, n] greedy rows
            if sampled:
                probs = (logits / temps[..., None]).softmax(-1)  # [Bc, n, V] each token's own q_j
                a = torch.tensor(sampled, device=dev)
                tok[a] = sample(probs[a], [rows[i].generator for i in sampled]).to(dev)  # [Ba, n], j in order
                one_hot = torch.nn.functional.one_hot(tok, self.vocab_size).to(probs.dtype)
                qs.append(torch.where(greedy[:, None, None], one_hot, probs))
            toks.append(tok)
            if stopping.all_stopped(torch.cat(toks, 1), self.stop_ids):
                break  # every chain has drafted a stop token: nothing after it could be used
            if sum(t.shape[1] for t in toks) < gamma:  # feed the pass's pairs; its last output is the next root
                o = self._feed_chain(sel, tok, feats, pos, draft_start)[:, -1]  # [Bc, H]
                pos = pos + n
        tokens = torch.cat(toks, 1).cpu()  # [Bc, N], N <= gamma
        width = tokens.shape[1]
        counts = list(stopping.chain_counts(tokens, self.stop_ids))  # a chain ends at its first stop token
        parents = (torch.arange(width) - 1).expand(bc, width).clone()
        return tokens, parents, (torch.cat(qs, 1) if qs else None), counts, o[:, None], None

    def _feed_chain(self, sel, tok, hid, pos, draft_start: int) -> torch.Tensor:
        """Feed n chain pairs per call row ``sel`` [Bc]: tok [Bc, n], hid [Bc, n, H], at positions pos [Bc] + 0..n-1;
        each sees the row's valid cache, every draft column of this proposal (all its ancestors) and the pass's
        earlier pairs. Rows not in the call ride along. Returns the head outputs [Bc, n, H]."""
        b, (_, n), s = self._kv.batch_size, tok.shape, self._kv.seq_len
        dev = self.device
        t = torch.zeros(b, n, dtype=torch.long, device=dev)
        h = torch.zeros(b, n, hid.shape[-1], dtype=self.dtype, device=dev)
        p = torch.zeros(b, n, dtype=torch.long, device=dev)
        t[sel], h[sel], p[sel] = tok.to(dev), hid.to(self.dtype), pos[:, None] + torch.arange(n, device=dev)
        cached = self._kv.valid[:, None, :].expand(b, n, s).clone()  # [B, n, S]
        cached[sel, :, draft_start:] = True  # a chain's earlier draft columns are all ancestors
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril().expand(b, n, n)
        out = self._forward(t, h, p, torch.cat([cached, causal], dim=2)[:, None], self._kv.cache)  # [B, n, H]
        self._kv.extend_valid(torch.zeros(b, n, dtype=torch.bool, device=dev))  # never valid (eagle's rule)
        return out[sel]

    @torch.no_grad()
    def root_logits(self, request_ids: Sequence[str]) -> torch.Tensor:
        """The head's logits for the token after each row's pending token (its first offset): [B, V] fp32."""
        rows = [self._row(r) for r in request_ids]
        if any(r.draft is not None for r in rows):
            raise ValueError("flash.root_logits: a row's proposal was not observed")
        index = {rid: i for i, rid in enumerate(self._rows)}
        self._feed_tails([r for r in rows if r.tail_x], [index[r] for r in request_ids if self._rows[r].tail_x])
        return self.head.logits(self.head.expand(torch.stack([r.root for r in rows]))[:, 0], self._int8)
