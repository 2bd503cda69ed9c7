"""The target's fast paths give exactly (bit for bit) what the general paths give.

- chains: closed-form block structure == the tree code on chain parents; a chain verified as a chain == the same
  chain given as explicit parents (the general tree path), logits, features, cache and all;
- plain decoding without a mask (no holes, batch 1) == the masked forward;
- commit of prefixes (a crop) == the gather, on the valid slots;
- GrowableLayer (in-place appends) == HF's DynamicLayer (concatenation), through decode rounds too;
- compaction bookkeeping from host lengths == from the valid mask.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specula.targets import Accept, DraftBlock
from specula.targets.kv import BatchedKV, GrowableLayer, growable_cache
from specula.targets.tree import block_structure, chain_parents, chain_structure


def _requests(kit):
    return [kit.request("r0", [3, 4], [0], seed=1), kit.request("r1", [6, 2, 1], [1, 0], seed=2)]


def _equal_outputs(a, b):
    assert a.request_ids == b.request_ids
    assert torch.equal(a.logits, b.logits)
    fa, fb = a.features, b.features
    assert fa.lengths == fb.lengths and fa.layers == fb.layers
    assert torch.equal(fa.hidden, fb.hidden)
    assert all(torch.equal(x, y) for x, y in zip(fa.layer_hidden, fb.layer_hidden, strict=True))
    assert torch.equal(fa.last_k, fb.last_k) and torch.equal(fa.last_v, fb.last_v)


def _valid_kv(target, rid):
    """One row's valid cached K/V of every layer, in slot order: [(keys [H_kv, n, D], values), ...]."""
    row = list(target.live_ids).index(rid)
    valid = target.kv.valid[row]
    return [(layer.keys[row][:, valid], layer.values[row][:, valid]) for layer in target.kv.cache.layers]


