"""The ``text_lm`` drafter on a small random LLaVA target with the world's tokenizer and real world prompts.

The drafter LM is the target's own language model with the images removed (``copy``: exact on text-only prompts,
off on image prompts) or a noisy version of it (``noisy``: partly right everywhere), so blocks are accepted whole,
in part and not at all. Greedy output must equal plain decoding (chain and tree, batch 1 and 4); the drafter's
cache must equal a full recompute of its committed text-only context after any verdicts; sampled output must
follow the target (slow, chi-square).
"""

from __future__ import annotations

import random

import pytest
import torch
from drafter_kit import (assert_equals_plain, assert_follows_the_target, churn, eos, lively_target, mixed_requests,
                         node_paths, plain, requests)
from transformers import LlamaForCausalLM

from specula.drafters import DraftContext, Drafter, Verdict, create, kinds
from specula.drafters.text_lm import TextLMDrafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.kv import KVPolicy
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR
from specula.targets.embedded_arch import TargetArch
from specula.training.drafters.text_lm_config import TextLMArch, compute_ratio
from specula.training.drafters.text_lm_config import build_model as build_text_lm


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    g = torch.Generator().manual_seed(0)
    model = lively_target(processor, generator=g)  # g goes on to draw the noise below
    copy = LlamaForCausalLM(model.config.text_config)
    copy.model.load_state_dict(model.model.language_model.state_dict())
    copy.tie_weights()
    noisy = LlamaForCausalLM(model.config.text_config)
    noisy.load_state_dict(copy.state_dict())
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.015)
    return {"target": model, "copy": copy.eval(), "noisy": noisy.eval(), "processor": processor}


def drafter(kit, lm: str = "noisy", **opts) -> TextLMDrafter:
    opts = {"quantize": "none", **opts}  # exact recomputes and exact copies: the stock fp32 weights
    return create({"kind": "text_lm", "model": kit[lm], **opts}, target=load_target(kit["target"]))


def test_compute_is_under_a_sixth_of_the_target_lm():
    tok = load_processor(TOKENIZER_DIR).tokenizer
    ratio = compute_ratio(TextLMArch.from_name("embedded"), TargetArch.from_name("embedded"), len(tok))
    assert ratio <= 1 / 6 and round(ratio, 3) == 0.162  # the figure in training/drafters/text_lm_config.py
    model = build_text_lm(TextLMArch.from_name("embedded"), tok)
    assert model.config.vocab_size == len(tok) == 985
    assert "text_lm" in kinds()


@pytest.mark.parametrize("lm", ["copy", "noisy"])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_greedy_equals_plain_decoding(kit, structure, batch, lm):
    reqs = requests(kit, 8, SamplingParams(max_tokens=20))
    ref = plain(kit, "target", reqs, batch)
    target = load_target(kit["target"])
    d = create({"kind": "text_lm", "model": kit[lm], "structure": structure, "branching": [2, 2, 1]}, target=target)
    assert isinstance(d, Drafter)
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, batch)
    assert t.accepted > 0  # drafts were accepted, not only rejected
    assert not target.live_ids and not d._rows  # every row released on both sides


def test_greedy_rows_of_a_mixed_batch_equal_plain_decoding(kit):
    temps = [0.0, 1.0, 0.0, 0.7]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=16) for i, t in enumerate(temps)]
    reqs = requests(kit, 4, params)
    ref = plain(kit, "target", reqs, 4)
    target = load_target(kit["target"])
    for structure in ("chain", "tree"):
        d = drafter(kit, structure=structure)
        got = SpecEngine(target, d, gamma=3, eos_token_ids=[-1]).generate(reqs)
        assert got["r0"].tokens == ref["r0"].tokens and got["r2"].tokens == ref["r2"].tokens


