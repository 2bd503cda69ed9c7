"""The engine shared by the HF backends: prefill, verify, commit, release over one batched K/V cache.

It drives the stock language model of a HF VLM (``model.model.language_model``) with inputs_embeds, an explicit
4-D attention mask, explicit position ids and a DynamicCache, then applies the stock LM head only where logits
are needed. A backend (llava.py, qwen2_5_vl.py) supplies the vision side and the prompt's position ids.

Per row the engine tracks: the committed tokens whose K/V are cached, the *pending* token (committed, not yet
cached: the first token after prefill, then each step's corrected/bonus token) and the position id the pending
token will take. A verify forward feeds ``[pending, node_0, ..., node_{N-1}]``; commit keeps the pending token
and the accepted path, so the cache always equals prefix + accepted tokens, at the positions one-by-one decoding
would have used.

Forwards run under ``torch.no_grad`` (not ``inference_mode``): returned tensors are ordinary tensors, so a drafter
being trained can feed them to modules that require grad.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .checks import check_block, check_prompt, check_visual
from .images import check_image_groups
from .batching import length_groups
from .kv import BatchedKV, KVPolicy, attention_mask, growable_cache, pad_dim, stack_caches
from .packed_linear import pack_linears, unpack_linears, wanted
from .tree import block_structure, chain_structure, check_path
from .types import (
    Accept,
    DraftBlock,
    PrefillOutput,
    PrefillRequest,
    TargetFeatures,
    TargetInfo,
    VerifyOutput,
    VisualFeatures,
)


@dataclass
class _Row:
    tokens: list[int]  # prompt + committed tokens whose K/V are in the cache
    next_pos: int  # position id of the pending token (text positions; Qwen2.5-VL: after rope_deltas)
    pending: int | None = None  # committed token not yet in the cache


@dataclass
class _Block:
    """The verified block waiting for commit: per request id, its nodes on the host."""

    start: int  # first cache slot of the block
    # request id -> (node tokens, parents [N] int64 or None for a chain, node count)
    nodes: dict[str, tuple[list[int], torch.Tensor | None, int]] = field(default_factory=dict)


class HFTarget:
    """Base class of the HF backends; see protocol.Target for the contract."""

    model_type = ""
    adjacent_images_ok = True  # may one run of image tokens hold several images? (see images.check_image_groups)
    rope_sections = 1  # P: rows of position ids per token (3 for Qwen2.5-VL's mrope)
    _mask_free_decode = True  # see verify and __init__; tests switch it off to compare with the masked forward

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device | None = None,
        feature_layers: Sequence[int] = (),
        kv_policy: KVPolicy = KVPolicy(),
        packed_linears: bool | None = None,
    ):
        if device is not None:
            model.to(device)
        self.model = model.eval()
        # oneDNN on prepacked weights for the CPU linears (packed_linear.py); None: auto (a CPU model that fits)
        if wanted(model, packed_linears):
            self.linears_packed = pack_linears(model)
        else:
            unpack_linears(model)  # a model instance an earlier target packed
            self.linears_packed = 0
        first = next(model.parameters())
        self.device = first.device
        self.dtype = first.dtype
        self._lm = model.model.language_model
        self._embed = self._lm.get_input_embeddings()
        self._head = model.get_output_embeddings()
        cfg = self._lm.config
        self._attn = cfg._attn_implementation
        if self._attn not in ("sdpa", "eager"):
            raise ValueError(
                f"attention implementation {self._attn!r} does not take custom 4-D masks; load with "
                f"attn_implementation='sdpa' or 'eager'"
            )
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("sliding-window attention layers are not supported (a custom 4-D mask ignores the window)")
        n_states = cfg.num_hidden_layers + 1
        for i in feature_layers:
            if not -n_states <= i < n_states:
                raise ValueError(f"feature layer {i} out of range for {cfg.num_hidden_layers} layers")
        self._layers = tuple(i % n_states for i in feature_layers)
        self._kv = BatchedKV(lambda: growable_cache(cfg), kv_policy)  # appends in place, no O(S) concat
        self._rows: dict[str, _Row] = {}  # insertion order == batch row order of self._kv
        self._block: _Block | None = None
        self._causal_masks: dict[int, torch.Tensor] = {}  # see _causal
        # Mask-free decoding only where it is bit-identical to the masked forward: sdpa without grouped K/V heads
        # (with groups, HF runs sdpa's enable_gqa path without a mask but packs the groups with one: last-bit drift).
        heads = cfg.num_attention_heads
        self._mask_free_decode = self._mask_free_decode and self._attn == "sdpa" and (
            (getattr(cfg, "num_key_value_heads", None) or heads) == heads
        )
        self._info = self._make_info()

    # ---- backend hooks -------------------------------------------------------------------------------------------

    def encode_images(self, pixel_values, variant="projected", *, grid=None, image_grid_thw=None) -> VisualFeatures:
        return self.encode_image_variants(pixel_values, (variant,), grid=grid, image_grid_thw=image_grid_thw)[0]

    def encode_image_variants(self, pixel_values, variants: Sequence[str], *, grid=None,
                              image_grid_thw=None) -> tuple[VisualFeatures, ...]:
        """Several variants of the same images from one vision-tower pass, in the order asked."""
        raise NotImplementedError

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters of "vision_tower", "projector" and "language_model" (LM head included)."""
        raise NotImplementedError

    def dummy_image(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One random image in the backend's pixel format: (pixel_values, image_grid_thw or None)."""
        raise NotImplementedError

    def _vision_info(self) -> dict:
        """image_token_id, visual_tokens_per_image, vision_hidden_size for TargetInfo."""
        raise NotImplementedError

    def _image_tokens(self, pixel_values: torch.Tensor, grid: torch.Tensor | None, request_id: str) -> list[int]:
        """Check pixel shapes; visual tokens per image."""
        raise NotImplementedError

    def _prompt_positions(
        self, prompt: torch.Tensor, grid: torch.Tensor | None, request_id: str
    ) -> tuple[torch.Tensor, int]:
        """Position ids of a prompt [P, L] int64 (P rope sections) and the position of the next token."""
        raise NotImplementedError

    def _model_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """[P, B, T] int64 -> the position_ids tensor the language model takes."""
        raise NotImplementedError

    # ---- protocol ------------------------------------------------------------------------------------------------

    @property
    def info(self) -> TargetInfo:
        return self._info

    @property
    def live_ids(self) -> tuple[str, ...]:
        return tuple(self._rows)

    @property
    def kv(self) -> BatchedKV:
        """The batched cache (for tests and metrics; do not mutate)."""
        return self._kv

    def sequence(self, request_id: str) -> list[int]:
        row = self._row(request_id)
        return row.tokens + ([] if row.pending is None else [row.pending])

    @torch.no_grad()
    def prefill(self, requests: Sequence[PrefillRequest]) -> PrefillOutput:
        requests = list(requests)
        if not requests:
            raise ValueError("prefill needs at least one request")
        if self._block is not None:
            raise ValueError("a verified block is waiting for commit(); commit it before prefilling new requests")
        ids = tuple(r.request_id for r in requests)
        if len(set(ids)) != len(ids) or any(i in self._rows for i in ids):
            raise ValueError(f"prefill request ids must be new and unique, got {list(ids)} (live: {self.live_ids})")
        prompts = [check_prompt(r, self._embed.num_embeddings) for r in requests]  # each [L_i] int64, host
        visual, grids = self._visual_for(requests, prompts)  # each [T_total_i, H] or None
        placed = [self._prompt_positions(p, g, r.request_id) for r, p, g in zip(requests, prompts, grids)]

        lengths = [p.shape[0] for p in prompts]
        # Prompts of very different lengths (a text turn beside a five-image one) run as separate forwards: a padded
        # slot costs what a real one does. Rows keep the requests' order in the cache and in the outputs.
        groups = [sorted(g) for g in length_groups(lengths)]
        parts = [self._prefill_rows([prompts[i] for i in g], [visual[i] for i in g], [placed[i][0] for i in g])
                 for g in groups]
        if len(parts) == 1:
            logits, features, cache, valid = parts[0]
        else:
            logits, features, cache, valid = _merge_parts(parts, [i for g in groups for i in g], self.device)
        self._kv.join(cache, valid)
        for r, p, (_, next_pos) in zip(requests, prompts, placed):
            self._rows[r.request_id] = _Row(tokens=p.tolist(), next_pos=next_pos)
        return PrefillOutput(ids, logits, features)

    def _prefill_rows(self, prompts, visual, positions):
        """One padded forward over these prompts (each [L_i] int64; visual: [T_i, H] or None; positions: [P, L_i])
        into a fresh cache -> (logits [b, V] fp32, their TargetFeatures, the cache, valid [b, L] bool)."""
        b, lengths = len(prompts), [p.shape[0] for p in prompts]
        seq = max(lengths)
        sections = positions[0].shape[0]
        tokens = torch.zeros(b, seq, dtype=torch.long)  # [B, L] int64
        pos = torch.zeros(sections, b, seq, dtype=torch.long)  # [P, B, L] int64
        for i, (p, pp) in enumerate(zip(prompts, positions)):
            tokens[i, : p.shape[0]] = p
            pos[:, i, : p.shape[0]] = pp
        lengths_t = torch.tensor(lengths, device=self.device)  # [B]
        valid = torch.arange(seq, device=self.device)[None, :] < lengths_t[:, None]  # [B, L] bool
        tokens = tokens.to(self.device)
        embeds = self._embed(tokens)  # [B, L, H]
        if any(v is not None for v in visual):
            image_mask = (tokens == self._info.image_token_id) & valid  # [B, L] bool
            source = torch.cat([v for v in visual if v is not None]).to(embeds.dtype)  # [sum T, H]
            embeds = embeds.masked_scatter(image_mask[..., None], source)  # row-major order == concat order
        # No mask: plain causal attention (SDPA's is_causal, which skips the blocks above the diagonal). A real
        # query of a shorter row sees only its own earlier slots either way, all real; its padded slots' keys are
        # left invalid in the cache (``valid``), so no later query reads them.
        cache = self._kv.new_cache()
        hidden, layer_hidden = self._run_lm(embeds, None, pos.to(self.device), cache)  # [B, L, H]
        last = hidden[torch.arange(b, device=self.device), lengths_t - 1]  # [B, H]
        logits = self._head(last).float()  # [B, V] fp32
        # [B, H_kv, L, D], contiguous copies (the cache's are views of buffers with spare slots)
        k, v = cache.layers[-1].keys.contiguous(), cache.layers[-1].values.contiguous()
        return logits, TargetFeatures(hidden, tuple(lengths), self._layers, layer_hidden, k, v), cache, valid

    @torch.no_grad()
    def verify(self, block: DraftBlock) -> VerifyOutput:
        if self._block is not None:
            raise ValueError("the previous verified block was not committed; call commit() first")
        ids = tuple(block.request_ids)
        tokens, parents, counts = check_block(block, self._embed.num_embeddings)  # host: [Bb, N], [Bb, N]|None, Bb
        states = [self._row(rid) for rid in ids]
        for rid, st in zip(ids, states):
            if st.pending is None:
                raise ValueError(f"request {rid!r} has no pending token; commit the first token after prefill")
        bb, num_nodes = tokens.shape
        n = num_nodes + 1
        tok_rows = tokens.tolist()  # kept for commit
        pending = [st.pending for st in states]
        next_pos = [st.next_pos for st in states]
        if parents is None and all(c == num_nodes for c in counts):
            # Full chains (plain decoding is N = 0): slot j of every row sits at depth j and sees slots 0..j.
            tok_b = torch.tensor([[p] + r for p, r in zip(pending, tok_rows)], dtype=torch.long)  # [Bb, n] int64
            pos_b = torch.tensor([[p + j for j in range(n)] for p in next_pos], dtype=torch.long)  # [Bb, n] int64
            allowed_b = self._causal(n).expand(bb, n, n)  # [Bb, n, n] bool
            valid_b = torch.ones(bb, n, dtype=torch.bool)  # [Bb, n] bool
        else:
            counts_t = torch.tensor(counts, dtype=torch.long)  # [Bb]
            if parents is None:
                allowed_b, depth_b = chain_structure(counts_t, num_nodes)  # [Bb, n, n] bool, [Bb, n] int64
            else:
                allowed_b, depth_b = block_structure(parents, counts_t)
            node_live = torch.arange(num_nodes)[None, :] < counts_t[:, None]  # [Bb, N] bool
            tok_b = torch.cat([torch.tensor(pending)[:, None], torch.where(node_live, tokens, 0)], dim=1)  # [Bb, n]
            pos_b = torch.tensor(next_pos)[:, None] + depth_b  # [Bb, n] int64
            valid_b = torch.arange(n)[None, :] <= counts_t[:, None]  # [Bb, n] bool: pending + the row's nodes
        live = len(self._rows)
        # Usually the block holds every live row in batch order: then its tensors are the batch's tensors.
        full = bb == live and all(a == b for a, b in zip(ids, self._rows))
        if full:
            tok, pos, allow, slot_valid = tok_b, pos_b, allowed_b, valid_b
        else:
            # Rows not in the block ride along with one dummy query that nothing will keep.
            index = {rid: i for i, rid in enumerate(self._rows)}
            rows = torch.tensor([index[r] for r in ids], dtype=torch.long)  # [Bb]
            tok = torch.zeros(live, n, dtype=torch.long)  # [B, n] int64
            tok[rows] = tok_b
            pos = torch.zeros(live, n, dtype=torch.long)  # [B, n] int64
            pos[rows] = pos_b
            allow = torch.eye(n, dtype=torch.bool).expand(live, n, n).clone()  # [B, n, n] bool
            allow[rows] = allowed_b
            slot_valid = torch.zeros(live, n, dtype=torch.bool)  # [B, n] bool
            slot_valid[rows] = valid_b

        dev = self.device
        start = self._kv.seq_len
        if n == 1 and full and self._mask_free_decode and self._no_holes():
            # Plain decoding over a cache without holes (batch 1 always): every query sees every slot, and SDPA
            # without a mask is faster than with an all-True one, with the same result bit for bit.
            mask = None
        else:
            mask = self._kv.block_mask(allow.to(dev))  # [B, 1, n, S + n] bool
        pos_p = pos.to(dev)[None].expand(self.rope_sections, live, n)  # [P, B, n], text: every section equal
        hidden, layer_hidden = self._run_lm(self._embed(tok.to(dev)), mask, pos_p, self._kv.cache)
        self._kv.extend_valid(slot_valid.to(dev))
        k_all, v_all = self._kv.last_layer()  # [B, H_kv, S + n, D]
        if full:
            # copies: a tree commit gathers kept slots into this block in place
            k, v = k_all[:, :, start:].clone(), v_all[:, :, start:].clone()  # [Bb, H_kv, n, D]
        else:
            rows_d = rows.to(dev)
            hidden = hidden.index_select(0, rows_d)  # [Bb, n, H]
            layer_hidden = tuple(h.index_select(0, rows_d) for h in layer_hidden)  # each [Bb, n, H]
            k = k_all[:, :, start:].index_select(0, rows_d)  # [Bb, H_kv, n, D], a copy (commit writes in place)
            v = v_all[:, :, start:].index_select(0, rows_d)  # [Bb, H_kv, n, D]
        logits = self._head(hidden).float()  # [Bb, n, V] fp32
        lengths = tuple(c + 1 for c in counts)
        self._block = _Block(start, {
            r: (tok_rows[i], None if parents is None else parents[i], counts[i]) for i, r in enumerate(ids)
        })
        return VerifyOutput(ids, logits, TargetFeatures(hidden, lengths, self._layers, layer_hidden, k, v))

    @torch.no_grad()
    def commit(self, accepts: Sequence[Accept]) -> None:
        accepts = list(accepts)
        ids = [a.request_id for a in accepts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"commit lists a request more than once: {ids}")
        for rid in ids:
            self._row(rid)
        blk = self._block
        in_block = blk.nodes if blk is not None else {}
        missing = [r for r in in_block if r not in ids]
        if missing:
            raise ValueError(f"commit must cover every row of the verified block; missing {missing}")
        plan = []  # (row, kept block slots, tokens entering the cache, next token)
        for a in accepts:
            row = self._rows[a.request_id]
            nxt = int(a.next_token)
            if not 0 <= nxt < self._info.vocab_size:
                raise ValueError(f"accept for {a.request_id!r}: next_token {nxt} outside [0, {self._info.vocab_size})")
            path = tuple(int(i) for i in a.path)
            if a.request_id in in_block:
                node_tokens, node_parents, count = in_block[a.request_id]
                check_path(node_parents, count, path, a.request_id)
                keep = [0] + [1 + i for i in path]
                entering = [row.pending] + [node_tokens[i] for i in path]
            else:
                if path:
                    raise ValueError(f"accept for {a.request_id!r} has a path but the request was not verified")
                if row.pending is not None:
                    raise ValueError(
                        f"request {a.request_id!r} already has a pending token; verify or decode it before "
                        f"committing another"
                    )
                keep, entering = [], []
            plan.append((row, keep, entering, nxt))
        if blk is not None:
            index = {rid: i for i, rid in enumerate(self._rows)}
            kept = [0] * len(self._rows)  # kept block slots per live row (0 for rows outside the block)
            for a, (_, keep, _, _) in zip(accepts, plan):
                kept[index[a.request_id]] = len(keep)
            width = max(kept)
            if all(keep == list(range(len(keep))) for _, keep, _, _ in plan):
                # every row keeps a prefix of its block (chains always do): no K/V moves, only a crop
                if all(k == width for k in kept):
                    self._kv.crop_block(blk.start, width)  # the kept slots are all marked valid already
                else:
                    keep_v = torch.arange(width)[None, :] < torch.tensor(kept)[:, None]  # [B, m] bool
                    self._kv.crop_block(blk.start, width, keep_v.to(self.device))
            else:
                keep_t = torch.zeros(len(self._rows), width, dtype=torch.long)  # [B, m] int64 slot offsets
                keep_v = torch.zeros(len(self._rows), width, dtype=torch.bool)  # [B, m] bool
                for a, (_, keep, _, _) in zip(accepts, plan):
                    if keep:
                        keep_t[index[a.request_id], : len(keep)] = torch.tensor(keep)
                        keep_v[index[a.request_id], : len(keep)] = True
                self._kv.keep_block(blk.start, keep_t.to(self.device), keep_v.to(self.device))
            self._block = None
        for row, keep, entering, nxt in plan:
            row.tokens.extend(entering)
            row.next_pos += len(keep)
            row.pending = nxt
        self._maybe_compact()

    @torch.no_grad()
    def release(self, request_ids: Iterable[str]) -> None:
        drop = set(request_ids)
        for rid in drop:
            self._row(rid)
        if not drop:
            return
        keep = [i for i, rid in enumerate(self._rows) if rid not in drop]
        self._kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))
        for rid in drop:
            del self._rows[rid]
        if self._block is not None:
            for rid in drop:
                self._block.nodes.pop(rid, None)
            if not self._block.nodes:
                self._block = None  # its slots are invalid in every remaining row
        if self._block is None:
            self._maybe_compact()

    def decode_step(self, request_ids: Sequence[str]) -> VerifyOutput:
        ids = tuple(request_ids)
        return self.verify(DraftBlock.chain(ids, torch.zeros(len(ids), 0, dtype=torch.long)))

    def generate_plain(
        self, requests: Sequence[PrefillRequest], max_new_tokens: int, eos_token_ids: Iterable[int] | None = None
    ) -> list[list[int]]:
        """Greedy decoding, one token per forward; returns new tokens per request (eos included if hit)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        eos = set(self._info.eos_token_ids if eos_token_ids is None else eos_token_ids)
        out = self.prefill(requests)
        ids = list(out.request_ids)
        first = out.logits.argmax(-1).tolist()
        generated = {rid: [t] for rid, t in zip(ids, first)}
        self.commit([Accept(rid, (), t) for rid, t in zip(ids, first)])
        try:
            active = [r for r in ids if max_new_tokens > 1 and generated[r][-1] not in eos]
            self.release([r for r in ids if r not in active])
            while active:
                step = self.decode_step(active)
                nxt = step.logits[:, 0].argmax(-1).tolist()
                self.commit([Accept(r, (), t) for r, t in zip(active, nxt)])
                for r, t in zip(active, nxt):
                    generated[r].append(t)
                done = [r for r in active if generated[r][-1] in eos or len(generated[r]) >= max_new_tokens]
                if done:
                    self.release(done)
                active = [r for r in active if r not in done]
        finally:
            self.release([r for r in ids if r in self._rows])
        return [generated[r] for r in ids]

    # ---- internals -----------------------------------------------------------------------------------------------

    def _causal(self, n: int) -> torch.Tensor:
        """[n, n] bool lower-triangular (query x key) on the host, cached per n; never written to."""
        mask = self._causal_masks.get(n)
        if mask is None:
            mask = self._causal_masks[n] = torch.ones(n, n, dtype=torch.bool).tril()
        return mask

    def _no_holes(self) -> bool:
        """Is every cached slot of every row valid? (A row's valid slots are exactly its cached tokens.)"""
        s = self._kv.seq_len
        return all(len(r.tokens) == s for r in self._rows.values())

    def _maybe_compact(self) -> None:
        # a row's valid cache slots are exactly its cached tokens, so the host knows the longest row
        self._kv.maybe_compact(max_valid=max((len(r.tokens) for r in self._rows.values()), default=0))

    def _row(self, request_id: str) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            raise ValueError(f"unknown request id {request_id!r} (live: {list(self._rows)})")
        return row

    def _run_lm(self, embeds, allowed, pos, cache) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One language-model forward. embeds [B, T, H], allowed [B, 1, T, S + T] bool (None: causal over every
        cached slot and the T new ones, as HF builds it: a step of T = 1, or a prefill into a fresh cache),
        pos [P, B, T] int64."""
        kwargs = {"output_hidden_states": list(self._layers)} if self._layers else {}
        out = self._lm(
            inputs_embeds=embeds,
            attention_mask=None if allowed is None else attention_mask(allowed, self._attn, embeds.dtype),
            position_ids=self._model_positions(pos),
            past_key_values=cache,
            use_cache=True,
            **kwargs,
        )
        layer_hidden = tuple(out.hidden_states[i] for i in self._layers)  # each [B, T, H]
        return out.last_hidden_state, layer_hidden  # [B, T, H]

    def _visual_for(self, requests, prompts) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Projected visual tokens per request ([T_total, H] or None) and its Qwen image grid (or None)."""
        per_request: list[list[torch.Tensor] | None] = [None] * len(requests)
        grids: list[torch.Tensor | None] = [None] * len(requests)
        counts: list[list[int]] = []
        encode = []
        for i, r in enumerate(requests):
            if r.pixel_values is not None and r.visual is not None:
                raise ValueError(f"request {r.request_id!r}: give pixel_values or visual, not both")
            grid = r.image_grid_thw
            if isinstance(r.visual, VisualFeatures) and grid is None:
                grid = r.visual.image_grid_thw
            grids[i] = None if grid is None else torch.as_tensor(grid).detach().to("cpu", torch.long)
            if r.pixel_values is not None:
                counts.append(self._image_tokens(r.pixel_values, grids[i], r.request_id))
                encode.append(i)
            elif r.visual is not None:
                per_request[i] = check_visual(r.visual, r.request_id, self._info.hidden_size)
                counts.append([x.shape[0] for x in per_request[i]])
            else:
                counts.append([])
            check_image_groups(
                prompts[i],
                self._info.image_token_id,
                counts[-1],
                request_id=r.request_id,
                adjacent_ok=self.adjacent_images_ok,
            )
        if encode:
            pixels = torch.cat([requests[i].pixel_values for i in encode])
            needs_grid = any(grids[i] is not None for i in encode)
            grid = torch.cat([grids[i] for i in encode]) if needs_grid else None
            images = iter(self.encode_images(pixels, "projected", image_grid_thw=grid).per_image())
            for i in encode:
                per_request[i] = [next(images) for _ in counts[i]]
        visual = [None if not v else torch.cat(v).to(self.device) for v in per_request]
        return visual, grids

    def _make_info(self) -> TargetInfo:
        cfg = self._lm.config
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = getattr(cfg, "eos_token_id", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        heads = cfg.num_attention_heads
        return TargetInfo(
            model_type=self.model_type,
            vocab_size=self._head.out_features,
            hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            eos_token_ids=eos,
            feature_layers=self._layers,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            **self._vision_info(),
        )


def _merge_parts(parts, order: list[int], device) -> tuple:
    """The outputs of several prefill forwards (``_prefill_rows``; their rows in ``order``, the requests' indices)
    as those of one, rows in request order, sequences right-padded to the longest."""
    inv = torch.empty(len(order), dtype=torch.long)
    inv[torch.tensor(order)] = torch.arange(len(order))
    inv = inv.to(device)  # [B]: where request i's row is in the parts' concatenation
    seq = max(f.hidden.shape[1] for _, f, _, _ in parts)

    def rows(xs: list[torch.Tensor], dim: int) -> torch.Tensor:  # padded on ``dim`` to seq, concatenated, reordered
        return torch.cat([pad_dim(x, dim, seq) for x in xs]).index_select(0, inv)

    feats = [f for _, f, _, _ in parts]
    logits = torch.cat([lg for lg, _, _, _ in parts]).index_select(0, inv)  # [B, V]
    lengths = [n for f in feats for n in f.lengths]
    features = TargetFeatures(
        rows([f.hidden for f in feats], 1),  # [B, L, H]
        tuple(lengths[j] for j in inv.tolist()),
        feats[0].layers,
        tuple(rows([f.layer_hidden[k] for f in feats], 1) for k in range(len(feats[0].layer_hidden))),
        rows([f.last_k for f in feats], 2),  # [B, H_kv, L, D]
        rows([f.last_v for f in feats], 2),
    )
    cache, valid = stack_caches([c for _, _, c, _ in parts], [v for _, _, _, v in parts], inv)
    return logits, features, cache, valid
