"""Drafting ahead for rejections (``Predraft``, SSD / Saguaro) on eagle and msd chains.

While block n is verified, the drafter opens its likeliest rejection outcomes "d_0 .. d_{k-1} accepted, the
target's token at k is t" as hidden branches and drafts each one on from t. Checked against full recomputes of
the head from scratch: a branch's nodes are drawn from exactly the head outputs a chain that had drawn t at k would
have been drawn from (greedy: the argmax; sampled: q = softmax(logits / T)); ``grow`` (lockstep: every open chain
one node per head forward) drafts what ``extend`` (one branch after another) drafts; a verdict that lands on a
branch makes its nodes the proposal and drafting on from it works; an unforeseen verdict drops them all. Through
the ``Pipeline``: a verdict on a foreseen rejection gets its block at once. The cache is compacted throughout (a
tight policy), so the pinned columns of branches and of the chain they hang off are exercised too.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from drafter_kit import as_msd, lively_target, random_head, ref_head_outputs

from specula.drafters import DraftContext, Verdict
from specula.drafters.eagle import EagleDrafter
from specula.drafters.msd import MsdDrafter
from specula.drafters.protocol import supports_lockstep, supports_predraft
from specula.runtime.dataplane.overlap import Pipeline
from specula.targets import load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

TIGHT = KVPolicy(min_waste=4, waste_ratio=0.0)
GAMMA = 3


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx = lively_target(processor)
    head = random_head(ctx, std=0.05)  # softer q than the default: runner-up tokens keep some mass
    return {"ctx": ctx, "eagle": head, "msd": as_msd(head), "target": load_target(ctx)}


def _drafter(kit, kind: str, **opts) -> EagleDrafter:
    cls = EagleDrafter if kind == "eagle" else MsdDrafter
    return cls(head=kit[kind], target=kit["target"], kv_policy=TIGHT, stop_token_ids=[], quantize="none", **opts)


class _Row:
    """One session's committed pairs (h [m, H], next tokens [m]), for the recompute."""

    def __init__(self, d: EagleDrafter, temperature: float, seed: int) -> None:
        self.d, self.t = d, temperature
        self.g = torch.Generator().manual_seed(seed)
        self.H, self.image = d.head.config.hidden_size, d.image_token_id
        prompt = [self.token() for _ in range(6)]
        first, h = self.token(), torch.randn(len(prompt), self.H, generator=self.g)
        d.begin([DraftContext("r", torch.tensor(prompt), first, temperature, seed=seed, hidden=h)])
        self.h, self.nxt = h, prompt[1:] + [first]

    def token(self, avoid: tuple[int, ...] = ()) -> int:
        while True:
            t = int(torch.randint(0, self.d.vocab_size, (1,), generator=self.g))
            if t != self.image and t not in avoid:
                return t

    def commit(self, tokens: list[int], nxt: int, hidden: torch.Tensor) -> None:
        self.h, self.nxt = torch.cat([self.h, hidden]), self.nxt + tokens + [nxt]

    def check(self, path: list[int], nodes: list[int], qs: list[torch.Tensor | None]) -> int:
        """``nodes`` were drawn after ``path`` (committed pairs first): each from the recomputed head output."""
        out = ref_head_outputs(self.d.head, self.h, self.nxt, path + nodes)
        for j, (tok, q) in enumerate(zip(nodes, qs)):
            logits = self.d.head.logits(out[len(path) + j])
            logits[self.image] = float("-inf")
            if self.t == 0:
                assert tok == int(logits.argmax()), (path, j)
            else:
                assert q is not None and float(q[tok]) > 0
                want = torch.log_softmax(logits / self.t, -1)  # compared as logs: q is spread thin over V
                torch.testing.assert_close(q.clamp_min(1e-30).log().clamp_min(-60), want.clamp_min(-60), atol=1e-3,
                                           rtol=0)
        return len(nodes)


def _nodes(p) -> tuple[list[int], list[torch.Tensor | None]]:
    n = p.counts[0]
    return p.tokens[0, :n].tolist(), [None if p.q is None else p.q[0, j] for j in range(n)]


