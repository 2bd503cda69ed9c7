"""text_lm as a DrafterServer drives it: one call per request (each session in turn), other rows' proposals still
outstanding, chains drafted ahead (``extend`` / ``observe_ahead``). Compaction must not wait for a moment with no
proposal outstanding (with sessions drafting ahead there is none, and the cache grew without bound): it renumbers
the outstanding drafts' columns, and every q stays exactly a full recompute over the committed context.
"""

from __future__ import annotations

import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specula.drafters import DraftContext, Verdict
from specula.drafters.text_lm import TextLMDrafter
from specula.targets.kv import KVPolicy

IMAGE, VOCAB = 63, 64


def _lm() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024)
    lm = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # lively logits: q far from uniform, so a wrong column shows
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return lm


def _compacting_chain(lm) -> TextLMDrafter:
    """A chain text_lm that compacts its cache as soon as any column is reclaimable (so every test exercises it)."""
    return TextLMDrafter(model=lm, structure="chain", image_token_id=IMAGE,
                         kv_policy=KVPolicy(min_waste=4, waste_ratio=0.0), quantize="none")  # recomputes: fp32


def _ref_logp(lm, ids: list[int]) -> torch.Tensor:
    """log q at temperature 1 by a full forward over ``ids`` (the text-only context): [V]."""
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([ids])).logits[0, -1].float()
    logits[IMAGE] = float("-inf")
    return torch.log_softmax(logits, -1)


def _check(lm, d: TextLMDrafter, rid: str, prefix: list[int], tokens: list[int], q) -> None:
    """Node i of ``tokens`` (after ``prefix``, the row's outstanding chain before them) has q[0, i] = recompute."""
    if not tokens:
        return
    context = d.context(rid) + prefix
    for i, t in enumerate(tokens):
        ref = _ref_logp(lm, context + tokens[:i])
        torch.testing.assert_close(q[0, i].log().clamp_min(-50), ref.clamp_min(-50), atol=1e-4, rtol=0)


def test_compaction_with_drafts_outstanding_keeps_every_q_exact():
    lm = _lm()
    d = _compacting_chain(lm)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    rows = [f"r{i}" for i in range(3)]
    d.begin([DraftContext(rid, torch.randint(0, IMAGE, (5 + 4 * i,), generator=g), first_token=rng.randrange(IMAGE),
                          temperature=1.0, seed=i) for i, rid in enumerate(rows)])
    shrank_with_outstanding = 0
    longest = 0
    for _ in range(12):
        for rid in rows:  # each session in turn: a proposal (unless one is outstanding), then drafting ahead
            if d._rows[rid].draft is None:  # noqa: SLF001
                p = d.propose([rid], gamma=rng.randrange(1, 4))
                n = p.counts[0]
                _check(lm, d, rid, [], p.tokens[0, :n].tolist(), p.q)
            chain = list(d._rows[rid].draft.tokens)  # noqa: SLF001
            p = d.extend([rid], rng.randrange(0, 4))
            n = p.counts[0]
            _check(lm, d, rid, chain, p.tokens[0, :n].tolist(), p.q)
        for rid in rows:  # verdicts one at a time: the others' proposals are outstanding meanwhile
            chain = list(d._rows[rid].draft.tokens)  # noqa: SLF001
            k = rng.randrange(0, len(chain))
            before = d._kv.seq_len  # noqa: SLF001
            if rng.random() < 0.5:  # accepted k nodes, the next token is node k: the rest stays outstanding
                d.observe_ahead([Verdict(rid, tuple(range(k)), tuple(chain[:k]), chain[k])])
            else:
                nxt = rng.choice([t for t in range(IMAGE) if t != chain[k]])
                d.observe([Verdict(rid, tuple(range(k)), tuple(chain[:k]), nxt)])
            outstanding = any(r.draft is not None for r in d._rows.values())  # noqa: SLF001
            shrank_with_outstanding += outstanding and d._kv.seq_len < before  # noqa: SLF001
            longest = max(longest, d._kv.seq_len)  # noqa: SLF001
            for i, r in enumerate(d._rows.values()):  # noqa: SLF001 - the valid slots: committed + fed drafts
                fed = [c for c in (r.draft.cols if r.draft else []) if c >= 0]
                assert int(d._kv.valid[i].sum()) == len(r.context) - len(r.tail) + len(fed)  # noqa: SLF001
                assert all(bool(d._kv.valid[i, c]) for c in fed)  # noqa: SLF001
    assert shrank_with_outstanding > 0
    most = max(len(r.context) + len(r.draft.tokens if r.draft else []) for r in d._rows.values())  # noqa: SLF001
    assert longest <= most + 3 * 8 + 4  # holes never outlive a round of calls (before: every call grew it)
    d.release(rows)
    assert d._kv.cache is None and not d._rows  # noqa: SLF001


