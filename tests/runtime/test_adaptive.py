"""Adaptive draft length (runtime/engine/adaptive.py): the goodput policy backs off for rows whose drafts are
rejected and as the batch grows, comes back when they recover or the batch shrinks; and whatever length each step
drafts (0 included: the drafter only observes), greedy output equals plain decoding for every drafter kind, chain
and tree, on the lively tiny target."""

from __future__ import annotations

import random

import pytest

from test_engine import N_GREEDY, greedy_drafter, kit, plain_greedy  # noqa: F401 (fixtures)
from specula.runtime.engine.adaptive import GoodputPolicy
from specula.runtime.engine.loop import SpecEngine
from specula.targets import load_target

T_FIXED, T_TOKEN, T_DRAFT0, T_DRAFT1 = 0.010, 0.0008, 0.001, 0.0008  # a small model on a CPU: seconds


def _train(policy: GoodputPolicy, ids: list[str], accept: dict[str, float], steps: int, token_cost=T_TOKEN):
    """Runs ``steps`` steps of a simulated engine: costs from the lines above, rows accepting each draft with
    probability ``accept[rid]`` (seeded); returns the lengths chosen."""
    rng = random.Random(0)
    chosen = []
    for _ in range(steps):
        k = policy.choose(ids)
        chosen.append(k)
        drafted, accepted = [k] * len(ids), []
        for rid in ids:
            a = 0
            while a < k and rng.random() < accept[rid]:
                a += 1
            accepted.append(a)
        n = len(ids) * (k + 1)
        policy.record_step(ids, k, T_DRAFT0 + T_DRAFT1 * k if k else 0.0, T_FIXED + token_cost * n, drafted, accepted)
    return chosen


def test_a_well_drafted_request_gets_full_blocks_and_a_rejected_one_none():
    good = GoodputPolicy(gamma=5)
    assert _train(good, ["r"], {"r": 0.9}, 40)[-10:] == [5] * 10
    bad = GoodputPolicy(gamma=5)
    chosen = _train(bad, ["r"], {"r": 0.05}, 40)
    assert chosen[:4] == [5, 0, 5, 2]  # warm-up: points for both cost lines
    assert chosen[-20:].count(0) >= 15  # mostly plain steps; the prior pulls it back to try now and then


def test_speculation_backs_off_as_the_batch_grows_and_returns_when_it_shrinks():
    policy = GoodputPolicy(gamma=5)
    one = ["a"]
    eight = [f"b{i}" for i in range(8)]
    accept = {r: 0.8 for r in one + eight}
    alone = _train(policy, one, accept, 30)[-5:]
    loaded = _train(policy, eight, accept, 30)[-5:]  # 8 x 6 tokens cost far more than 8 plain tokens
    policy.release(eight)
    again = _train(policy, one, accept, 10)[-5:]
    assert min(alone) >= 3 and sum(loaded) <= sum(alone) - 5  # about 4-5 drafts alone, 2 among eight
    assert min(again) >= 3  # back to long blocks once alone again
    steep = GoodputPolicy(gamma=5)  # verifying costs 4 ms a token: nothing drafted pays at 8 rows
    assert _train(steep, eight, accept, 30, token_cost=0.004)[-5:] == [0] * 5


def test_a_tree_drafter_chooses_between_nothing_and_its_whole_budget():
    policy = GoodputPolicy(gamma=6, tree=True)
    assert set(_train(policy, ["r"], {"r": 0.3}, 40)) <= {0, 6}


class RandomLengths:
    """A policy choosing every step's length at random (0 .. gamma), so plain steps fall anywhere."""

    def __init__(self, gamma: int, seed: int) -> None:
        self.gamma, self.rng, self.seen = gamma, random.Random(seed), set()

    def choose(self, ids):
        k = self.rng.randint(0, self.gamma)
        self.seen.add(k)
        return k

    def record_step(self, *a, **k):
        pass

    def release(self, ids):
        pass


@pytest.mark.parametrize("drafter_kind", ["ngram", "text_lm", "text_lm_tree", "noisy_chain", "noisy_tree"])
def test_greedy_equals_plain_whatever_length_each_step_drafts(kit, plain_greedy, drafter_kind):  # noqa: F811
    model, processor = kit
    reqs, ref = plain_greedy
    reqs = reqs[:24]
    target = load_target(model)
    drafter, _ = greedy_drafter(drafter_kind, model, target, ref)
    eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=[processor.tokenizer.eos_token_id], adaptive=True)
    assert isinstance(eng.policy, GoodputPolicy)
    eng.policy = RandomLengths(4, seed=len(drafter_kind))
    accepted = 0
    for i in range(0, len(reqs), 4):
        got = eng.generate(reqs[i:i + 4])
        for r in reqs[i:i + 4]:
            assert got[r.request_id].tokens == ref[r.request_id].tokens, r.request_id
            accepted += got[r.request_id].metrics.accepted_tokens
    assert eng.policy.seen >= {0, 4} and accepted > 0
    assert not target.live_ids


def test_the_goodput_policy_in_the_engine_keeps_the_output(kit, plain_greedy):  # noqa: F811
    model, processor = kit
    reqs, ref = plain_greedy
    target = load_target(model)
    drafter, _ = greedy_drafter("noisy_chain", model, target, ref)
    eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=[processor.tokenizer.eos_token_id], adaptive=True)
    for i in range(0, N_GREEDY, 4):
        got = eng.generate(reqs[i:i + 4])
        assert all(got[r.request_id].tokens == ref[r.request_id].tokens for r in reqs[i:i + 4])
    assert eng.policy.steps > 0 and eng.policy.rows == {}  # every row's state released with it