def _ref_logp(lm, ids: list[int], image: int, temperature: float) -> torch.Tensor:
    """log q by a full forward over ``ids`` (the text-only context): [V]."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].float()
    logits[image] = float("-inf")
    return torch.log_softmax(logits / (temperature or 1.0), -1)


@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_cache_holds_the_committed_context(kit, structure):
    """After rounds of random verdicts (whole, partial and no acceptance; rows joining and leaving; compaction),
    every node's q equals a full recompute over the committed text-only context plus the node's ancestors."""
    lm, image = kit["noisy"], kit["target"].config.image_token_id
    vocab = lm.config.vocab_size
    d = TextLMDrafter(model=lm, structure=structure, branching=[2, 2, 1], image_token_id=image,
                      kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0), quantize="none")
    reqs = requests(kit, 4, SamplingParams())
    temps = {"r0": 1.0, "r1": 0.0, "r2": 0.8, "r3": 1.0}
    rng = random.Random(0)

    def ctx(i):
        return DraftContext(f"r{i}", reqs[i].input_ids, first_token=rng.randrange(10, vocab),
                            temperature=temps[f"r{i}"], seed=i)

    d.begin([ctx(0), ctx(1), ctx(2)])
    live, seq_lens, full_accepts = ["r0", "r1", "r2"], [], 0
    for rnd in range(10):
        if rnd == 3:
            d.begin([ctx(3)])
            live.append("r3")
        if rnd == 6:
            d.release(["r0"])
            live.remove("r0")
        if rnd in (2, 7):  # a plain step (no proposal): the next token queues behind the unfed tail
            d.observe([Verdict(rid, (), (), rng.randrange(10, vocab)) for rid in live])
        prop = d.propose(live, gamma=rng.choice([1, 3, 4]))
        verdicts = []
        for b, rid in enumerate(live):
            n, context = prop.counts[b], d.context(rid)
            toks, parents, paths = node_paths(prop, b)
            assert image not in toks
            for i, path in enumerate(paths):
                ref = _ref_logp(lm, context + [toks[j] for j in path], image, temps[rid])
                if temps[rid] > 0:
                    got = prop.q[b, i].log()
                    torch.testing.assert_close(got.clamp_min(-50), ref.clamp_min(-50), atol=1e-4, rtol=0)
                else:  # greedy row: siblings are the top tokens in order, q one-hot
                    rank = [j for j in range(n) if parents[j] == parents[i]].index(i)
                    assert toks[i] == int(ref.topk(rank + 1).indices[rank])
                    assert prop.q[b, i, toks[i]] == 1.0
            path, cur = [], -1  # a random branch: stop anywhere, or accept it whole
            while (kids := [j for j in range(n) if parents[j] == cur]) and rng.random() < 0.8:
                cur = rng.choice(kids)
                path.append(cur)
            full_accepts += bool(n) and not [j for j in range(n) if parents[j] == cur]
            nxt = rng.choice([t for t in range(10, vocab) if t != image])
            verdicts.append(Verdict(rid, tuple(path), tuple(toks[j] for j in path), nxt))
        before = d._kv.seq_len
        d.observe(verdicts)
        seq_lens.append((before, d._kv.seq_len))
        for k, rid in enumerate(d._rows):  # the cache holds the committed context minus the tail, nothing else
            row = d._rows[rid]
            assert int(d._kv.valid[k].sum()) == len(row.context) - len(row.tail) == row.next_pos
    prompt = reqs[1].input_ids
    assert d.context("r1")[: int((prompt != image).sum())] == prompt[prompt != image].tolist()
    assert full_accepts > 0 and any(after < before for before, after in seq_lens)  # compaction happened


def test_tree_proposals_follow_the_sibling_law(kit):
    d = drafter(kit, structure="tree", branching=[3, 2, 1])
    reqs = requests(kit, 2, SamplingParams())
    d.begin([DraftContext(r.request_id, r.input_ids, first_token=7, temperature=1.0, seed=1) for r in reqs])
    prop = d.propose(["r0", "r1"], gamma=8)
    assert prop.tokens.shape == (2, 3 + 6 + 6) and prop.counts == (15, 15)
    assert prop.parents[0].tolist() == [-1] * 3 + [0, 0, 1, 1, 2, 2] + list(range(3, 9))
    for b in range(2):
        for p in range(-1, 9):
            kids = [i for i in range(15) if prop.parents[b, i] == p]
            assert len({int(prop.tokens[b, i]) for i in kids}) == len(kids)  # siblings distinct
            for i in kids[1:]:
                assert torch.equal(prop.q[b, i], prop.q[b, kids[0]])  # all drawn from the parent's q
    torch.testing.assert_close(prop.q.sum(-1), torch.ones(2, 15))
    assert prop.q[..., kit["target"].config.image_token_id].max() == 0
    with pytest.raises(ValueError, match="not observed"):
        d.propose(["r0"], gamma=2)
    with pytest.raises(ValueError, match="differ"):
        d.observe([Verdict("r0", (0,), (int(prop.tokens[0, 0]) + 1,), 5)])
    with pytest.raises(ValueError, match="not a branch"):
        d.observe([Verdict("r0", (3,), (int(prop.tokens[0, 3]),), 5)])
    d.observe([Verdict("r0", (1, 5), (int(prop.tokens[0, 1]), int(prop.tokens[0, 5])), 5), Verdict("r1", (), (), 6)])
    short = d.propose(["r1"], gamma=2)  # the tree is cut at gamma levels: no third level
    assert short.counts == (9,)


def test_siblings_without_mass_are_dropped(kit):
    """At a tiny temperature q is one-hot in fp32: a node gets one child, not three, and the tree is compacted."""
    reqs = requests(kit, 4, SamplingParams(temperature=1e-4, seed=0, max_tokens=16))
    d = drafter(kit, structure="tree", branching=[3, 2, 1])
    d.begin([DraftContext(r.request_id, r.input_ids, first_token=7, temperature=1e-4, seed=1) for r in reqs[:1]])
    prop = d.propose(["r0"], gamma=3)
    n = prop.counts[0]
    assert n == 3  # one child per level
    assert prop.parents[0, :n].tolist() == [-1, 0, 1] and (prop.tokens[0, :n] >= 0).all()
    torch.testing.assert_close(prop.q[0, :n].sum(-1), torch.ones(n))
    # through the engine: p is one-hot too, so the output is the greedy one
    ref = plain(kit, "target", requests(kit, 4, SamplingParams(max_tokens=16)), 4)
    target = load_target(kit["target"])
    got = SpecEngine(target, drafter(kit, structure="tree", branching=[3, 2, 1]), gamma=3,
                     eos_token_ids=eos(kit)).generate(reqs)
    assert {k: v.tokens for k, v in got.items()} == {k: v.tokens for k, v in ref.items()}


def test_a_chain_draws_what_the_level_loop_draws(kit):
    """Chains draw through ``_draw_chain`` (host bookkeeping, one feed per level) and propose exactly what the
    general level loop (``_draw_levels``) proposes: the same tokens, counts, q and seeded draws for sampled and greedy
    rows, chains cut by stop tokens, and the same state for drafting ahead (columns, chain, drawing rows), through
    joins, plain steps, compaction and calls that hold only some of the cache's rows."""
    reqs = mixed_requests(kit, 9, 3)
    probe = drafter(kit, stop_token_ids=[])
    probe.begin([DraftContext(f"r{i}", reqs[i].input_ids, first_token=7) for i in (0, 1)])
    stops = sorted(set(probe.propose(["r0", "r1"], gamma=4).tokens[:, 1:3].flatten().tolist()))  # drafted often
    runs = {}
    for chain_path in (True, False):
        target = load_target(kit["target"])
        d = drafter(kit, stop_token_ids=stops, kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0))
        d._chain_path = chain_path
        used, seen, propose, draw = [], [], d.propose, d._draw_chain
        d._draw_chain = lambda *a, draw=draw, used=used: used.append(1) or draw(*a)

        def record(ids, gamma, d=d, seen=seen, propose=propose):
            p = propose(ids, gamma)
            drafts = [d._rows[r].draft for r in ids]
            seen.append((p, [(x.tokens, x.cols, x.main, x.tip, x.closed, x.logits) for x in drafts]))
            return p

        d.propose = record
        compactions = churn(target, d, d, reqs, gamma=4, plain_steps=(3, 6))
        runs[chain_path] = (seen, len(used), compactions)
    (fast, n_fast, c_fast), (general, n_general, c_general) = runs[True], runs[False]
    assert len(fast) == len(general) == n_fast > 5 and n_general == 0 and c_fast == c_general > 0
    for (a, drafts_a), (b, drafts_b) in zip(fast, general):
        assert a.request_ids == b.request_ids and a.counts == b.counts and torch.equal(a.tokens, b.tokens)
        assert a.parents is None and b.parents is None
        assert (a.q is None) == (b.q is None) and (a.q is None or torch.equal(a.q, b.q))
        for (*state_a, logits_a), (*state_b, logits_b) in zip(drafts_a, drafts_b):
            assert state_a == state_b and len(logits_a) == len(logits_b)
            assert all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
    assert any(c < 4 for p, _ in fast for c in p.counts)  # a stop token ended some chain
    assert any(p.q is not None for p, _ in fast)
    # a call holding some of the cache's rows, out of order (the engine's calls hold them all)
    got = {}
    for chain_path in (True, False):
        d = drafter(kit, stop_token_ids=stops)
        d._chain_path = chain_path
        d.begin([DraftContext(f"r{i}", reqs[i].input_ids, first_token=7, temperature=t, seed=i)
                 for i, t in enumerate([1.0, 0.0, 0.8])])
        got[chain_path] = (d.propose(["r2", "r0"], gamma=4), d.propose(["r1"], gamma=4))
    for a, b in zip(got[True], got[False]):
        assert a.counts == b.counts and torch.equal(a.tokens, b.tokens)
        assert (a.q is None) == (b.q is None) and (a.q is None or torch.equal(a.q, b.q))


