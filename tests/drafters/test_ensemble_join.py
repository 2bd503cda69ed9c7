"""The ensemble's members joining a request on demand (``join``, ``drafters/ensemble_join.py``) on the small random
LLaVA target of ``test_ensemble.py``: the first member drafts alone (one row, no caption made) until its acceptance
rate over ``join_after`` blocks falls below ``join_below``; then every member joins with the committed tokens as its
context's tail. Each node's q must be exactly the law it was drawn from before and after the join (full recomputes
of each member's context), greedy output must equal plain decoding, and sampled output must follow the target.
"""

from __future__ import annotations

import pytest
import torch
from drafter_kit import assert_equals_plain, assert_follows_the_target, eos, node_paths, plain, requests
from test_ensemble import _contexts, _member_logp, drafter, kit  # noqa: F401 (kit: the module's fixture)

from specula.drafters import Verdict, create
from specula.drafters.ensemble_join import JoinRule, JoinStats
from specula.drafters.massv_model import pool_features
from specula.runtime.core.mixture import mix_distributions
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.engine.loop import SpecEngine
from specula.targets import load_target


def test_the_join_rule():
    rule = JoinRule.parse("on_demand", 2, 0.5, False, "ensemble")
    assert rule.waits(0.8) and not rule.waits(0.0)  # greedy requests keep the first member alone by default
    assert JoinRule.parse("on_demand", 2, 0.5, True, "e").waits(0.0) and not JoinRule.parse(
        "at_once", 2, 0.5, True, "e").waits(0.8)
    stats = JoinStats()
    stats.add(0, True)
    assert not rule.due(stats)  # one block is not enough to judge
    stats.add(1, True)
    assert rule.due(stats) and (stats.accepted, stats.examined) == (1, 3)  # 1 of 3 < 0.5
    stats.add(4, False)  # a block accepted whole: nothing turned down
    assert not rule.due(stats) and stats.examined == 7  # 5 of 7
    assert not JoinRule.parse("at_once", 1, 1.0, False, "e").due(JoinStats(5, 0, 20))  # at once: nobody waits
    assert not JoinRule.parse("on_demand", 1, 0.0, False, "e").due(JoinStats(5, 0, 20))  # 0: never join
    for bad, msg in ((("sometimes", 2, 0.5, False), "join must be one of"), (("on_demand", 0, 0.5, False),
                     "join_after"), (("on_demand", True, 0.5, False), "join_after"),
                     (("on_demand", 2, 1.5, False), "join_below"), (("on_demand", 2, 0.5, 1), "join_greedy")):
        with pytest.raises(ValueError, match=msg):
            JoinRule.parse(*bad, "ensemble")