def _same_state(t1, t2):
    assert t1.live_ids == t2.live_ids
    assert torch.equal(t1.kv.valid, t2.kv.valid)
    for rid in t1.live_ids:
        assert t1.sequence(rid) == t2.sequence(rid)
        for (k1, v1), (k2, v2) in zip(_valid_kv(t1, rid), _valid_kv(t2, rid), strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("num_nodes", [0, 1, 5])
def test_chain_structure_equals_tree_code_on_chain_parents(num_nodes):
    for counts in ([num_nodes] * 3, [0, num_nodes // 2, num_nodes]):
        counts = torch.tensor(counts)
        fast = chain_structure(counts, num_nodes)
        general = block_structure(chain_parents(3, num_nodes), counts)
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])


def test_chain_fast_path_equals_tree_path(kit):
    """Full chains (and padded chains) as chains vs the same blocks with explicit parents, several rounds."""
    fast, general = kit.target(feature_layers=(1,)), kit.target(feature_layers=(1,))
    reqs = _requests(kit)
    ids = [r.request_id for r in reqs]
    for t in (fast, general):
        t.prefill(reqs)
        t.commit([Accept(rid, (), 5) for rid in ids])
    g = torch.Generator().manual_seed(0)
    for counts in (None, None, (3, 1), None):  # None: full chains (the fast path)
        drafts = torch.randint(3, 90, (2, 3), generator=g)
        a = fast.verify(DraftBlock.chain(ids, drafts, counts))
        b = general.verify(DraftBlock(tuple(ids), drafts, chain_parents(2, 3), counts))
        _equal_outputs(a, b)
        accepts = [Accept.chain(rid, int(torch.randint(0, 4 if counts is None else counts[i] + 1, (1,),
                                                       generator=g)), 7) for i, rid in enumerate(ids)]
        fast.commit(accepts)
        general.commit(accepts)
        _same_state(fast, general)
    _equal_outputs(fast.decode_step(ids), general.decode_step(ids))


def _ungrouped(kit):
    """The kit's architecture with as many K/V heads as query heads (the mask-free decode path needs that)."""
    cfg = copy.deepcopy(kit.model.config)
    text = cfg.text_config
    text.num_key_value_heads = text.num_attention_heads
    torch.manual_seed(0)
    return type(kit)(kit.name, type(kit.model)(cfg).eval())  # conftest's Kit


def test_mask_free_decode_equals_masked_decode(kit):
    """Batch 1, no holes: decode steps without a mask == with the explicit all-True mask (same cache after)."""
    assert not kit.target()._mask_free_decode  # grouped K/V heads: HF's unmasked GQA path differs in the last bits
    kit = _ungrouped(kit)
    fast, masked = kit.target(), kit.target()
    assert fast._mask_free_decode
    masked._mask_free_decode = False
    masks = []  # what the fast target's forwards got as their mask
    run_lm = fast._run_lm
    fast._run_lm = lambda embeds, allowed, *rest: masks.append(allowed) or run_lm(embeds, allowed, *rest)
    req = _requests(kit)[1]
    for t in (fast, masked):
        t.prefill([req])
        t.commit([Accept("r1", (), 5)])
    for step in range(6):
        a, b = fast.decode_step(["r1"]), masked.decode_step(["r1"])
        _equal_outputs(a, b)
        nxt = int(a.logits[0, 0].argmax())
        fast.commit([Accept("r1", (), nxt)])
        masked.commit([Accept("r1", (), nxt)])
        if step == 2:  # a gamma-2 block accepting one draft, then decoding again
            drafts = torch.tensor([[11, 12]])
            _equal_outputs(fast.verify(DraftBlock.chain(["r1"], drafts)),
                           masked.verify(DraftBlock.chain(["r1"], drafts)))
            fast.commit([Accept.chain("r1", 1, 9)])
            masked.commit([Accept.chain("r1", 1, 9)])
    _same_state(fast, masked)
    # the prefill runs causal without a mask too (HF's own); only the gamma-2 block keeps its mask
    assert [m is None for m in masks] == [True] * 4 + [False] + [True] * 3


def test_crop_commit_equals_gather_commit():
    """BatchedKV.crop_block (prefix keeps) == keep_block with the same keeps, on every valid slot."""
    g = torch.Generator().manual_seed(0)
    b, h, s, n, d = 3, 2, 5, 4, 8
    kept = [4, 1, 2]  # slots kept per row (a prefix of each row's block)
    for layer_cls in (DynamicLayer, GrowableLayer):
        kvs = []
        for _ in range(2):
            cache = DynamicCache()
            cache.layers = [layer_cls(), layer_cls()]
            kv = BatchedKV(lambda: cache)
            kv.join(cache, torch.ones(b, s, dtype=torch.bool))
            kvs.append(kv)
        for layer in range(2):
            k0, k1 = torch.randn(2, b, h, s + n, d, generator=g)
            for kv in kvs:
                kv.cache.layers[layer].update(k0[:, :, :s].clone(), k1[:, :, :s].clone())
                kv.cache.layers[layer].update(k0[:, :, s:].clone(), k1[:, :, s:].clone())
        for kv in kvs:
            kv.extend_valid(torch.ones(b, n, dtype=torch.bool))
        keep_v = torch.arange(max(kept))[None, :] < torch.tensor(kept)[:, None]  # [B, m]
        kvs[0].crop_block(s, max(kept), keep_v)
        kvs[1].keep_block(s, torch.arange(max(kept)).expand(b, -1), keep_v)
        assert torch.equal(kvs[0].valid, kvs[1].valid)
        for la, lb in zip(kvs[0].cache.layers, kvs[1].cache.layers):
            for row in range(b):
                valid = kvs[0].valid[row]
                assert torch.equal(la.keys[row][:, valid], lb.keys[row][:, valid])
                assert torch.equal(la.values[row][:, valid], lb.values[row][:, valid])


def test_growable_layer_equals_dynamic_layer():
    g = torch.Generator().manual_seed(0)
    stock, grow = DynamicLayer(), GrowableLayer(min_reserve=4)

    def both(fn):
        fn(stock)
        fn(grow)
        assert torch.equal(stock.keys, grow.keys) and torch.equal(stock.values, grow.values)
        assert stock.get_seq_length() == grow.get_seq_length()

    for n in (7, 1, 1, 3, 9, 1):  # appends past the spare slots reallocate
        k, v = torch.randn(2, 2, 3, n, 4, generator=g)
        out = []
        both(lambda layer: out.append(layer.update(k, v)))
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    both(lambda layer: layer.crop(-5))  # shortens the live view, keeps the buffer
    buf = grow._bufs["keys"]
    k, v = torch.randn(2, 2, 3, 2, 4, generator=g)
    both(lambda layer: layer.update(k, v))
    assert grow._bufs["keys"] is buf  # the crop's spare slots were reused

    def assign_prefix(layer):  # what BatchedKV's gather/crop does: a prefix view of the live cache
        layer.keys, layer.values = layer.keys[:, :, :10], layer.values[:, :, :10]

    both(assign_prefix)
    both(lambda layer: layer.batch_select_indices(torch.tensor([1])))  # adopts a new tensor
    k, v = torch.randn(2, 1, 3, 1, 4, generator=g)
    both(lambda layer: layer.update(k, v))
    stock.reset()
    grow.reset()
    assert stock.keys is None and grow.keys is None and grow.get_seq_length() == 0


def test_growable_cache_decodes_like_the_stock_cache(kit):
    """Decode and verify rounds on a batch with holes and compaction: identical outputs with either cache."""
    from specula.targets import KVPolicy

    policy = KVPolicy(min_waste=1, waste_ratio=0.0)
    grow, stock = kit.target(kv_policy=policy), kit.target(kv_policy=policy)
    assert all(isinstance(layer, GrowableLayer) for layer in growable_cache(grow._lm.config).layers)
    stock._kv._make_cache = lambda: DynamicCache(config=stock._lm.config)
    reqs = _requests(kit)
    ids = [r.request_id for r in reqs]
    g = torch.Generator().manual_seed(1)
    for t in (grow, stock):
        t.prefill(reqs)
        t.commit([Accept(rid, (), 5) for rid in ids])
    for step in range(5):
        drafts = torch.randint(3, 90, (2, 3), generator=g)
        _equal_outputs(grow.verify(DraftBlock.chain(ids, drafts)), stock.verify(DraftBlock.chain(ids, drafts)))
        accepts = [Accept.chain(rid, int(torch.randint(0, 4, (1,), generator=g)), 7) for rid in ids]
        grow.commit(accepts)
        stock.commit(accepts)
        _same_state(grow, stock)
        _equal_outputs(grow.decode_step(ids), stock.decode_step(ids))
        grow.commit([Accept(rid, (), 8) for rid in ids])
        stock.commit([Accept(rid, (), 8) for rid in ids])
    assert isinstance(grow.kv.cache.layers[0], GrowableLayer)
    assert type(stock.kv.cache.layers[0]) is DynamicLayer


def test_waste_from_host_lengths_equals_waste_from_valid(llava_kit):
    target = llava_kit.target()
    reqs = _requests(llava_kit)
    ids = [r.request_id for r in reqs]
    target.prefill(reqs)
    target.commit([Accept(rid, (), 5) for rid in ids])
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        target.verify(DraftBlock.chain(ids, torch.randint(3, 90, (2, 4), generator=g)))
        target.commit([Accept.chain(rid, int(torch.randint(0, 5, (1,), generator=g)), 7) for rid in ids])
        longest = max(len(target.sequence(rid)) - 1 for rid in ids)  # cached = sequence minus the pending token
        assert target.kv.waste() == target.kv.waste(max_valid=longest)
