"""``BatchedKV.reclaim``: compaction for callers that hold column numbers (drafters with outstanding drafts).

Keys are tagged with their (row, column), so where every slot went is read off the cache itself.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig

from specula.targets.kv import BatchedKV, KVPolicy

CFG = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2)


def _kv(valid: torch.Tensor, policy: KVPolicy) -> BatchedKV:
    """A 2-layer cache whose key at (b, s) is b * 1000 + s (values: the negation)."""
    b, s = valid.shape
    tag = (torch.arange(b)[:, None] * 1000 + torch.arange(s)[None]).float()  # [B, S]
    k = tag[:, None, :, None].expand(b, 2, s, 4).clone()  # [B, H_kv, S, D]
    kv = BatchedKV(lambda: DynamicCache(config=CFG), policy)
    cache = kv.new_cache()
    for layer in range(2):
        cache.update(k, -k, layer)
    kv.join(cache, valid)
    return kv


def _tags(kv: BatchedKV) -> torch.Tensor:
    return kv.cache.layers[1].keys[:, 0, :, 0]  # [B, S]


def test_reclaim_keeps_valid_and_pinned_slots_in_order_and_says_where_they_went():
    valid = torch.tensor([[1, 0, 1, 0, 0, 1, 0, 0],
                          [0, 0, 0, 1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)  # [3, 8]
    kv = _kv(valid, KVPolicy(min_waste=2, waste_ratio=0.0))
    moved = kv.reclaim({1: [1, 6], 2: []})  # row 1 also keeps two invalid slots
    assert moved is not None and moved.shape == (3, 8) and moved.device.type == "cpu"
    assert moved[0].tolist() == [0, -1, 1, -1, -1, 2, -1, -1]
    assert moved[1].tolist() == [-1, 0, -1, 1, -1, -1, 2, -1]
    assert moved[2].tolist() == [0, 1, -1, -1, -1, -1, -1, 2]
    assert kv.seq_len == 3  # the longest kept row
    tags = _tags(kv)
    for b in range(3):
        for old, new in enumerate(moved[b].tolist()):
            if new >= 0:  # the slot's K/V moved there, its validity with it (pinned slots stay invalid)
                assert tags[b, new] == b * 1000 + old and bool(kv.valid[b, new]) == bool(valid[b, old])
    torch.testing.assert_close(kv.cache.layers[0].values[:, 0, :, 0], -tags)
    assert kv.valid[1].tolist() == [False, True, False]


def test_reclaim_follows_the_policy_and_pins_count_as_kept():
    valid = torch.tensor([[1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    kv = _kv(valid, KVPolicy(min_waste=4, waste_ratio=0.0))
    assert kv.reclaim({0: [1, 2]}) is None and kv.seq_len == 6  # 3 reclaimable < 4: nothing moves
    assert kv.reclaim({0: [5]}) is not None and kv.seq_len == 2  # 4 reclaimable
    assert _tags(kv)[0].tolist() == [0, 5] and kv.valid[0].tolist() == [True, False]
    assert kv.reclaim() is None  # no waste left
    assert BatchedKV(lambda: DynamicCache(config=CFG)).reclaim() is None  # no rows at all
