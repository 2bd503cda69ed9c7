"""The ``eagle`` drafter on small random LLaVA targets with the world's tokenizer and real world prompts.

Two targets: ``ctx``, a tiny LLaVA with large random weights (its answers depend on the whole context and the
images), and ``bigram``, the same with its attention and second layer switched off, so that a head holding a copy
of its decoder layer (``copy``) drafts its greedy tokens exactly and ``partial`` (the copy, slightly perturbed and
reading the hidden states) in part; ``random`` is a seeded fresh head. Greedy output must equal plain decoding
(chain and tree, batch 1 and 4); every proposal's q must equal a from-scratch recompute over the committed sequence
and the node's ancestors, and the head's cache must equal a recompute after any verdicts; sampled output must
follow the target (slow, chi-square).
"""

from __future__ import annotations

import pytest
import torch
from drafter_kit import (TREE, FeatureChecked, assert_equals_plain, assert_follows_the_target, churn, copy_head, eos,
                         head_drafter, lively_target, mixed_requests, node_paths, plain, random_head, requests,
                         )

from specula.drafters import DraftContext, Drafter, Verdict, create, kinds
from specula.drafters.eagle import EagleDrafter
from specula.drafters.eagle_head import EagleConfig, EagleHead
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    ctx, bigram = lively_target(processor, False), lively_target(processor, True)
    return {"processor": processor, "ctx": ctx, "bigram": bigram, "random": random_head(ctx),
            "copy": copy_head(bigram), "partial": copy_head(bigram, noise=0.001, h_mix=0.003)}


def drafter(kit, head: str, target, **opts) -> EagleDrafter:
    return head_drafter("eagle", kit, head, target, **opts)


def test_registered_with_the_protocol(kit):
    assert "eagle" in kinds()
    d = drafter(kit, "random", load_target(kit["ctx"]))
    assert isinstance(d, Drafter) and d.spec.needs == frozenset({"hidden"}) and d.spec.kind == "eagle"
    # the target's embedding and lm_head are shared, not copied, and not part of the head's weights
    assert d.head._shared[1] is kit["ctx"].get_output_embeddings()
    assert not any("embed" in k or "lm_head" in k for k in d.head.state_dict())


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("structure", ["chain", "tree"])
@pytest.mark.parametrize("model,head", [("ctx", "random"), ("bigram", "copy"), ("bigram", "partial")])
def test_greedy_equals_plain_decoding(kit, model, head, structure, batch):
    reqs = requests(kit, 8, SamplingParams(max_tokens=20))
    ref = plain(kit, model, reqs, batch)
    target = load_target(kit[model])
    d = drafter(kit, head, target, structure=structure, **TREE)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, batch)
    if head != "random":
        assert t.accepted > 0  # drafts were accepted, not only rejected
    if head == "copy":  # exact drafts: a chain is accepted whole (the last block may be cut at max_tokens); a tree
        # keeps the 10 most confident of its 30 candidates, so its argmax path may stop short of depth 4
        assert min(t.taus) >= (4.0 if structure == "chain" else 2.0), t.taus
    assert not target.live_ids and not d._rows  # every row released on both sides


def test_greedy_rows_of_a_mixed_batch_equal_plain_decoding(kit):
    temps = [0.0, 1.0, 0.0, 0.7]
    reqs = requests(kit, 4, [SamplingParams(temperature=t, seed=i, max_tokens=16) for i, t in enumerate(temps)])
    ref = plain(kit, "bigram", reqs, 4)
    for structure in ("chain", "tree"):
        target = load_target(kit["bigram"])
        got = SpecEngine(target, drafter(kit, "partial", target, structure=structure, **TREE), gamma=3,
                         eos_token_ids=[-1]).generate(reqs)
        assert got["r0"].tokens == ref["r0"].tokens and got["r2"].tokens == ref["r2"].tokens


# ---------------------------------------------------------------------------------------------- exactness


def _ref_features(head: EagleHead, hidden: torch.Tensor, nxt: list[int], path: list[int]) -> list[torch.Tensor]:
    """h^ after the committed pairs (hidden [m, H], nxt [m]) and after each draft token of ``path``, by full causal
    forwards from scratch (no cache): [h^_root, h^(path[0]), ...]."""
    hs, xs, out = hidden, list(nxt), []
    for j in range(len(path) + 1):
        if j:
            hs, xs = torch.cat([hs, out[-1][None]]), xs + [path[j - 1]]
        pred = head(torch.tensor([xs]), hs[None], torch.arange(len(xs))[None], None)[0]  # [m + j, H]
        out.append(pred[-1])
    return out


