"""verify + commit keep the cache equal to prefix + accepted tokens: logits, hidden states and K/V match a full
recompute by the stock HF model, over several rounds with random gamma and random accept counts."""

from __future__ import annotations

import pytest
import torch

from specula.targets import Accept, DraftBlock, KVPolicy

ATOL = 1e-4
AGGRESSIVE = KVPolicy(min_waste=1, waste_ratio=0.0)  # compact after every commit that leaves a hole


def _requests(kit):
    return [
        kit.request("r0", [3, 4], [0], seed=1),
        kit.request("r1", [6, 2, 1], [1, 0], seed=2),
        kit.request("r2", [5], [], seed=3),
        kit.request("r3", [2, 9], [1], seed=4),
    ]


def _check_against_recompute(kit, req, seq, logits, feats, row, n, layers):
    """Rows of ``logits``/``feats`` for the last ``n`` tokens of ``seq`` equal the stock model's full forward."""
    ref = kit.recompute(req, seq, hidden_layers=layers)
    torch.testing.assert_close(logits[row, :n], ref.logits[0, -n:], atol=ATOL, rtol=0)
    torch.testing.assert_close(feats.hidden[row, :n], ref.hidden_states[-1][0, -n:], atol=ATOL, rtol=0)
    for k, layer in enumerate(layers):
        torch.testing.assert_close(feats.layer_hidden[k][row, :n], ref.hidden_states[layer][0, -n:], atol=ATOL, rtol=0)
    ref_k = ref.past_key_values.layers[-1].keys[0, :, -n:]  # [H_kv, n, D]
    ref_v = ref.past_key_values.layers[-1].values[0, :, -n:]
    torch.testing.assert_close(feats.last_k[row, :, :n], ref_k, atol=ATOL, rtol=0)
    torch.testing.assert_close(feats.last_v[row, :, :n], ref_v, atol=ATOL, rtol=0)


@pytest.mark.parametrize("policy", [KVPolicy(), AGGRESSIVE], ids=["default_policy", "compact_always"])
def test_chain_rounds_match_full_recompute(kit, policy):
    layers = (1,)
    target = kit.target(feature_layers=layers, kv_policy=policy)
    reqs = _requests(kit)
    by_id = {r.request_id: r for r in reqs}
    g = torch.Generator().manual_seed(0)

    out = target.prefill(reqs)
    for i, r in enumerate(reqs):
        L = r.input_ids.shape[0]
        assert out.features.lengths[i] == L
        ref = kit.recompute(r, r.input_ids.tolist(), hidden_layers=layers)
        torch.testing.assert_close(out.logits[i], ref.logits[0, -1], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.features.hidden[i, :L], ref.hidden_states[-1][0], atol=ATOL, rtol=0)
        ref_k = ref.past_key_values.layers[-1].keys[0]  # [H_kv, L, D]
        torch.testing.assert_close(out.features.last_k[i, :, :L], ref_k, atol=ATOL, rtol=0)
    target.commit([Accept(r.request_id, (), int(torch.randint(3, 90, (1,), generator=g))) for r in reqs])

    ids = [r.request_id for r in reqs]
    for _ in range(4):
        gamma = 5
        counts = torch.randint(0, gamma + 1, (len(ids),), generator=g).tolist()
        # No image token among drafts: the stock reference would try to scatter pixels there.
        drafts = torch.randint(3, 90, (len(ids), gamma), generator=g)
        block = DraftBlock.chain(ids, drafts, counts=counts)
        res = target.verify(block)
        assert res.logits.shape == (len(ids), gamma + 1, res.logits.shape[-1])
        assert res.logits.dtype == torch.float32
        assert res.features.lengths == tuple(c + 1 for c in counts)
        for row, rid in enumerate(ids):
            n = counts[row] + 1
            seq = target.sequence(rid) + drafts[row, : counts[row]].tolist()
            _check_against_recompute(kit, by_id[rid], seq, res.logits, res.features, row, n, layers)
        accepts = []
        for rid, c in zip(ids, counts):
            k, nxt = int(torch.randint(0, c + 1, (1,), generator=g)), int(torch.randint(3, 90, (1,), generator=g))
            accepts.append(Accept.chain(rid, k, nxt))
        before = {rid: len(target.sequence(rid)) for rid in ids}
        target.commit(accepts)
        for a in accepts:
            assert len(target.sequence(a.request_id)) == before[a.request_id] + len(a.path) + 1

    # After the last commit, one plain decode step still matches (the cache holds exactly prefix + accepted).
    step = target.decode_step(ids)
    for row, rid in enumerate(ids):
        _check_against_recompute(kit, by_id[rid], target.sequence(rid), step.logits, step.features, row, 1, layers)
    if policy is AGGRESSIVE:
        assert target.kv.waste() == 0


def test_cache_holds_only_committed_slots(llava_kit):
    target = llava_kit.target()
    reqs = _requests(llava_kit)[:2]
    target.prefill(reqs)
    target.commit([Accept(r.request_id, (), 5) for r in reqs])
    target.verify(DraftBlock.chain(["r0", "r1"], torch.tensor([[7, 8, 9], [7, 8, 9]])))
    target.commit([Accept.chain("r0", 3, 4), Accept.chain("r1", 1, 4)])
    valid = target.kv.valid.sum(dim=1).tolist()
    assert valid == [len(target.sequence("r0")) - 1, len(target.sequence("r1")) - 1]  # pending token not cached


def test_eager_attention_matches_recompute(llava_kit):
    """The additive float mask path (attn_implementation='eager') gives the same logits as sdpa."""
    model = llava_kit.model
    model.set_attn_implementation("eager")
    try:
        target = llava_kit.target()
        reqs = _requests(llava_kit)[:2]
        target.prefill(reqs)
        target.commit([Accept(r.request_id, (), 5) for r in reqs])
        drafts = torch.tensor([[11, 12, 13], [14, 15, 16]])
        res = target.verify(DraftBlock.chain(["r0", "r1"], drafts, counts=[3, 1]))
    finally:
        model.set_attn_implementation("sdpa")
    for row, (r, c) in enumerate(zip(reqs, [3, 1])):
        ref = llava_kit.recompute(r, target.sequence(r.request_id) + drafts[row, :c].tolist())
        torch.testing.assert_close(res.logits[row, : c + 1], ref.logits[0, -(c + 1) :], atol=ATOL, rtol=0)