@pytest.mark.parametrize("chain_path", [True, False])
def test_a_stop_token_ends_its_branch(kit, chain_path):
    """A drafted stop token (EOS by default) has no successors: a chain ends there, a tree drops the stop node's
    subtree, ``extend`` does not grow past it, and drafting stops early once every branch has ended; greedy output
    still equals plain decoding. Chains both ways: their own path and the general level loop."""
    target = load_target(kit["target"])
    assert drafter(kit).stop_ids.tolist() == list(target.info.eos_token_ids)
    reqs = requests(kit, 2, SamplingParams(max_tokens=12))
    ctx = [DraftContext(r.request_id, r.input_ids, 5) for r in reqs]
    free = drafter(kit, stop_token_ids=[])
    free.begin(ctx)
    chain = free.propose(["r0", "r1"], gamma=5)
    assert chain.counts == (5, 5)
    stop = int(chain.tokens[0, 1])  # row 0's second draft becomes a stop token
    cut = drafter(kit, stop_token_ids=[stop])
    cut._chain_path = chain_path
    cut.begin(ctx)
    forwards = []
    feed = cut._forward
    cut._forward = lambda *a: forwards.append(1) or feed(*a)
    got = cut.propose(["r0", "r1"], gamma=5)
    forwards.pop()  # the tails' feed
    row1 = chain.tokens[1, :5].tolist()
    n1 = row1.index(stop) + 1 if stop in row1 else 5
    assert got.counts == (2, n1)
    assert got.tokens[0, :2].tolist() == chain.tokens[0, :2].tolist()
    assert got.tokens[1, :n1].tolist() == row1[:n1]
    assert len(forwards) == (1 if n1 == 2 else 4)  # no level is fed once every branch has ended
    assert cut.extend(["r0"], 3).counts == (0,)  # nothing grows past the stop token
    # a tree: no node below a stop token
    tree = drafter(kit, structure="tree", branching=[2, 2, 1], stop_token_ids=[stop])
    tree.begin(ctx)
    prop = tree.propose(["r0", "r1"], gamma=3)
    for b in range(2):
        toks, parents, _ = node_paths(prop, b)
        assert all(p < 0 or toks[p] != stop for p in parents)
    ref = plain(kit, "target", reqs, 2)
    eng = SpecEngine(target, drafter(kit, stop_token_ids=[stop]), gamma=4, eos_token_ids=eos(kit))
    assert_equals_plain(eng, reqs, ref, 2)