def _invariant(d: TextLMDrafter) -> None:
    """Valid slots per row = committed context minus tail + every fed draft node (main chain and branches)."""
    for i, r in enumerate(d._rows.values()):  # noqa: SLF001
        fed = [c for c in (r.draft.cols if r.draft else []) if c >= 0]
        assert int(d._kv.valid[i].sum()) == len(r.context) - len(r.tail) + len(fed)  # noqa: SLF001


def test_branches_for_rejection_outcomes_draft_exactly_and_a_matching_verdict_adopts_one():
    """Predraft (SSD / Saguaro): after the chain and its extension, branches open at the drafter's most likely
    rejection outcomes (k, t); each branch's nodes have q = a full recompute over context + d_<k + t (so the main
    chain past k and other branches are invisible to them); a verdict landing on a branch makes its nodes the
    proposal, and drafting on from there stays exact."""
    lm = _lm()
    rng = random.Random(3)
    gamma = 3
    for temperature in (1.0, 0.0):
        d = _compacting_chain(lm)
        assert d.predraft
        g = torch.Generator().manual_seed(5)
        d.begin([DraftContext("r", torch.randint(0, IMAGE, (7,), generator=g), first_token=3,
                              temperature=temperature, seed=1)])
        landed = 0
        for _ in range(6):
            p = d.propose(["r"], gamma + 1)
            chain = p.tokens[0, : p.counts[0]].tolist()
            ahead = d.extend(["r"], gamma + 1)
            _check_or_argmax(lm, d, chain, ahead, temperature)
            branches = {}
            for _ in range(4):
                opened = d.branch([("r", gamma)])[0]
                assert opened is not None and opened not in branches
                k, t = opened
                assert 0 <= k <= gamma and t != chain[k] and t != IMAGE
                nodes = d.extend(["r"], 3)
                _check_or_argmax(lm, d, chain[:k] + [t], nodes, temperature)
                branches[opened] = nodes.tokens[0, : nodes.counts[0]].tolist()
                _invariant(d)
            (k, t), nodes = rng.choice(sorted(branches.items()))
            if rng.random() < 0.75:
                context = d.context("r") + chain[:k] + [t]
                d.observe_ahead([Verdict("r", tuple(range(k)), tuple(chain[:k]), t)])
                landed += 1
                assert d.context("r") == context
                assert d._rows["r"].draft.tokens == nodes  # noqa: SLF001 - the branch is the proposal now
                more = d.extend(["r"], 2)  # drafting on from the adopted branch
                _check_or_argmax(lm, d, nodes, more, temperature)
                _invariant(d)
                d.observe([Verdict("r", (), (), rng.randrange(IMAGE))])  # then a plain miss
            else:  # an outcome nobody drafted for: every branch goes with the rest
                miss = next(x for x in range(IMAGE) if x != chain[k] and (k, x) not in branches)
                d.observe([Verdict("r", tuple(range(k)), tuple(chain[:k]), miss)])
            _invariant(d)
        assert landed > 0
        d.release(["r"])
        assert d._kv.cache is None  # noqa: SLF001


def _check_or_argmax(lm, d: TextLMDrafter, prefix: list[int], p, temperature: float) -> None:
    """Sampled rows: each node's q is the full recompute (``_check``); greedy rows: each node is its argmax."""
    tokens = p.tokens[0, : p.counts[0]].tolist()
    if temperature > 0:
        _check(lm, d, "r", prefix, tokens, p.q)
        return
    assert p.q is None
    for i, t in enumerate(tokens):
        assert int(_ref_logp(lm, d.context("r") + prefix + tokens[:i]).argmax()) == t