def test_members_join_a_request_whose_first_member_drafts_poorly(kit):
    """Two requests; r0's verdicts accept nothing, r1's everything. Both draft from the multimodal member alone (q =
    its own softmax) and make no caption; after two blocks r0's other members join (their contexts = their prompt
    form + r0's committed tokens, the caption made then and not booked as begin time), r0's q becomes the mixture
    with the configured weights, and r1 keeps one row."""
    target = load_target(kit["target"])
    m = kit["noisy"]
    image = kit["target"].config.image_token_id
    weights = [3.0, 1.0, 1.0, 2.0]
    opts = dict(structure="chain", weights=weights, grid=3, prune_below=0)
    d = drafter(kit, join="on_demand", join_after=2, join_below=0.5, **opts)
    ref = drafter(kit, join="at_once", **opts)  # its member contexts at begin: what joining must rebuild
    reqs = requests(kit, 2, SamplingParams(), suites=["multi_image", "chart"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features for r in reqs}
    ctxs = _contexts(kit, reqs, 0.8, lambda r: feats[r.request_id])
    d.begin(ctxs)
    ref.begin(ctxs)
    assert d.pop_begin_times() == {} and ref.pop_begin_times()  # no caption until the caption member joins
    assert d.live_members("r0") == d.live_members("r1") == ["multimodal"]
    prompts = {rid: [ref.context(rid, j)[:-1] for j in range(4)] for rid in ("r0", "r1")}  # without the first token

    def member_q(rid, j, extra):
        f = feats[rid]
        vis = {"multimodal": f.reshape(-1, f.shape[-1]),
               "pooled": pool_features(f, (3, 3)).reshape(-1, f.shape[-1])}.get(d.members[j].kind)
        return _member_logp(m, d.context(rid, j) + extra, vis, image, 0.8)

    for rnd in range(3):
        prop = d.propose(["r0", "r1"], gamma=3)
        verdicts = []
        for b, rid in enumerate(["r0", "r1"]):
            toks, _, paths = node_paths(prop, b)
            live = len(d.live_members(rid))
            want_w = weights if live == 4 else [1.0]
            for i, path in enumerate(paths):
                want = mix_distributions([member_q(rid, j, [toks[k] for k in path]) for j in range(live)], want_w)
                torch.testing.assert_close(prop.q[b, i], want, atol=2e-5, rtol=1e-4)
            path = [] if rid == "r0" else list(range(len(toks)))
            verdicts.append(Verdict(rid, tuple(path), tuple(toks[k] for k in path), 11))
        d.observe(verdicts)
        joined = rnd >= 1
        assert d.live_members("r0") == (["multimodal", "text", "caption", "pooled9"] if joined else ["multimodal"])
        assert d.live_members("r1") == ["multimodal"]
        if rnd == 1:  # just joined: the contexts are each member's prompt form + the committed answer
            answer = d.context("r0", 0)[len(prompts["r0"][0]):]
            assert len(answer) == 3  # the first token and two corrections
            assert [d.context("r0", j) for j in range(4)] == [p + answer for p in prompts["r0"]]
            assert torch.tensor(d.member_weights("r0")).tolist() == pytest.approx([w / 7 for w in weights])
    assert d.pop_begin_times() == {}  # the caption made at the join is drafting time
    d.release(["r0", "r1"])
    assert not d._rows and not d._waiting and not d._join_stats and d._kv.batch_size == 0


def test_blocks_verified_ahead_count_towards_a_join(kit):
    """Drafting ahead (``extend`` / ``observe_ahead``, the data plane's overlap): a block accepted whole whose next
    token is the chain's next node counts as kept, one that lands off the chain (here: a plain ``observe`` of a
    turned-down node) as missed; the members join once the rate falls below the rule's, and drafting ahead goes on
    with every member in lockstep."""
    target = load_target(kit["target"])
    reqs = requests(kit, 1, SamplingParams(), suites=["chart"])
    f = target.encode_images(reqs[0].pixel_values, "pre_projector").features
    d = drafter(kit, grid=3, join="on_demand", join_after=2, join_below=0.7, prune_below=0)
    d.begin(_contexts(kit, reqs, 0.8, lambda r: f))
    a = d.propose(["r0"], gamma=3)
    d.extend(["r0"], 3)
    chain = d._rows[d._keys("r0")[0]].draft.tokens
    d.observe_ahead([Verdict("r0", (0, 1, 2), tuple(chain[:3]), chain[3])])  # 3 kept, the guess right
    assert (d._join_stats["r0"].accepted, d._join_stats["r0"].examined) == (3, 3)
    assert a.counts == (3,) and d.live_members("r0") == ["multimodal"]
    d.observe([Verdict("r0", (), (), 11)])  # the next block turned down at once (11: not the chain's node)
    assert d.live_members("r0") == ["multimodal"]  # 3 of 4, not below 0.7
    d.propose(["r0"], gamma=3)
    d.observe([Verdict("r0", (), (), 11)])  # 3 of 5
    assert d.live_members("r0") == ["multimodal", "text", "caption", "pooled9"] and "r0" not in d._join_stats
    b = d.propose(["r0"], gamma=2)
    more = d.extend(["r0"], 2)
    assert b.counts == (2,) and more.counts == (2,)
    rows = [d._rows[k].draft.tokens for k in d._keys("r0")]
    assert all(r == rows[0] for r in rows) and len(rows[0]) == 4  # every member row holds the same chain
    d.release(["r0"])


@pytest.mark.parametrize("join_greedy", [True, False])
def test_on_demand_greedy_equals_plain_decoding_with_members_joining(kit, join_greedy):
    """Eight requests through the engine with a rule that calls the members in on most visual requests: greedy
    output equals plain decoding; with ``join_greedy`` some requests drafted with every member and some never did,
    without it (the default) none waits or joins."""
    reqs = requests(kit, 8, SamplingParams(max_tokens=16))
    ref = plain(kit, "target", reqs, 4)
    target = load_target(kit["target"])
    d = drafter(kit, join="on_demand", join_after=1, join_below=0.9, join_greedy=join_greedy, prune_below=0)
    widest: dict[str, int] = {}
    waited: set[str] = set()
    observe = d.observe

    def watched(verdicts):
        waited.update(d._waiting)
        observe(verdicts)
        for v in verdicts:
            widest[v.request_id] = max(widest.get(v.request_id, 0), len(d.live_members(v.request_id)))

    d.observe = watched
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 4)
    assert t.accepted > 0
    if join_greedy:
        assert 4 in widest.values() and 1 in widest.values(), widest
    else:
        assert set(widest.values()) == {1} and not waited, (widest, waited)
    assert not d._rows and not d._groups_of and not d._waiting  # every row released


@pytest.mark.statistical
def test_sampled_tokens_follow_the_target_when_members_join(kit):
    """The shared distribution check with the members joining after the first block unless it was accepted whole
    (gamma 2: the third token is drafted by the mixture whenever the first block was cut short)."""
    base = requests(kit, 1, SamplingParams(), suites=["vqa"])[0]
    target = load_target(kit["target"])
    d = create({"kind": "ensemble", "model": kit["copy"], "seed": 3, "weights": [1, 1, 2, 1], "join": "on_demand",
                "join_after": 1, "join_below": 1.0}, target=target)
    joined = [0]
    real = d._join_due

    def counted(seen):
        waiting = len(d._waiting)
        real(seen)
        joined[0] += waiting - len(d._waiting)

    d._join_due = counted
    assert_follows_the_target(kit["target"], d, base, target=target, max_tokens=4)
    assert joined[0] >= 100, joined  # the check saw the members join, not the first member alone
