"""A drafter begun late (SpecEngine(begin_after=N)): a row decodes plainly until it has N tokens, then its drafter
begins and replays those plain steps' verdicts. Answers shorter than N never reach the drafter; greedy output
equals plain decoding for every drafter kind, chain and tree, with begun and not-yet-begun rows in one batch; and
the replay leaves the drafter where an eager begin with the same plain steps would have left it (same drafts)."""

from __future__ import annotations

import pytest

from test_engine import greedy_drafter, kit, plain_greedy  # noqa: F401 (fixtures)
from specula.runtime.engine.loop import SpecEngine
from specula.targets import load_target

AFTER = 3


class Watch:
    """Wraps a drafter (delegating everything else) and records what the engine asked of it."""

    def __init__(self, inner) -> None:
        self.inner, self.spec = inner, inner.spec
        self.begun: dict[str, int] = {}  # request id -> its tokens when the drafter began it
        self.proposals: list[tuple[tuple[str, ...], list[list[int]]]] = []
        self.engine = None

    def begin(self, contexts):
        for c in contexts:
            row = self.engine.rows.get(c.request_id)
            self.begun[c.request_id] = len(row.tokens) if row is not None else 0
        return self.inner.begin(contexts)

    def propose(self, ids, gamma):
        prop = self.inner.propose(ids, gamma)
        self.proposals.append((tuple(ids), [prop.tokens[b, :c].tolist() for b, c in enumerate(prop.counts)]))
        return prop

    def observe(self, verdicts):
        return self.inner.observe(verdicts)

    def release(self, ids):
        return self.inner.release(ids)


def _run_staggered(eng: SpecEngine, reqs) -> dict:
    """Two rows join, two steps pass, two more join: begun and unbegun rows share steps."""
    out = {}
    events = list(eng.add(reqs[:2]))
    for _ in range(2):
        if eng.rows:
            events += eng.step()
    events += eng.add(reqs[2:])
    while eng.rows:
        events += eng.step()
    for r in reqs:
        out[r.request_id] = eng.finished.pop(r.request_id)
    return out


@pytest.mark.parametrize("drafter_kind", ["ngram", "text_lm", "text_lm_tree", "noisy_chain", "noisy_tree"])
def test_greedy_equals_plain_with_the_drafter_begun_late(kit, plain_greedy, drafter_kind):  # noqa: F811
    model, processor = kit
    reqs, ref = plain_greedy
    reqs = reqs[:16]
    target = load_target(model)
    inner, _ = greedy_drafter(drafter_kind, model, target, ref)
    drafter = Watch(inner)
    eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=[processor.tokenizer.eos_token_id],
                     begin_after=AFTER)
    drafter.engine = eng
    accepted = 0
    for i in range(0, len(reqs), 4):
        got = _run_staggered(eng, reqs[i:i + 4])
        for r in reqs[i:i + 4]:
            assert got[r.request_id].tokens == ref[r.request_id].tokens, r.request_id
            accepted += got[r.request_id].metrics.accepted_tokens
    assert accepted > 0
    long_ones = {r.request_id for r in reqs if len(ref[r.request_id].tokens) > AFTER}
    assert set(drafter.begun) == long_ones and set(drafter.begun.values()) == {AFTER}
    for ids, _ in drafter.proposals:  # never asked for a row it had not begun
        assert set(ids) <= set(drafter.begun)
    assert not target.live_ids and not eng._unbegun


def test_a_short_answer_never_reaches_the_drafter(kit, plain_greedy):  # noqa: F811
    model, processor = kit
    reqs, ref = plain_greedy
    target = load_target(model)
    inner, _ = greedy_drafter("text_lm", model, target, ref)
    drafter = Watch(inner)
    eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=[processor.tokenizer.eos_token_id], begin_after=AFTER)
    drafter.engine = eng
    from dataclasses import replace

    short = [replace(r, params=replace(r.params, max_tokens=AFTER - 1)) for r in reqs[:4]]
    got = eng.generate(short)
    assert all(got[r.request_id].tokens == ref[r.request_id].tokens[:AFTER - 1] for r in short)
    assert drafter.begun == {} and drafter.proposals == []
    assert all(got[r.request_id].metrics.draft_tokens == 0 for r in short)


class FixedStart:
    """A policy drafting nothing for the first ``plain`` steps, then gamma: what an eager begin sees when a lazy
    one (begin_after = plain + 1) replays."""

    def __init__(self, gamma: int, plain: int) -> None:
        self.gamma, self.plain, self.steps = gamma, plain, 0

    def choose(self, ids, rows=None):
        self.steps += 1
        return 0 if self.steps <= self.plain else self.gamma

    def record_step(self, *a, **k):
        pass

    def release(self, ids):
        pass


