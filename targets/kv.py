"""Batched K/V bookkeeping for the live rows: one HF DynamicCache plus a per-slot validity mask.

Layout: every decoder layer holds keys/values ``[B, H_kv, S, D]`` for all live rows; ``valid[b, s]`` says whether
slot s of row b holds a committed token of that row. Keys are cached after RoPE with their own position, so the
order of slots inside a row does not matter: attention only needs the mask, and position ids are tracked per row
by the caller. That is what makes joining, rollback and compaction cheap:

- join (continuous batching): new rows are prefilled into their own cache, both caches are right-padded with
  invalid slots to the same S and concatenated on the batch dimension.
- verify: the block's n slots are appended to every row. ``growable_cache`` layers (``GrowableLayer``) write them
  into spare slots in place; a stock ``DynamicLayer`` concatenates, copying the whole cache every step.
- commit: per row, the kept slots (pending token + accepted path) are gathered to the front of the block, the
  block is cropped to the longest kept run; shorter rows get invalid holes at the end of their block (EAGLE's
  ``copy(indices, prev_length)``, batched). When every row keeps a prefix of its block (chains always do) nothing
  is gathered: ``crop_block`` only crops.
- compaction policy: holes cost attention work and memory, not correctness. ``maybe_compact`` moves every row's
  valid slots to the front (stable, so order is kept) when the reclaimable columns ``S - max_b(valid_b)`` reach
  ``max(policy.min_waste, policy.waste_ratio * S)``. ``reclaim`` is the same for callers that hold column numbers
  (drafters with outstanding drafts): it can also keep pinned invalid slots, and returns where every slot moved.

Relies on ``DynamicLayer.keys`` / ``.values`` holding ``[B, H_kv, S, D]`` tensors and on ``update`` / ``crop`` /
``batch_select_indices`` being the only ways HF touches them (transformers 5.20-5.23); the target tests fail if
that changes. ``BatchedKV`` works with either layer class (the drafters use stock caches).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


@dataclass(frozen=True)
class KVPolicy:
    """When to compact the holes that rejected drafts leave behind."""

    min_waste: int = 64  # never compact for fewer reclaimable columns than this
    waste_ratio: float = 0.25  # ... or than this fraction of the cache length


def attention_mask(allowed: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D mask HF attention expects: bool for sdpa, additive float for eager."""
    if attn_implementation == "sdpa":
        return allowed  # [B, 1, q, k] bool, True = attend
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)  # [B, 1, q, k] model dtype


class GrowableLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends in place.

    ``keys`` / ``values`` are views ``[B, H_kv, S, D]`` of buffers ``[B, H_kv, S_cap, D]`` with spare slots, so an
    update writes its n new slots instead of concatenating (``DynamicLayer.update`` copies the whole cache, O(S),
    for every layer at every step). When the spare slots run out the buffer is reallocated with
    ``max(min_reserve, S // 8)`` spare slots, so appending costs O(1) per token amortized.

    Assigning ``keys`` / ``values`` (BatchedKV's gather, compaction and join; HF's ``crop`` and
    ``batch_select_indices``) adopts the tensor as a buffer without spare slots, except a prefix view of the
    current buffer (a crop), which only shortens the live length: the slots past it become spare again, so a view
    of the longer cache taken before the crop may see them overwritten by later appends.
    """

    _layer_type = None  # never registered as HF's default layer class

    def __init__(self, min_reserve: int = 64):
        self._bufs: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self._lens = {"keys": 0, "values": 0}
        self.min_reserve = min_reserve
        super().__init__()

    @property
    def keys(self) -> torch.Tensor | None:
        return self._get("keys")

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._set("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        return self._get("values")

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._set("values", value)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._append("keys", key_states), self._append("values", value_states)

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop`` (a negative count removes that many slots) without building views."""
        if tokens_to_remove > 0:
            super().crop(tokens_to_remove)  # raises, as the stock layer does
        for name in self._lens:
            self._lens[name] = max(0, self._lens[name] + tokens_to_remove)

    def _get(self, name: str) -> torch.Tensor | None:
        buf = self._bufs[name]
        return buf if buf is None or buf.dim() != 4 else buf[:, :, : self._lens[name]]

    def _set(self, name: str, value: torch.Tensor | None) -> None:
        buf = self._bufs[name]
        if value is not None and buf is not None and _is_prefix_view(value, buf):
            self._lens[name] = value.shape[2]  # a crop: keep the buffer
            return
        self._bufs[name] = value
        self._lens[name] = value.shape[2] if value is not None and value.dim() == 4 else 0

    def _append(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """new [B, H_kv, n, D] -> the live view [B, H_kv, S + n, D]."""
        buf, length = self._bufs[name], self._lens[name]
        end = length + new.shape[2]
        if buf is None or buf.dim() != 4 or end > buf.shape[2]:
            b, h, _, d = new.shape
            grown = new.new_empty(b, h, end + max(self.min_reserve, end // 8), d)  # [B, H_kv, S_cap, D]
            if length:
                grown[:, :, :length] = buf[:, :, :length]
            buf = self._bufs[name] = grown
        buf[:, :, length:end] = new
        self._lens[name] = end
        return buf[:, :, :end]


def _is_prefix_view(x: torch.Tensor, buf: torch.Tensor) -> bool:
    """Is x == buf[:, :, :k] for some k (same memory, same strides)?"""
    return (
        x.dim() == 4
        and buf.dim() == 4
        and x.device == buf.device
        and x.data_ptr() == buf.data_ptr()
        and x.stride() == buf.stride()
        and x.shape[:2] == buf.shape[:2]
        and x.shape[3] == buf.shape[3]
        and x.shape[2] <= buf.shape[2]
    )


def growable_cache(config) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``GrowableLayer``s."""
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowableLayer() for _ in cache.layers]
    return cache


class BatchedKV:
    def __init__(self, make_cache: Callable[[], DynamicCache], policy: KVPolicy = KVPolicy()):
        self._make_cache = make_cache
        self.policy = policy
        self.cache: DynamicCache | None = None
        self.valid: torch.Tensor | None = None  # [B, S] bool

    @property
    def batch_size(self) -> int:
        return 0 if self.valid is None else self.valid.shape[0]

    @property
    def seq_len(self) -> int:
        return 0 if self.valid is None else self.valid.shape[1]

    def new_cache(self) -> DynamicCache:
        """An empty cache for a prefill forward of joining rows (then ``join`` it)."""
        return self._make_cache()

    def join(self, cache: DynamicCache, valid: torch.Tensor) -> None:
        """Append rows prefilled into ``cache`` (valid: [B_new, S_new] bool) after the live rows."""
        if self.cache is None:
            self.cache, self.valid = cache, valid
            return
        s = max(self.seq_len, valid.shape[1])
        for live, new in zip(self.cache.layers, cache.layers, strict=True):
            live.keys = torch.cat([_pad_seq(live.keys, s), _pad_seq(new.keys, s)], dim=0)  # [B + B_new, H_kv, s, D]
            live.values = torch.cat([_pad_seq(live.values, s), _pad_seq(new.values, s)], dim=0)
        self.valid = torch.cat([_pad_seq(self.valid, s), _pad_seq(valid, s)], dim=0)  # [B + B_new, s] bool

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` ([B'] int64, device), in that order."""
        if rows.numel() == 0:
            self.cache, self.valid = None, None
            return
        self.cache.batch_select_indices(rows)
        self.valid = self.valid[rows]

    def block_mask(self, block_allowed: torch.Tensor) -> torch.Tensor:
        """Mask for a forward of n new slots per row: every valid cached slot, plus the block's own structure.

        block_allowed: [B, n, n] bool (query x key inside the block). Returns [B, 1, n, S + n] bool.
        """
        b, n, _ = block_allowed.shape
        cached = self.valid[:, None, :].expand(b, n, self.seq_len)  # [B, n, S] bool
        return torch.cat([cached, block_allowed], dim=2)[:, None]  # [B, 1, n, S + n] bool

    def extend_valid(self, block_valid: torch.Tensor) -> None:
        """Record the validity of the n slots the last forward appended (block_valid: [B, n] bool)."""
        self.valid = torch.cat([self.valid, block_valid], dim=1)  # [B, S + n] bool

    def keep_block(self, start: int, keep: torch.Tensor, keep_valid: torch.Tensor) -> None:
        """Gather kept block slots into place and drop the rest.

        keep: [B, m] int64 slot offsets from ``start`` (padding entries may be any in-range offset);
        keep_valid: [B, m] bool. After this the cache has ``start + m`` slots.
        """
        m = keep.shape[1]
        for layer in self.cache.layers:
            layer.keys = _gather_block(layer.keys, start, keep)
            layer.values = _gather_block(layer.values, start, keep)
        self.valid = torch.cat([self.valid[:, :start], keep_valid], dim=1)  # [B, start + m] bool
        assert self.valid.shape[1] == start + m

    def crop_block(self, start: int, m: int, keep_valid: torch.Tensor | None = None) -> None:
        """``keep_block`` for the case where every row keeps a prefix of its block slots (keep[b] = 0, 1, ...):
        nothing moves, the block is cropped to its first m slots.

        keep_valid: [B, m] bool, or None when every row keeps all m slots and they are already marked valid.
        Slots past a row's kept prefix keep their (rejected) K/V instead of a copy of a kept slot; both are
        invalid, so attention never reads them and compaction drops them.
        """
        end = start + m
        if end < self.seq_len:
            for layer in self.cache.layers:
                layer.crop(end - self.seq_len)  # keys/values [B, H_kv, start + m, D]
        if keep_valid is None:
            self.valid = self.valid[:, :end]  # [B, start + m] bool
        else:
            self.valid = torch.cat([self.valid[:, :start], keep_valid], dim=1)  # [B, start + m] bool

    def last_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.cache.layers[-1]
        return layer.keys, layer.values  # each [B, H_kv, S, D]

    def waste(self, max_valid: int | None = None) -> int:
        """Columns a compaction would reclaim. ``max_valid``: the most valid slots of any row, when the caller
        knows it on the host (saves a reduction and a device sync)."""
        if self.valid is None:
            return 0
        if max_valid is None:
            max_valid = int(self.valid.sum(dim=1).max())
        return self.seq_len - max_valid

    def maybe_compact(self, max_valid: int | None = None) -> bool:
        waste = self.waste(max_valid)
        if waste == 0 or waste < max(self.policy.min_waste, self.policy.waste_ratio * self.seq_len):
            return False
        self.compact()
        return True

    def reclaim(self, pinned: Mapping[int, Sequence[int]] | None = None) -> torch.Tensor | None:
        """``maybe_compact`` for a caller that holds column numbers (a drafter's outstanding drafts), so that it
        never has to wait for a moment with none outstanding: with sessions drafting ahead that moment never comes.

        pinned: row -> columns that must survive although they are invalid (draft nodes fed with predicted
        features, which the row's later draft queries still attend to); they move like valid slots and stay
        invalid. A waiting draft's valid columns need no pin. Returns None when nothing moved, else where every
        slot went: [B, S_old] int64 on the CPU, the new column of a kept slot (compaction is stable, so that is the
        number of kept slots before it), -1 for a dropped one; the caller renumbers its columns with it.
        """
        if self.valid is None:
            return None
        need = max(self.policy.min_waste, self.policy.waste_ratio * self.seq_len)
        waste = self.waste()
        if waste == 0 or waste < need:  # pins only lower the waste: decided without building them
            return None
        keep = self.valid  # [B, S] bool
        if pinned:
            keep = keep.clone()
            for b, cols in pinned.items():
                if len(cols):
                    keep[b, torch.tensor(list(cols), dtype=torch.long, device=keep.device)] = True
            waste = self.seq_len - int(keep.sum(dim=1).max())
            if waste == 0 or waste < need:
                return None
        self._compact(keep)
        keep = keep.cpu()
        return torch.where(keep, keep.long().cumsum(1) - 1, -1)  # [B, S_old] int64

    def compact(self) -> None:
        """Move each row's valid slots to the front, in order, and crop to the longest row."""
        self._compact(self.valid)

    def _compact(self, keep: torch.Tensor) -> None:
        """Move each row's ``keep`` slots ([B, S] bool, a superset of the valid ones) to the front, in order, and
        crop to the longest row; validity moves with the slots."""
        keep_len = int(keep.sum(dim=1).max())
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :keep_len]  # [B, S'] int64
        for layer in self.cache.layers:
            layer.keys = _gather_seq(layer.keys, order)
            layer.values = _gather_seq(layer.values, order)
        self.valid = torch.gather(self.valid, 1, order)  # [B, S'] bool


def stack_caches(caches: Sequence[DynamicCache], valids: Sequence[torch.Tensor],
                 order: torch.Tensor) -> tuple[DynamicCache, torch.Tensor]:
    """Several prefill caches (valid: each [B_i, S_i] bool) as one: rows concatenated, then taken in ``order``
    ([B] int64, device), sequences right-padded to the longest -> (the first cache, holding every row; valid
    [B, S] bool). Join the result with ``BatchedKV.join``."""
    s = max(v.shape[1] for v in valids)
    for j, layer in enumerate(caches[0].layers):
        others = [c.layers[j] for c in caches]
        keys = torch.cat([_pad_seq(o.keys, s) for o in others]).index_select(0, order)  # [B, H_kv, s, D]
        values = torch.cat([_pad_seq(o.values, s) for o in others]).index_select(0, order)
        layer.keys, layer.values = keys, values
    return caches[0], torch.cat([_pad_seq(v, s) for v in valids]).index_select(0, order)  # [B, s] bool


def pad_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` right-padded with zeros on ``dim`` to ``size``."""
    missing = size - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _pad_seq(x: torch.Tensor, s: int) -> torch.Tensor:
    """Right-pad the sequence dim (dim -2 for K/V [B, H_kv, S, D], dim 1 for valid [B, S]) with zeros to s."""
    return pad_dim(x, 1 if x.dim() == 2 else 2, s)


def _gather_seq(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x: [B, H_kv, S, D], index: [B, S'] -> [B, H_kv, S', D]."""
    b, h, _, d = x.shape
    idx = index[:, None, :, None].expand(b, h, index.shape[1], d)  # [B, H_kv, S', D]
    return torch.gather(x, 2, idx)


def _gather_block(x: torch.Tensor, start: int, keep: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, start + n, D] -> [B, H_kv, start + m, D], block slots replaced by the kept ones (m <= n)."""
    m = keep.shape[1]
    kept = _gather_seq(x[:, :, start:], keep)  # [B, H_kv, m, D], a copy, so the write below cannot alias
    x[:, :, start : start + m] = kept  # in place: no O(S) copy of the prefix
    return x[:, :, : start + m]