class Checked(FeatureChecked):
    """An EagleDrafter whose every proposal is checked against a from-scratch recompute (each node's q is the
    head's softmax after the committed sequence and the node's ancestors), and whose root logits are checked
    after verdicts (every ``every``-th observe, so tails also pile up across steps)."""

    def reference(self, rid):
        seq = self.target.sequence(rid)  # committed tokens + the pending one
        h = self.model.model(input_ids=torch.tensor([seq[:-1]]), pixel_values=self.pix[rid]).last_hidden_state[0]
        return lambda path: _ref_features(self.d.head, h, seq[1:], path)


@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_cache_and_every_q_equal_a_recompute(kit, structure):
    """Rows join and leave, sampled and greedy rows share a batch, some steps are plain (no proposal, the verdict
    queues behind the tail), compaction runs: q and the root always equal a from-scratch recompute."""
    model = kit["ctx"]
    target = load_target(model)
    reqs = mixed_requests(kit, 9, 3)
    d = EagleDrafter(head=kit["random"], structure=structure, target=target,
                     kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0), top_k=2, depth=3, total_tokens=5,
                     quantize="none")  # the recompute runs the stock fp32 layer
    chk = Checked(d, target, model, reqs)
    compactions = churn(target, chk, d, reqs, gamma=3, plain_steps=(3, 4, 7))  # plain steps: the drafter only observes
    assert chk.checked_nodes > 20 and chk.checked_roots > 5 and compactions > 0
    assert not d._rows and d._kv.batch_size == 0


def _prefilled(kit, target, n: int):
    from specula.targets import PrefillRequest

    reqs = requests(kit, n, SamplingParams())
    out = target.prefill([PrefillRequest(r.request_id, r.input_ids, r.pixel_values) for r in reqs])
    return reqs, {r.request_id: out.features.hidden[b, : out.features.lengths[b]] for b, r in enumerate(reqs)}


def _depth(parents: list[int]) -> int:
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return max(d)