@pytest.mark.parametrize("kind", ["eagle", "msd"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_branches_draft_from_exactly_the_head_outputs_of_their_outcome(kit, kind, temperature):
    d = _drafter(kit, kind)
    assert supports_predraft(d) and supports_lockstep(d)
    row = _Row(d, temperature, seed=2)
    rng, checked, landed, fresh, shrank = random.Random(4), 0, 0, True, 0
    for _ in range(10):
        before = d._kv.seq_len  # noqa: SLF001
        if fresh:
            chain, qs = _nodes(d.propose(["r"], GAMMA + 1))  # d_0 .. d_gamma-1 and the guess
            checked += row.check([], chain, qs)
        else:
            chain = list(d._rows["r"].draft[0])  # noqa: SLF001 - a branch adopted by the last verdict
        more, more_q = _nodes(d.extend(["r"], GAMMA + 1))
        if fresh:
            checked += row.check(chain, more, more_q)
        branches = {}
        for _ in range(3):
            opened = d.branch([("r", GAMMA)])[0]
            assert opened is not None and opened not in branches
            k, t = opened
            assert 0 <= k <= GAMMA and t != chain[k] and t != row.image
            nodes, qs = _nodes(d.extend(["r"], 2))  # ``extend`` grows the branch opened last
            assert len(nodes) == 2
            if fresh:
                checked += row.check(chain[:k] + [t], nodes, qs)
            branches[opened] = nodes
        assert d.branch([("r", -1)]) == [None]  # nothing to open before the first node
        grown = d.grow(["r"])[0]  # lockstep: one node on the chain and on each branch, one forward
        assert [o for o, _, _ in grown] == [None, *branches]
        for outcome, tok, q in grown:
            if outcome is None:
                more.append(tok)
                if fresh:
                    checked += row.check(chain + more[:-1], [tok], [q])
            else:
                k, t = outcome
                if fresh:
                    checked += row.check(chain[:k] + [t] + branches[outcome], [tok], [q])
                branches[outcome].append(tok)
        (k, t), nodes = rng.choice(sorted(branches.items()))
        hidden = torch.randn(1 + k, row.H, generator=row.g)
        if rng.random() < 0.5:  # the verdict lands on a branch: its nodes are the proposal now
            d.observe_ahead([Verdict("r", tuple(range(k)), tuple(chain[:k]), t, hidden=hidden)])
            assert d._rows["r"].draft[0] == nodes  # noqa: SLF001
            row.commit(chain[:k], t, hidden)
            landed += 1
            fresh = False
        else:  # an outcome nobody drafted for: every branch goes with the rest of the chain
            miss = row.token(avoid=(chain[k], *(x for (j, x) in branches if j == k)))
            d.observe([Verdict("r", tuple(range(k)), tuple(chain[:k]), miss, hidden=hidden)])
            assert d._rows["r"].draft is None  # noqa: SLF001
            row.commit(chain[:k], miss, hidden)
            fresh = True
        shrank += d._kv.seq_len < before  # noqa: SLF001 - the verdict compacted the cache
        for r in d._rows.values():  # noqa: SLF001 - pinned columns survived compaction, still invalid
            a = r.ahead
            for c in ([] if a is None else a.cols + [c for b in a.branches.values() for c in b.cols]):
                assert 0 <= c < d._kv.seq_len and not bool(d._kv.valid[0, c])  # noqa: SLF001
    assert landed >= 2 and checked > 50 and shrank >= 2
    d.release(["r"])
    assert d._kv.cache is None  # noqa: SLF001


@torch.no_grad()
def test_observe_ahead_refuses_an_outcome_nobody_opened(kit):
    d = _drafter(kit, "eagle")
    row = _Row(d, 0.0, seed=3)
    chain, _ = _nodes(d.propose(["r"], GAMMA + 1))
    k, t = d.branch([("r", GAMMA)])[0]
    other = row.token(avoid=(chain[0], t))
    with pytest.raises(ValueError, match="observe_ahead"):
        d.observe_ahead([Verdict("r", (), (), other, hidden=torch.zeros(1, row.H))])
    tree = _drafter(kit, "eagle", structure="tree", top_k=2, depth=3, total_tokens=6)
    assert not supports_predraft(tree)
    with pytest.raises(ValueError, match="grow"):
        tree.grow(["r"])


@pytest.mark.parametrize("kind", ["eagle", "msd"])
@torch.no_grad()
def test_pipeline_sends_a_foreseen_rejections_block_at_once(kit, kind):
    """The data plane's Pipeline on an eagle / msd chain with predraft 3: lockstep (the branches open first and
    grow beside the block past the guess); a verdict on one of them makes its block the next proposal at once
    (speculative, marked as a branch); the next unforeseen verdict drops whatever was drafted ahead."""
    d = _drafter(kit, kind)
    row = _Row(d, 0.0, seed=5)
    p = Pipeline(d, "r", threading.Lock(), overlap=True, predraft=3)
    assert p.predraft == 3 and p.lockstep
    b = p.propose(GAMMA)
    p.speculate(lambda: False)
    assert len(p._branches) == 3 and len(p._ahead) == GAMMA + 1  # noqa: SLF001
    assert all(len(nodes) == GAMMA + 1 for nodes, _ in p._branches.values())  # noqa: SLF001
    (k, t), (nodes, _) = sorted(p._branches.items())[0]  # noqa: SLF001
    p.verdict(Verdict("r", tuple(range(k)), tuple(b.tokens[:k]), t, hidden=torch.randn(1 + k, row.H)))
    nb = p.propose(GAMMA)
    assert nb.speculative and nb.branch and p.branch_hits == 1 and nb.tokens == nodes[:GAMMA]
    p.speculate(lambda: False)
    miss = row.token(avoid=(nb.tokens[0], *(x for (j, x) in p._branches if j == 0)))  # noqa: SLF001
    p.verdict(Verdict("r", (), (), miss, hidden=torch.randn(1, row.H)))
    again = p.propose(GAMMA)
    assert not again.speculative and again.dropped == 1 and len(again.tokens) == GAMMA
    d.release(["r"])
