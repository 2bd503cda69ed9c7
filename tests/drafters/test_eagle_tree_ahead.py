"""Drafting ahead from a tree (``Lookahead`` with ``tree_lookahead``): eagle and msd grow a chain past the tree's
spine (its first child at every level). Checked against the same head drafting chains: the spine of a greedy tree
is the greedy chain, the extension past it is the chain drafter's extension, and after a verdict that accepts the
whole spine and the guess the drafter is in the state plain ``observe`` calls would have left (its next tree is
the same)."""

from __future__ import annotations

import pytest
import torch
from drafter_kit import as_msd, lively_target, random_head

from specula.drafters import DraftContext, Verdict
from specula.drafters.eagle import EagleDrafter
from specula.drafters.msd import MsdDrafter
from specula.drafters.protocol import spine, supports_lookahead
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

TREE = dict(structure="tree", top_k=2, depth=4, total_tokens=10)


def test_spine_is_the_first_child_path():
    assert spine([]) == []
    assert spine([-1, -1, 0, 0, 1, 2, 2, 5]) == [0, 2, 5, 7]
    assert spine([-1, 0, 1, 2]) == [0, 1, 2, 3]  # a chain is its own spine
    assert spine([-1, -1, 1, 1]) == [0]  # the first root child has no children


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx = lively_target(processor)
    return {"ctx": ctx, "head": random_head(ctx), "target": load_target(ctx)}


def _drafters(kit, cls):
    target = kit["target"]
    return [cls(head=kit["head"] if cls is EagleDrafter else as_msd(kit["head"]), target=target, **opts)
            for opts in (TREE, dict(structure="chain"), TREE)]


def _context(rid: str, H: int, vocab: int, image: int) -> DraftContext:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, vocab, (9,), generator=g)
    prompt[prompt == image] = 1
    return DraftContext(rid, prompt, 7, 0.0, seed=0, hidden=torch.randn(9, H, generator=g))


@pytest.mark.parametrize("cls", [EagleDrafter, MsdDrafter])
@torch.no_grad()
def test_a_tree_drafts_ahead_along_its_spine_like_a_chain(kit, cls):
    tree, chain, plain = _drafters(kit, cls)
    assert supports_lookahead(tree) and tree.tree_lookahead
    H, V = tree.head.config.hidden_size, tree.vocab_size
    ctx = _context("r", H, V, tree.image_token_id)
    for d in (tree, chain, plain):
        d.begin([ctx])
    p = tree.propose(["r"], 4)
    n = p.counts[0]
    toks, parents = p.tokens[0, :n].tolist(), p.parents[0, :n].tolist()
    path = spine(parents)
    assert n > len(path) >= 2  # a real tree, and a spine of several levels
    c = chain.propose(["r"], len(path))
    assert [toks[i] for i in path] == c.tokens[0].tolist()  # the spine of a greedy tree is the greedy chain
    ahead, ref = tree.extend(["r"], 1), chain.extend(["r"], 1)  # the guess
    more, ref_more = tree.extend(["r"], 3), chain.extend(["r"], 3)
    assert ahead.parents is None and ahead.tokens.tolist() == ref.tokens.tolist()
    assert more.tokens.tolist() == ref_more.tokens.tolist() and more.counts == (3,)
    guess = int(ahead.tokens[0, 0])
    hidden = torch.randn(1 + len(path), H, generator=torch.Generator().manual_seed(5))
    spine_toks = tuple(toks[i] for i in path)
    tree.observe_ahead([Verdict("r", tuple(path), spine_toks, guess, hidden=hidden)])
    assert tree._rows["r"].draft[0] == more.tokens[0].tolist()  # noqa: SLF001 - the extension is now the proposal
    # the plain drafter gets the same committed sequence by ordinary verdicts
    plain.propose(["r"], 4)
    plain.observe([Verdict("r", tuple(path), spine_toks, guess, hidden=hidden)])
    # both: one extension node accepted, then a correction
    x = more.tokens[0].tolist()
    wrong = (x[1] + 1) % V if (x[1] + 1) % V != tree.image_token_id else (x[1] + 2) % V
    h2 = torch.randn(2, H, generator=torch.Generator().manual_seed(6))
    tree.observe([Verdict("r", (0,), (x[0],), wrong, hidden=h2)])
    plain.observe([Verdict("r", (), (), x[0], hidden=h2[:1])])
    plain.observe([Verdict("r", (), (), wrong, hidden=h2[1:])])
    a, b = tree.propose(["r"], 4), plain.propose(["r"], 4)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    for d in (tree, chain, plain):
        d.release(["r"])


@torch.no_grad()
def test_observe_ahead_refuses_a_path_off_the_spine(kit):
    tree = _drafters(kit, EagleDrafter)[0]
    H = tree.head.config.hidden_size
    tree.begin([_context("r", H, tree.vocab_size, tree.image_token_id)])
    p = tree.propose(["r"], 4)
    parents = p.parents[0, : p.counts[0]].tolist()
    path = spine(parents)
    other = next(i for i, q in enumerate(parents) if q == -1 and i != path[0])  # the second root child
    guess = int(tree.extend(["r"], 1).tokens[0, 0])
    with pytest.raises(ValueError, match="observe_ahead"):
        tree.observe_ahead([Verdict("r", (other,), (int(p.tokens[0, other]),), guess, hidden=torch.zeros(2, H))])
    tree.release(["r"])


@pytest.mark.parametrize("structure", ["chain", "tree"])
@torch.no_grad()
def test_a_block_drafted_ahead_that_ends_in_a_stop_token_stays_the_proposal(kit, structure):
    """The extension draws a stop token (it cannot grow past it); a hit still makes its nodes the outstanding
    proposal, so the verdict on them is observed like any other (it used to find no proposal: a drafter error)."""
    probe = EagleDrafter(head=kit["head"], target=kit["target"], **(TREE if structure == "tree" else {}))
    H = probe.head.config.hidden_size
    ctx = _context("r", H, probe.vocab_size, probe.image_token_id)
    probe.begin([ctx])
    p = probe.propose(["r"], 3)
    ext = probe.extend(["r"], 3).tokens[0].tolist()  # guess, x_1, x_2 (greedy: the same again below)
    probe.release(["r"])
    d = EagleDrafter(head=kit["head"], target=kit["target"], stop_token_ids=[ext[2]],
                     **(TREE if structure == "tree" else {}))
    d.begin([ctx])
    q = d.propose(["r"], 3)
    assert q.tokens.tolist() == p.tokens.tolist()
    n = q.counts[0]
    path = spine(q.parents[0, :n].tolist()) if structure == "tree" else list(range(n))
    guess = d.extend(["r"], 1).tokens[0].tolist()
    more = d.extend(["r"], 3)
    assert guess == ext[:1] and more.tokens[0, : more.counts[0]].tolist() == ext[1:3]  # x_2 is a stop token
    toks = q.tokens[0].tolist()
    d.observe_ahead([Verdict("r", tuple(path), tuple(toks[i] for i in path), guess[0],
                             hidden=torch.zeros(1 + len(path), H))])
    assert d._rows["r"].draft[0] == ext[1:3]  # noqa: SLF001 - the block the verifier gets next
    d.observe([Verdict("r", (0,), (ext[1],), 5, hidden=torch.zeros(2, H))])  # one accepted, then a correction
    assert d.propose(["r"], 3).counts[0] > 0
    d.release(["r"])