def test_a_stop_token_gets_no_children(kit):
    """A drafted stop token (EOS by default) ends its chain, gets no children in a tree (the frontier expands other
    nodes) and is not drafted past ahead of a verdict; greedy output still equals plain decoding."""
    target = load_target(kit["ctx"])
    assert drafter(kit, "random", target).stop_ids.tolist() == list(target.info.eos_token_ids)
    reqs, hidden = _prefilled(kit, target, 2)
    ctx = [DraftContext(r.request_id, r.input_ids, first_token=7, hidden=hidden[r.request_id]) for r in reqs]
    free = drafter(kit, "random", target, stop_token_ids=[])
    free.begin(ctx)
    chain = free.propose(["r0", "r1"], gamma=5)
    assert chain.counts == (5, 5)
    stop = int(chain.tokens[0, 1])
    cut = drafter(kit, "random", target, stop_token_ids=[stop])
    cut.begin(ctx)
    got = cut.propose(["r0", "r1"], gamma=5)
    row1 = chain.tokens[1, :5].tolist()
    n1 = row1.index(stop) + 1 if stop in row1 else 5
    assert got.counts == (2, n1) and got.tokens[0, :2].tolist() == chain.tokens[0, :2].tolist()
    assert cut._rows["r0"].ahead is None  # extend will not draft past the stop token
    tree = drafter(kit, "random", target, structure="tree", top_k=3, depth=4, total_tokens=10, stop_token_ids=[stop])
    tree.begin(ctx)
    prop = tree.propose(["r0", "r1"], gamma=8)
    for b in range(2):
        toks, parents, _ = node_paths(prop, b)
        assert all(p < 0 or toks[p] != stop for p in parents)
    bigram = load_target(kit["bigram"])
    reqs = requests(kit, 4, SamplingParams(max_tokens=16))
    ref = plain(kit, "bigram", reqs, 2)
    stop = ref["r0"].tokens[3]
    for structure in ("chain", "tree"):
        d = drafter(kit, "partial", bigram, structure=structure, stop_token_ids=[stop], **TREE)
        assert_equals_plain(SpecEngine(bigram, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 2)


def test_a_chain_drafts_what_the_tree_code_draws_with_one_child(kit):
    """Chains skip the tree's bookkeeping (``_grow_chain``) and propose exactly what the tree code (``_grow_tree``,
    top_k 1) proposes: the same tokens, counts, q and draws for sampled and greedy rows, chains cut by stop tokens,
    and the same state for drafting ahead (columns, path, head outputs), through joins, plain steps and compaction."""
    model = kit["ctx"]
    reqs = mixed_requests(kit, 9, 3)
    probe_target = load_target(model)
    _, hidden = _prefilled(kit, probe_target, 2)
    probe = drafter(kit, "random", probe_target, stop_token_ids=[])
    probe.begin([DraftContext(f"r{i}", reqs[i].input_ids, first_token=7, hidden=hidden[f"r{i}"]) for i in (0, 1)])
    stops = sorted(set(probe.propose(["r0", "r1"], gamma=4).tokens[:, 1:3].flatten().tolist()))  # drafted often
    runs = {}
    for path in ("chain", "tree"):
        target = load_target(model)
        d = drafter(kit, "random", target, stop_token_ids=stops, kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0))
        used = []
        if path == "tree":
            d._grow_chain = lambda rows, sel, depth, d=d: used.append(1) or d._grow_tree(rows, sel, 1, depth, depth)
        else:
            chain = d._grow_chain
            d._grow_chain = lambda rows, sel, depth: used.append(1) or chain(rows, sel, depth)
        seen, propose = [], d.propose

        def record(ids, gamma, d=d, seen=seen, propose=propose):
            p = propose(ids, gamma)
            ahead = [(a.cols, a.path, a.out, a.src) for a in (d._rows[r].ahead for r in ids) if a is not None]
            seen.append((p, ahead))
            return p

        d.propose = record
        churn(target, d, d, reqs, gamma=4, plain_steps=(3, 6))
        runs[path] = (seen, len(used))
    (chain, n_chain), (tree, n_tree) = runs["chain"], runs["tree"]
    assert len(chain) == len(tree) == n_chain == n_tree > 5
    for (a, ahead_a), (b, ahead_b) in zip(chain, tree):
        assert a.request_ids == b.request_ids and a.counts == b.counts and torch.equal(a.tokens, b.tokens)
        assert a.parents is None and b.parents is None
        assert (a.q is None) == (b.q is None) and (a.q is None or torch.equal(a.q, b.q))
        assert len(ahead_a) == len(ahead_b)
        for (cols, path, out, src), (cols_b, path_b, out_b, src_b) in zip(ahead_a, ahead_b):
            assert cols == cols_b and path == path_b and torch.equal(out, out_b)
            assert len(src) == len(src_b) and all(torch.equal(x, y) for x, y in zip(src, src_b))
    assert any(c < 4 for p, _ in chain for c in p.counts)  # a stop token ended some chain
    assert any(p.q is not None for p, _ in chain) and any(ahead for _, ahead in chain)


def test_tree_shapes_for_greedy_and_sampled_rows(kit):
    target = load_target(kit["ctx"])
    d = drafter(kit, "random", target, structure="tree", top_k=3, depth=4, total_tokens=10)
    reqs, hidden = _prefilled(kit, target, 2)
    d.begin([DraftContext(r.request_id, r.input_ids, first_token=7, temperature=t, seed=1, hidden=hidden[r.request_id])
             for r, t in zip(reqs, [0.0, 1.0])])
    prop = d.propose(["r0", "r1"], gamma=8)
    assert prop.counts == (10, 10)
    image = kit["ctx"].config.image_token_id
    for b in range(2):
        par, tok = prop.parents[b].tolist(), prop.tokens[b].tolist()
        assert all(p < i for i, p in enumerate(par)) and image not in tok  # parents first
        for p in range(-1, 10):
            kids = [i for i in range(10) if par[i] == p]
            assert len({tok[i] for i in kids}) == len(kids) <= 3  # siblings distinct, at most top_k
    # greedy row (EAGLE-2): the best 10 of 3 + 9 + 9 + 9 candidates by cumulative confidence, q one-hot
    assert (prop.q[0].max(-1).values == 1).all() and _depth(prop.parents[0].tolist()) >= 2
    # sampled row: grown level by level within the budget and never pruned: the root's 3 children (drawn without
    # replacement, in draw order), then the 3 of them by confidence get 3, 3 and the last 1 children
    par = prop.parents[1].tolist()
    assert par[:3] == [-1, -1, -1] and par[3:6] == [par[3]] * 3 and par[6:9] == [par[6]] * 3
    assert sorted({par[3], par[6], par[9]}) == [0, 1, 2]
    conf = [float(prop.q[1, i, prop.tokens[1, i]]) for i in range(3)]
    assert conf[par[3]] >= conf[par[6]] >= conf[par[9]]  # expanded in order of confidence
    for first in (0, 3, 6):  # a group shares its parent's q
        for i in range(first + 1, first + 3):
            assert torch.equal(prop.q[1, i], prop.q[1, first])
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(2, 10))
    assert prop.q[1, :, image].max() == 0
    with pytest.raises(ValueError, match="not observed"):
        d.propose(["r0"], gamma=2)
    with pytest.raises(ValueError, match="differ"):
        d.observe([Verdict("r1", (0,), (int(prop.tokens[1, 0]) + 1,), 5, torch.zeros(2, 64))])
    with pytest.raises(ValueError, match="hidden"):
        d.observe([Verdict("r1", (), (), 5, None)])
    with pytest.raises(ValueError, match="not a branch"):
        d.observe([Verdict("r1", (3,), (int(prop.tokens[1, 3]),), 5, torch.zeros(2, 64))])
    d.observe([Verdict("r0", (), (), 5, torch.zeros(1, 64)), Verdict("r1", (0,), (int(prop.tokens[1, 0]),), 6,
                                                                     torch.zeros(2, 64))])
    assert d.propose(["r1"], gamma=2).counts == (10,)  # gamma caps the depth: 3 + 7 in two levels
    target.release(["r0", "r1"])