def test_a_seed_reproduces_the_drafts_whatever_the_batch(kit):
    reqs = requests(kit, 3, SamplingParams())

    def drafts(ids):
        d = drafter(kit, structure="tree")
        d.begin([DraftContext(r.request_id, r.input_ids, first_token=9, temperature=1.0, seed=5 + int(r.request_id[1:]))
                 for r in reqs if r.request_id in ids])
        p = d.propose(ids, gamma=3)
        return p.tokens[ids.index("r0")].tolist()

    assert drafts(["r0"]) == drafts(["r1", "r0", "r2"])


def test_bad_config_is_refused(kit, tmp_path):
    lm = kit["noisy"]
    for opts, match in [({"structure": "graph"}, "structure"), ({"branching": 0}, "branching"),
                        ({"branching": []}, "branching"), ({"depth": 0}, "depth"), ({"seed": -1}, "seed"),
                        ({"gamma_max": 3}, "unknown options"),
                        ({"dtype": "float33"}, "dtype"), ({"stop_token_ids": "2"}, "stop_token_ids"),
                        ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"lean": 1}, "lean")]:
        with pytest.raises(ValueError, match=match):
            create({"kind": "text_lm", "model": lm, "image_token_id": 3, **opts})
    with pytest.raises(ValueError, match="image_token_id"):
        create({"kind": "text_lm", "model": lm})
    small = LlamaForCausalLM(lm.config.__class__(**{**lm.config.to_dict(), "vocab_size": 100}))
    with pytest.raises(ValueError, match="vocabulary"):
        create({"kind": "text_lm", "model": small}, target=load_target(kit["target"]))
    kit["target"].save_pretrained(tmp_path / "llava")
    with pytest.raises(ValueError, match="not a causal LM"):
        create({"kind": "text_lm", "path": str(tmp_path / "llava"), "image_token_id": 3})
    with pytest.raises(FileNotFoundError):
        create({"kind": "text_lm", "path": str(tmp_path / "nowhere"), "image_token_id": 3})


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_sampled_tokens_follow_the_target(kit, structure):
    """The shared distribution check (exact joint of the first 3 tokens) on a text-only prompt, where the drafter
    is close to p."""
    base = requests(kit, 1, SamplingParams(), start=2)[0]
    target = load_target(kit["target"])
    d = create({"kind": "text_lm", "model": kit["noisy"], "structure": structure, "branching": [2, 1], "seed": 3},
               target=target)
    assert_follows_the_target(kit["target"], d, base, target=target, max_tokens=4 if structure == "chain" else 6)