"""Continuous batching: requests join rows that are already decoding, and leave, without changing anyone's
logits."""

from __future__ import annotations

import torch

from specula.targets import Accept, DraftBlock, KVPolicy

ATOL = 1e-4


def _script(seed: int, rounds: int):
    """Drafts, counts and accept counts for one request, fixed in advance."""
    g = torch.Generator().manual_seed(seed)
    steps = []
    for _ in range(rounds):
        count = int(torch.randint(0, 5, (1,), generator=g))
        drafts = torch.randint(3, 90, (4,), generator=g)
        accepted = int(torch.randint(0, count + 1, (1,), generator=g))
        nxt = int(torch.randint(3, 90, (1,), generator=g))
        steps.append((drafts, count, accepted, nxt))
    return steps


def _step(target, scripts, step):
    """One verify + commit over the given requests; returns {id: logits [count + 1, V]}."""
    ids = list(scripts)
    drafts = torch.stack([scripts[r][step][0] for r in ids])
    counts = [scripts[r][step][1] for r in ids]
    res = target.verify(DraftBlock.chain(ids, drafts, counts=counts))
    target.commit([Accept.chain(r, scripts[r][step][2], scripts[r][step][3]) for r in ids])
    return {r: res.logits[i, : counts[i] + 1] for i, r in enumerate(ids)}


def test_request_joining_a_live_batch_matches_running_alone(kit):
    late = kit.request("late", [2, 11], [1], seed=21)  # longer than the live rows: forces padding on join
    early = [kit.request("e0", [3, 2], [0], seed=22), kit.request("e1", [4], [], seed=23)]
    script = {"late": _script(1, 4), "e0": _script(2, 7), "e1": _script(3, 7)}

    alone = kit.target()
    out_alone = alone.prefill([late])
    alone.commit([Accept("late", (), 9)])
    ref = [_step(alone, {"late": script["late"]}, s)["late"] for s in range(4)]

    shared = kit.target(kv_policy=KVPolicy(min_waste=2, waste_ratio=0.1))
    shared.prefill(early)
    shared.commit([Accept("e0", (), 5), Accept("e1", (), 6)])
    for s in range(2):
        _step(shared, {r: script[r] for r in ("e0", "e1")}, s)
    out_joined = shared.prefill([late])  # joins two rows that are mid-decode
    torch.testing.assert_close(out_joined.logits[0], out_alone.logits[0], atol=ATOL, rtol=0)
    shared.commit([Accept("late", (), 9)])
    got = []
    for s in range(4):
        if s == 2:
            shared.release(["e1"])  # a row leaves mid-flight
        live = {r: script[r][(2 + s) if r != "late" else s:] for r in shared.live_ids}
        got.append(_step(shared, live, 0)["late"])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert shared.live_ids == ("e0", "late")
    assert alone.sequence("late") == shared.sequence("late")


def test_verify_a_subset_of_live_rows(kit):
    """Rows without a draft this step sit the block out; their cache is untouched."""
    target = kit.target()
    reqs = [kit.request("a", [3, 2], [0], seed=31), kit.request("b", [5], [], seed=32)]
    target.prefill(reqs)
    target.commit([Accept("a", (), 5), Accept("b", (), 6)])
    target.verify(DraftBlock.chain(["b"], torch.tensor([[10, 11]])))
    target.commit([Accept.chain("b", 1, 12)])
    res = target.verify(DraftBlock.chain(["b", "a"], torch.tensor([[13], [14]])))
    for row, r in ((0, reqs[1]), (1, reqs[0])):
        seq = target.sequence(r.request_id) + [13 if row == 0 else 14]
        torch.testing.assert_close(res.logits[row], kit.recompute(r, seq).logits[0, -2:], atol=ATOL, rtol=0)


def test_release_everything_then_start_again(llava_kit):
    target = llava_kit.target()
    r = llava_kit.request("x", [3], [0], seed=41)
    first = target.prefill([r]).logits
    target.release(["x"])
    assert target.live_ids == () and target.kv.batch_size == 0
    again = target.prefill([r]).logits
    torch.testing.assert_close(first, again, atol=0, rtol=0)


def test_prompts_of_very_different_lengths_prefill_in_groups_as_one_padded_forward_would(kit, monkeypatch):
    """A long multi-image prompt and short text prompts in one prefill call run as separate forwards (a padded slot
    costs what a real one does), yet the rows come back, and stay in the cache, in the requests' order: logits,
    features and every later step equal those of one padded forward over all of them."""
    from specula.targets import hf_target

    reqs = [kit.request("short", [3], [], seed=51), kit.request("long", [9, 12, 10], [0, 1], seed=52),
            kit.request("tiny", [3], [], seed=53), kit.request("long2", [8, 12, 9], [1, 0], seed=54)]
    grouped, one = kit.target(), kit.target()
    forwards = []
    real = grouped._prefill_rows
    grouped._prefill_rows = lambda p, v, pos: forwards.append([x.shape[0] for x in p]) or real(p, v, pos)
    got = grouped.prefill(reqs)
    monkeypatch.setattr(hf_target, "length_groups", lambda lengths: [list(range(len(lengths)))])
    ref = one.prefill(reqs)
    assert len(forwards) == 2 and sorted(len(f) for f in forwards) == [2, 2]  # the two long ones, the two short
    assert got.request_ids == ref.request_ids and grouped.live_ids == tuple(r.request_id for r in reqs)
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=0)
    assert got.features.lengths == ref.features.lengths
    for b, n in enumerate(ref.features.lengths):
        for a, r in [(got.features.hidden, ref.features.hidden), (got.features.last_k, ref.features.last_k),
                     (got.features.last_v, ref.features.last_v)]:
            seq_dim = 1 if a.dim() == 3 else 2
            torch.testing.assert_close(a[b].narrow(seq_dim - 1, 0, n), r[b].narrow(seq_dim - 1, 0, n),
                                       atol=ATOL, rtol=0)
    for t in (grouped, one):
        t.commit([Accept(r.request_id, (), 5 + i) for i, r in enumerate(reqs)])
    script = {r.request_id: _script(60 + i, 3) for i, r in enumerate(reqs)}
    for s in range(3):
        a, r = _step(grouped, script, s), _step(one, script, s)
        for rid in script:
            torch.testing.assert_close(a[rid], r[rid], atol=ATOL, rtol=0)
    for r in reqs:  # and each row is its own prompt's continuation, against the stock model's full forward
        seq = grouped.sequence(r.request_id)
        assert seq == one.sequence(r.request_id)
        torch.testing.assert_close(_step(grouped, {r.request_id: _script(70, 1)}, 0)[r.request_id][:1],
                                   kit.recompute(r, seq).logits[0, -1:], atol=ATOL, rtol=0)


def test_length_groups_bound_the_padding_and_keep_every_row_once():
    from specula.targets.batching import length_groups

    lengths = [160, 10, 60, 45, 0, 150, 12]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = [max(lengths[i], 1) for i in g]
        assert max(real) * len(g) <= 1.25 * sum(real)
    assert [0, 5] in groups and len(groups) < len(lengths)  # the two image-long rows share one forward
    assert length_groups([]) == [] and length_groups([7]) == [[0]]