@pytest.mark.parametrize("drafter_kind", ["ngram", "text_lm", "text_lm_tree"])
def test_the_replay_leaves_the_drafter_where_an_eager_begin_would(kit, plain_greedy, drafter_kind):  # noqa: F811
    model, processor = kit
    reqs, ref = plain_greedy
    target = load_target(model)
    eos = [processor.tokenizer.eos_token_id]
    runs = []
    for lazy in (False, True):
        inner, _ = greedy_drafter(drafter_kind, model, target, ref)
        drafter = Watch(inner)
        if lazy:
            eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=eos, begin_after=AFTER)
        else:
            eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=eos, adaptive=True)
            eng.policy = FixedStart(4, plain=AFTER - 1)
        drafter.engine = eng
        long = next(r for r in reqs if len(ref[r.request_id].tokens) > AFTER + 4)
        got = eng.generate([long])
        assert got[long.request_id].tokens == ref[long.request_id].tokens
        runs.append(drafter.proposals)
    eager, lazy = runs
    assert lazy and lazy == eager  # the same drafts at every step after the plain ones


class Subset:
    """A drafter stub whose proposal is fixed per row: tokens 10 + row, q one-hot on them, a tree's parents."""

    def __init__(self, vocab: int, tree: bool) -> None:
        from specula.drafters.protocol import DrafterSpec

        self.spec, self.vocab, self.tree = DrafterSpec("stub", "tree" if tree else "chain"), vocab, tree

    def propose(self, ids, gamma):
        import torch

        from specula.drafters.protocol import Proposal

        b = len(ids)
        tokens = torch.tensor([[10 + int(r[1:]) * 2 + j for j in range(gamma)] for r in ids])  # [B, gamma]
        q = torch.nn.functional.one_hot(tokens, self.vocab).float()  # [B, gamma, V]
        parents = torch.tensor([[-1, -1, 0][:gamma]] * b) if self.tree else None
        return Proposal(tuple(ids), tokens, tuple(gamma - i % 2 for i in range(b)), parents, q)


@pytest.mark.parametrize("tree", [False, True])
def test_a_proposal_for_the_begun_rows_widens_to_the_whole_step(tree):
    """Rows not begun get count 0 and padding; every begun row keeps its own tokens, q, parents and count."""
    import torch

    eng = SpecEngine.__new__(SpecEngine)
    eng.drafter = Subset(64, tree)
    ids = ["r0", "r1", "r2", "r3", "r4"]
    drafting = ["r1", "r3", "r4"]
    prop = eng._propose(ids, drafting, 3)
    alone = eng.drafter.propose(drafting, 3)
    assert prop.request_ids == tuple(ids) and prop.counts == (0, alone.counts[0], 0, *alone.counts[1:])
    for i, rid in enumerate(drafting):
        j = ids.index(rid)
        assert torch.equal(prop.tokens[j], alone.tokens[i]) and torch.equal(prop.q[j], alone.q[i])
        if tree:
            assert torch.equal(prop.parents[j], alone.parents[i])
    for j in (0, 2):  # padding: a valid chain, q a distribution
        assert torch.allclose(prop.q[j].sum(-1), torch.ones(3))
        if tree:
            assert prop.parents[j].tolist() == [-1, 0, 1]


@pytest.mark.parametrize("after", [0, AFTER])
def test_the_drafter_s_begin_is_booked_apart_from_drafting(kit, plain_greedy, after, monkeypatch):  # noqa: F811
    """The drafter's begin of each request (its prefill of the prompt) is booked as "draft_begin", once per request,
    and not as "draft" (the drafting of blocks), whether it begins with the prefill or late. The engine's clock is
    skewed by 1000 s inside begin, so the booking shows whichever key took it, on a busy machine too."""
    import time
    import types

    from specula.runtime.engine import loop

    model, processor = kit
    reqs, ref = plain_greedy
    target = load_target(model)
    inner, _ = greedy_drafter("text_lm", model, target, ref)
    drafter = Watch(inner)
    skew = [0.0]
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skew[0]))
    real = drafter.begin

    def slow_begin(contexts):
        skew[0] += 1000.0
        return real(contexts)

    drafter.begin = slow_begin
    eng = SpecEngine(target, drafter, gamma=4, eos_token_ids=[processor.tokenizer.eos_token_id], begin_after=after)
    drafter.engine = eng
    got = eng.generate(reqs[:1])[reqs[0].request_id]
    assert len(got.tokens) > AFTER and drafter.begun  # long enough to begin either way
    t = got.metrics.time
    assert 1000 <= t["draft_begin"] < 1100 and t["draft"] < 1000, dict(t)