def test_a_seed_reproduces_the_drafts_whatever_the_batch(kit):
    target = load_target(kit["ctx"])
    reqs, hidden = _prefilled(kit, target, 3)

    def drafts(ids):
        d = drafter(kit, "random", target, structure="tree", **TREE)
        d.begin([DraftContext(r.request_id, r.input_ids, first_token=9, temperature=1.0, seed=5 + int(r.request_id[1:]),
                              hidden=hidden[r.request_id]) for r in reqs if r.request_id in ids])
        return d.propose(ids, gamma=4).tokens[ids.index("r0")].tolist()

    assert drafts(["r0"]) == drafts(["r1", "r0", "r2"])
    target.release([r.request_id for r in reqs])


def test_bad_config_is_refused(kit, tmp_path):
    target = load_target(kit["ctx"])
    for opts, match in [({"structure": "graph"}, "structure"), ({"top_k": 0}, "top_k"), ({"depth": 0}, "depth"),
                        ({"total_tokens": 0}, "total_tokens"), ({"seed": -1}, "seed"), ({"branching": 3}, "unknown"),
                        ({"dtype": "float33"}, "dtype"), ({"stop_token_ids": [1.5]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            drafter(kit, "random", target, **opts)
    with pytest.raises(ValueError, match="target"):
        create({"kind": "eagle", "head": EagleHead(EagleConfig.from_target(kit["ctx"]))})
    wide = EagleHead(EagleConfig(**{**EagleConfig.from_target(kit["ctx"]).__dict__, "hidden_size": 32,
                                    "intermediate_size": 64, "head_dim": 16}))
    with pytest.raises(ValueError, match="do not fit"):
        create({"kind": "eagle", "head": wide}, target=target)
    with pytest.raises(ValueError, match="no eagle.safetensors"):
        create({"kind": "eagle", "path": str(tmp_path)}, target=target)
    with pytest.raises(FileNotFoundError):
        create({"kind": "eagle", "path": str(tmp_path / "nowhere")}, target=target)
    d = drafter(kit, "random", target)
    with pytest.raises(ValueError, match="hidden"):
        d.begin([DraftContext("x", torch.tensor([1, 2, 3]), first_token=4)])


# ---------------------------------------------------------------------------------------------- sampling


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_sampled_tokens_follow_the_target(kit, structure):
    """The shared distribution check (exact joint of the first 3 tokens) with the ``copy`` head.

    With these tree settings, pruning sampled siblings by their own confidence (EAGLE-2's rerank applied to sampled
    rows, which breaks the sibling law the verifier assumes) is the kind of fault this check exists to catch."""
    base = requests(kit, 1, SamplingParams(), start=2)[0]
    target = load_target(kit["bigram"])
    d = drafter(kit, "copy", target, structure=structure, top_k=3, depth=2, total_tokens=5, seed=3)
    assert_follows_the_target(kit["bigram"], d, base, target=target, max_tokens=4 if structure == "chain" else 7)