def test_grow_drafts_every_open_chain_side_by_side_exactly():
    """Lockstep predraft: branches opened right after the proposal, then ``grow`` adds one node to the main chain
    past the guess and to every branch per call (one forward). Each chain's nodes have q = a full recompute over
    context + its own prefix (the other chains' nodes, fed in the same forwards, stay invisible to it), inserting
    main nodes keeps the branches' bookkeeping, and a verdict landing on any chain adopts exactly its nodes."""
    lm = _lm()
    rng = random.Random(7)
    gamma = 3
    for temperature in (1.0, 0.0):
        d = _compacting_chain(lm)
        g = torch.Generator().manual_seed(9)
        d.begin([DraftContext("r", torch.randint(0, IMAGE, (6,), generator=g), first_token=5,
                              temperature=temperature, seed=2)])
        landed = {"main": 0, "branch": 0}
        for _ in range(6):
            p = d.propose(["r"], gamma + 1)
            chain = p.tokens[0, : p.counts[0]].tolist()
            opened = d.branch([("r", gamma)] * 3)
            assert len(set(opened)) == 3 and None not in opened
            chains: dict = {None: ([], []), **{o: ([], []) for o in opened}}
            for _ in range(gamma + 1):
                nodes = d.grow(["r"])[0]
                assert len(nodes) <= 4
                for outcome, tok, q in nodes:
                    chains[outcome][0].append(tok)
                    chains[outcome][1].append(q)
                _invariant(d)
            assert d._rows["r"].draft.tokens[: len(chain) + len(chains[None][0])] == chain + chains[None][0]  # noqa: SLF001
            for outcome, (toks, qs) in chains.items():
                prefix = chain if outcome is None else chain[: outcome[0]] + [outcome[1]]
                if temperature > 0:
                    q = torch.stack(qs)[None] if toks else None
                    _check(lm, d, "r", prefix, toks, q)
                else:
                    assert all(q is None for q in qs)
                    for i, t in enumerate(toks):
                        assert int(_ref_logp(lm, d.context("r") + prefix + toks[:i]).argmax()) == t
            outcome = rng.choice(list(chains))
            if outcome is None:  # every node accepted, the bonus token is the guess
                k, t = gamma, chain[gamma]
            else:
                k, t = outcome
            context = d.context("r") + chain[:k] + [t]
            d.observe_ahead([Verdict("r", tuple(range(k)), tuple(chain[:k]), t)])
            landed["main" if outcome is None else "branch"] += 1
            assert d.context("r") == context
            assert d._rows["r"].draft.tokens == chains[outcome][0]  # noqa: SLF001 - its nodes are the proposal
            _invariant(d)
            d.observe([Verdict("r", (), (), rng.randrange(IMAGE))])
            _invariant(d)
        assert landed["branch"] > 0
        d.release(["r"])
        assert d._kv.cache is None  # noqa: SLF001


def test_grow_draws_the_same_nodes_alone_or_batched_with_a_row_of_more_lanes():
    """A seeded sampled row consumes draws for its own lanes only, so batching it with a row that opened more
    branches does not change what it drafts."""
    lm = _lm()
    g = torch.Generator().manual_seed(4)
    prompts = {"a": torch.randint(0, IMAGE, (6,), generator=g), "b": torch.randint(0, IMAGE, (9,), generator=g)}
    branches = {"a": 1, "b": 3}

    def run(rows: list[str]) -> dict:
        d = TextLMDrafter(model=lm, structure="chain", image_token_id=IMAGE, quantize="none")
        d.begin([DraftContext(r, prompts[r], first_token=4, temperature=1.0, seed=21 + i) for i, r in
                 enumerate(sorted(prompts)) if r in rows])
        for r in rows:
            d.propose([r], 4)
            d.branch([(r, 3)] * branches[r])
        out = {r: [] for r in rows}
        for _ in range(4):
            for r, nodes in zip(rows, d.grow(rows)):
                out[r] += [(o, t) for o, t, _ in nodes]
        return out

    together = run(["a", "b"])
    assert together["a"] == run(["a"])["a"] and together["b"] == run(["b"])["b"]
    assert len({o for o, _ in together["b"]}) == 4  # b really grew its main chain and three branches
