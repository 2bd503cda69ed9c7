"""The model-level drafters (``massv``, ``pooled``, ``caption``, ``ensemble``) on a small random LLaVA target with
the world's tokenizer and real world prompts.

The drafter model is the target's own language model plus a projector holding the target's projector weights
(``copy``: the multimodal member *is* the target, so every greedy draft is accepted) or a noisy version of both
(``noisy``: partly right), reading the target's pre-projector features. Greedy output must equal plain decoding
for every kind, chain and tree, batch 1 and 4; the ensemble's q must be the weighted mixture of its members'
distributions (checked against full recomputes of each member's context); all member rows of all requests run as
one batched forward per draft level; sampled output must follow the target (slow, chi-square).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch
from drafter_kit import (assert_equals_plain, assert_follows_the_target, eos, lively_target, node_paths, plain, requests)
from transformers import LlamaForCausalLM

from specula.drafters import DraftContext, Drafter, Verdict, create, kinds
from specula.drafters.ensemble import EnsembleDrafter
from specula.drafters.massv_model import MassvConfig, MassvModel, pool_features
from specula.drafters.protocol import supports_lookahead, supports_predraft
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.mixture import mix_distributions
from specula.runtime.core.sampling import SamplingParams
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.world.tokenizer import format_turns
from specula.zoo.store import TOKENIZER_DIR

KINDS = ["massv", "pooled", "caption", "ensemble"]


def massv_from_target(model, processor, noise: float = 0.0, seed: int = 0) -> MassvModel:
    """The target's LM and projector as a MassvModel over its pre-projector features (+ noise)."""
    tok = processor.tokenizer
    lm = LlamaForCausalLM(model.config.text_config)
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.tie_weights()
    image = model.config.image_token_id
    prompt = tuple(tok(format_turns("<image>Describe the image in detail."), add_special_tokens=False).input_ids)
    cfg = MassvConfig(feature_dim=model.config.vision_config.hidden_size, image_token_id=image,
                      caption_prompt=prompt, caption_max_tokens=12, eos_token_id=tok.eos_token_id)
    m = MassvModel(lm, cfg)
    proj = model.model.multi_modal_projector
    m.projector[0].load_state_dict(proj.linear_1.state_dict())
    m.projector[2].load_state_dict(proj.linear_2.state_dict())
    if noise:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)
    return m.eval()


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    model = lively_target(processor)
    return {"target": model, "processor": processor, "copy": massv_from_target(model, processor),
            "noisy": massv_from_target(model, processor, noise=0.015)}


def drafter(kit, kind: str = "ensemble", lm: str = "noisy", **opts) -> EnsembleDrafter:
    opts = {"quantize": "none", **opts}  # exact recomputes and exact copies: the stock fp32 weights
    if kind == "ensemble":  # the mixture's own checks: every member from the first block (IbED)
        opts.setdefault("join", "at_once")
    return create({"kind": kind, "model": kit[lm], **opts}, target=load_target(kit["target"]))


def test_kinds_are_registered_with_their_needs(kit):
    assert {"massv", "pooled", "caption", "ensemble"} <= set(kinds())
    for kind in KINDS:
        d = drafter(kit, kind)
        assert isinstance(d, Drafter) and d.spec.kind == kind and d.spec.needs == {"pre_projector"}
    assert [m.name for m in drafter(kit).members] == ["multimodal", "text", "caption", "pooled36"]
    assert drafter(kit, "ensemble", members=["text"]).spec.needs == frozenset()


@pytest.mark.parametrize("structure", ["chain", "tree"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_decoding(kit, kind, structure):
    reqs = requests(kit, 8, SamplingParams(max_tokens=16))
    ref = plain(kit, "target", reqs, 4)
    target = load_target(kit["target"])
    lm = "copy" if kind == "massv" else "noisy"
    d = drafter(kit, kind, lm, structure=structure, branching=[2, 2, 1])
    t = assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 4)
    assert t.accepted > 0  # drafts were accepted, not only rejected
    if kind == "massv" and structure == "chain":  # the copy is the target: every draft holds (features wired right)
        assert t.accepted == t.drafted
    assert not target.live_ids and not d._rows and not d._groups_of  # every row released on both sides


def test_ensemble_greedy_batch_one_and_mixed_temperatures(kit):
    reqs = requests(kit, 4, SamplingParams(max_tokens=12))
    ref = plain(kit, "target", reqs, 1)
    target = load_target(kit["target"])
    eng = SpecEngine(target, drafter(kit, weights=[3, 1, 1, 2]), gamma=3, eos_token_ids=eos(kit))
    for r in reqs:
        assert eng.generate([r])[r.request_id].tokens == ref[r.request_id].tokens
    temps = [0.0, 1.0, 0.0, 0.7]
    mixed = requests(kit, 4, [SamplingParams(temperature=t, seed=i, max_tokens=12) for i, t in enumerate(temps)])
    got = SpecEngine(target, drafter(kit, structure="tree"), gamma=3, eos_token_ids=[-1]).generate(mixed)
    ref = plain(kit, "target", requests(kit, 4, SamplingParams(max_tokens=12)), 4)
    assert got["r0"].tokens[:len(ref["r0"].tokens)] == ref["r0"].tokens
    assert got["r2"].tokens[:len(ref["r2"].tokens)] == ref["r2"].tokens


def _member_logp(m: MassvModel, tokens: list[int], visual, image: int, temperature: float) -> torch.Tensor:
    """softmax(logits / T) of one member context by a full forward: [V] probabilities."""
    with torch.no_grad():
        ids = torch.tensor([tokens])
        emb = m.embed(ids, [visual])
        hidden = m.lm.model(inputs_embeds=emb).last_hidden_state[0, -1]
        logits = m.lm.lm_head(hidden).float()
    logits[image] = float("-inf")
    return torch.softmax(logits / temperature, -1)


def _contexts(kit, reqs, temperature, feats_of):
    return [DraftContext(r.request_id, r.input_ids, first_token=7, temperature=temperature, seed=3,
                         extra={"pre_projector": feats_of(r)} if r.pixel_values is not None else {})
            for r in reqs]


def _expected_weights(prior: list[float], loglik: list[float], floor: float = 0.1) -> list[float]:
    """The adapted weights written out (Bayesian posterior over members, mixed with the prior by ``floor``)."""
    base = [w / sum(prior) for w in prior]
    post = [b * math.exp(ll - max(loglik)) for b, ll in zip(base, loglik)]
    return [(1 - floor) * p / sum(post) + floor * b for p, b in zip(post, base)]


@pytest.mark.parametrize("adapt", [True, False])
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_q_is_the_weighted_mixture_of_the_members(kit, structure, adapt):
    """Every node's q equals mix_distributions of each member's q over its own context + the node's ancestors,
    with the configured weights (``adapt=0``) or with weights adapted to each member's likelihood of the tokens
    committed so far, both recomputed here from full forwards of every member's context."""
    target = load_target(kit["target"])
    m = kit["noisy"]
    image = kit["target"].config.image_token_id
    weights = [3.0, 1.0, 1.0, 2.0]
    d = drafter(kit, structure=structure, branching=[2, 1], weights=weights, grid=3, adapt=1.0 if adapt else 0,
                prune_below=0)  # every member stays (pruning: test_after_pruning_q_is_the_mixture_of_the_members_left)
    reqs = requests(kit, 2, SamplingParams(), suites=["multi_image", "chart"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features for r in reqs}
    d.begin(_contexts(kit, reqs, 0.8, lambda r: feats[r.request_id]))

    def member_q(rid, j, member, extra, drop_last=False):
        f = feats[rid]
        vis = {"multimodal": f.reshape(-1, f.shape[-1]),
               "pooled": pool_features(f, (3, 3)).reshape(-1, f.shape[-1])}.get(member.kind)
        ctx = d.context(rid, j)
        return _member_logp(m, (ctx[:-1] if drop_last else ctx) + extra, vis, image, 0.8)

    # the first token (7, the target's) is the first point each member is scored on
    loglik = {rid: [math.log(float(member_q(rid, j, mb, [], drop_last=True)[7])) if adapt else 0.0
                    for j, mb in enumerate(d.members)] for rid in ("r0", "r1")}

    for rnd in range(3):
        prop = d.propose(["r0", "r1"], gamma=3)
        verdicts = []
        for b, rid in enumerate(["r0", "r1"]):
            toks, _, paths = node_paths(prop, b)
            want_w = _expected_weights(weights, loglik[rid]) if adapt else weights
            torch.testing.assert_close(torch.tensor(d.member_weights(rid)),
                                       torch.tensor(want_w) / sum(want_w), atol=1e-6, rtol=1e-5)
            for i, path in enumerate(paths):
                qs = [member_q(rid, j, member, [toks[k] for k in path]) for j, member in enumerate(d.members)]
                want = mix_distributions(qs, want_w)
                torch.testing.assert_close(prop.q[b, i], want, atol=2e-5, rtol=1e-4)
            kept = [toks[k] for k in path[:rnd % 2]]  # nothing accepted, then the first node, ...
            for j, member in enumerate(d.members):  # each committed token (and the next one) under each member
                for n, t in enumerate(kept + [11]):
                    loglik[rid][j] += math.log(float(member_q(rid, j, member, kept[:n])[t]))
            verdicts.append(Verdict(rid, tuple(path[:rnd % 2]), tuple(kept), 11))
        d.observe(verdicts)
    # the members really differ: the mixture is not any one of them, and the weights moved
    assert len({len(d.context("r0", j)) for j in range(4)}) == 4
    assert (max(loglik["r0"]) - min(loglik["r0"]) > 0.1) and (d.member_weights("r0") != [w / 7 for w in weights]) \
        == adapt


@pytest.mark.parametrize("members,suites", [(["multimodal"], ["chart", "caption"]), (None, ["text", "text"])])
def test_one_row_per_request_draws_from_that_row_s_own_distribution(kit, members, suites):
    """When every request of a call has one row (a one-member ensemble, as massv is; or requests without images,
    which keep one context) the ensemble skips the mixture: each node's q must still be that row's own softmax
    over its context + the node's ancestors, without the image token, and a greedy draft its argmax."""
    target = load_target(kit["target"])
    m = kit["noisy"]
    image = kit["target"].config.image_token_id
    reqs = requests(kit, 2, SamplingParams(), suites=suites)
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features
             for r in reqs if r.pixel_values is not None}
    for temperature in (0.8, 0.0):
        d = drafter(kit, adapt=0, **({} if members is None else {"members": members}))
        d.begin(_contexts(kit, reqs, temperature, lambda r: feats[r.request_id]))
        assert all(len(d._keys(rid)) == 1 for rid in ("r0", "r1"))  # the shortcut's case
        for rnd in range(2):
            prop = d.propose(["r0", "r1"], gamma=3)
            verdicts = []
            for b, rid in enumerate(["r0", "r1"]):
                toks, _, paths = node_paths(prop, b)
                f = feats.get(rid)
                vis = None if f is None else f.reshape(-1, f.shape[-1])
                for i, path in enumerate(paths):
                    want = _member_logp(m, d.context(rid, 0) + [toks[k] for k in path], vis, image, temperature or 1.0)
                    if temperature:
                        torch.testing.assert_close(prop.q[b, i], want, atol=2e-5, rtol=1e-4)
                    else:
                        assert toks[i] == int(want.argmax()) != image
                verdicts.append(Verdict(rid, (0,) if rnd else (), tuple(toks[:1]) if rnd else (), 11))
            d.observe(verdicts)


def test_member_rows_run_as_one_batched_forward(kit):
    """Requests x members are the rows of one forward per draft level (a text-only request has one row)."""
    target = load_target(kit["target"])
    d = drafter(kit)
    reqs = requests(kit, 3, SamplingParams(), suites=["vqa", "text", "multi_image"])
    d.begin(_contexts(kit, reqs, 1.0, lambda r: target.encode_images(r.pixel_values, "pre_projector").features))
    assert [len(d._groups_of[r.request_id]) for r in reqs] == [4, 1, 4]
    calls = []
    forward = d._forward

    def counted(tokens, *args):
        calls.append(tokens.shape[0])
        return forward(tokens, *args)

    d._forward = counted  # every draft level's one model call (lean or stock) goes through it
    prop = d.propose(["r0", "r1", "r2"], gamma=5)
    assert calls == [9] * 5  # chain: the tail feed + 4 levels (the last node is never fed), all 9 rows each time
    assert prop.tokens.shape[0] == 3 and prop.q.shape[:2] == (3, 5)
    # every member row holds the same drafts
    for r in ("r0", "r2"):
        drafts = [d._rows[k].draft.tokens for k in d._groups_of[r]]
        assert all(x == drafts[0] for x in drafts)


def test_drafting_ahead_equals_drafting_in_one_go(kit):
    """``extend`` grows every request's chain from its mixture with all member rows in lockstep: gamma + n nodes
    drafted as propose(gamma) then extend(n) are the nodes (and the q) of one propose(gamma + n); after
    ``observe_ahead`` (a prefix accepted, the target's token = the next node) the rest stays the outstanding chain,
    and drafting on from it equals a drafter that observed the same verdict and proposed afresh (with fixed
    weights: adapted ones move at the verdict, after the nodes drafted ahead were drawn)."""
    target = load_target(kit["target"])
    feats = lambda r: target.encode_images(r.pixel_values, "pre_projector").features  # noqa: E731
    reqs = requests(kit, 3, SamplingParams(), suites=["vqa", "text", "multi_image"])
    ahead, once = drafter(kit, grid=3, adapt=0), drafter(kit, grid=3, adapt=0)
    assert supports_lookahead(ahead) and supports_predraft(ahead)
    ids = [r.request_id for r in reqs]
    for temperature in (0.0, 1.0):
        for d in (ahead, once):
            d.begin(_contexts(kit, reqs, temperature, feats))
        a = ahead.propose(ids, gamma=2)
        b = ahead.extend(ids, 3)
        c = once.propose(ids, gamma=5)
        assert a.counts == (2, 2, 2) and b.counts == (3, 3, 3) and c.counts == (5, 5, 5)
        assert torch.equal(torch.cat([a.tokens, b.tokens], 1), c.tokens)
        if temperature > 0:
            torch.testing.assert_close(torch.cat([a.q, b.q], 1), c.q, atol=1e-5, rtol=1e-4)
        chain = c.tokens.tolist()
        ahead.observe_ahead([Verdict(rid, (0, 1), tuple(chain[i][:2]), chain[i][2]) for i, rid in enumerate(ids)])
        once.observe([Verdict(rid, (0, 1), tuple(chain[i][:2]), chain[i][2]) for i, rid in enumerate(ids)])
        more = ahead.extend(ids, 2)  # the outstanding chain was nodes 3, 4: two more after them
        fresh = once.propose(ids, gamma=4)  # (sampled rows draw anew: only greedy drafts must coincide)
        assert more.counts == (2, 2, 2)
        if temperature == 0:
            assert torch.equal(torch.cat([c.tokens[:, 3:], more.tokens], 1), fresh.tokens)
        assert all(ahead.context(rid, j) == once.context(rid, j) for rid in ids
                   for j in range(len(ahead._groups_of[rid])))
        with pytest.raises(ValueError, match="unknown request"):
            ahead.branch([("nobody", 0)])
        for d in (ahead, once):
            d.release(ids)


def test_weights_learnt_from_a_block_drafted_ahead_equal_those_of_a_plain_verdict(kit):
    """``observe_ahead`` learns from a verdict on a chain grown by ``extend`` exactly what ``observe`` learns from
    the same verdict on one proposal of the same nodes; a member the tokens favour gains weight."""
    target = load_target(kit["target"])
    feats = lambda r: target.encode_images(r.pixel_values, "pre_projector").features  # noqa: E731
    reqs = requests(kit, 2, SamplingParams(), suites=["caption", "multi_image"])
    ids = [r.request_id for r in reqs]
    ahead, once = drafter(kit, grid=3, prune_below=0), drafter(kit, grid=3, prune_below=0)
    for d in (ahead, once):
        d.begin(_contexts(kit, reqs, 0.0, feats))
    ahead.propose(ids, gamma=2)
    ahead.extend(ids, 3)
    chain = once.propose(ids, gamma=5).tokens.tolist()
    verdicts = [Verdict(rid, (0, 1), tuple(chain[i][:2]), chain[i][2]) for i, rid in enumerate(ids)]
    ahead.observe_ahead(verdicts)
    once.observe(verdicts)
    for rid in ids:
        got, want = ahead.member_weights(rid), once.member_weights(rid)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-4)
        assert got != [0.25] * 4 and abs(sum(got) - 1) < 1e-6
    with pytest.raises(ValueError, match="unknown request"):
        ahead.member_weights("nobody")


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_rejection_branches_draw_from_the_mixture_and_a_matching_verdict_adopts_one(kit, temperature):
    """Predraft for the ensemble: ``branch`` opens the same rejection outcome (k, t) on every member row of a
    request, ``grow`` draws each lane's next node once from the request's mixture (every member row gets it), and
    each node's q is the mixture of the members' distributions over their own contexts + the lane's prefix,
    recomputed here by full forwards (greedy: the mixture's argmax); a verdict landing on a branch adopts its
    nodes in every member row."""
    target = load_target(kit["target"])
    m = kit["noisy"]
    image = kit["target"].config.image_token_id
    d = drafter(kit, grid=3)
    reqs = requests(kit, 2, SamplingParams(), suites=["caption", "multi_image"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features for r in reqs}
    d.begin(_contexts(kit, reqs, temperature, lambda r: feats[r.request_id]))
    ids = ["r0", "r1"]

    def mixture(rid, prefix):
        f = feats[rid]
        qs = []
        for j, member in enumerate(d.members):
            vis = {"multimodal": f.reshape(-1, f.shape[-1]),
                   "pooled": pool_features(f, (3, 3)).reshape(-1, f.shape[-1])}.get(member.kind)
            qs.append(_member_logp(m, d.context(rid, j) + prefix, vis, image, temperature or 1.0))
        return mix_distributions(qs, d.member_weights(rid))

    prop = d.propose(ids, gamma=3)
    chains = {rid: prop.tokens[b, : prop.counts[b]].tolist() for b, rid in enumerate(ids)}
    opened = d.branch([(rid, 2) for rid in ids])
    for rid, o in zip(ids, opened):
        assert o is not None and 0 <= o[0] <= 2 and o[1] != chains[rid][o[0]]
        # the outcome opened is the likeliest under the mixture: P(d_0 .. d_{k-1}) * P_k(t), recomputed here
        best, reach = None, 1.0
        for k in range(3):
            mix = mixture(rid, chains[rid][:k])
            for t in mix.topk(6).indices.tolist():
                if t != chains[rid][k] and (best is None or reach * float(mix[t]) > best[0]):
                    best = (reach * float(mix[t]), k, t)
            reach *= float(mix[chains[rid][k]])
        assert o == best[1:], (o, best)
    lanes = {rid: {None: list(chains[rid]), o: chains[rid][: o[0]] + [o[1]]} for rid, o in zip(ids, opened)}
    for _ in range(2):
        for rid, nodes in zip(ids, d.grow(ids)):
            assert nodes and {o for o, _, _ in nodes} <= set(lanes[rid])
            for outcome, tok, q in nodes:
                want = mixture(rid, lanes[rid][outcome])
                if temperature > 0:
                    torch.testing.assert_close(q, want, atol=2e-5, rtol=1e-4)
                else:
                    assert q is None and tok == int(want.argmax())
                lanes[rid][outcome].append(tok)
        for rid in ids:  # every member row holds the same drafts
            drafts = [(d._rows[k].draft.tokens, d._rows[k].draft.parents) for k in d._groups_of[rid]]
            assert all(x == drafts[0] for x in drafts)
    k, t = opened[0]
    before = [d.context("r0", j) for j in range(4)]
    d.observe_ahead([Verdict("r0", tuple(range(k)), tuple(chains["r0"][:k]), t)])
    for j in range(4):  # the branch is every member row's proposal now
        assert d.context("r0", j) == before[j] + chains["r0"][:k] + [t]
        assert d._rows[d._groups_of["r0"][j]].draft.tokens == lanes["r0"][(k, t)][k + 1:]
    d.observe([Verdict("r0", (), (), 11), Verdict("r1", (), (), 11)])  # then plain misses
    assert d.propose(ids, gamma=2).counts == (2, 2)
    d.release(ids)
    assert not d._rows


@pytest.mark.parametrize("cache", [256, 1, 0])
def test_an_image_seen_before_takes_its_caption_from_the_cache(kit, cache, monkeypatch):
    """The same image in later requests (a chat re-sends it every turn) is captioned once while it stays in the
    LRU cache of ``caption_cache`` images, and the cached caption is the one the captioner makes; 0 turns it off."""
    target = load_target(kit["target"])
    d = drafter(kit, "caption", caption_cache=cache)
    made = []
    real = d.captioner.caption
    monkeypatch.setattr(d.captioner, "caption", lambda f, n=None, **kw: made.append(f.shape[0]) or real(f, n, **kw))
    a, b = requests(kit, 2, SamplingParams(max_tokens=4), suites=["vqa"])
    fa = target.encode_images(a.pixel_values, "pre_projector").features  # [1, T, D]
    fb = target.encode_images(b.pixel_values, "pre_projector").features
    same = _contexts(kit, [a], 0.0, lambda r: fa)[0]
    calls = [[same], [replace(same, request_id="again")], _contexts(kit, [b], 0.0, lambda r: fb),
             [replace(same, request_id="third")]]
    for cs in calls:
        d.begin(cs)
    want = {256: [1, 1], 1: [1, 1, 1], 0: [1, 1, 1, 1]}[cache]  # images captioned per begin that needed one
    assert made == want, made
    assert d.context("again") == d.context(a.request_id) == d.context("third")
    assert len(d._caption_lru) == min(cache, 2)  # noqa: SLF001
    if cache:  # the same image twice in one call (not cached yet): decoded once, both get its caption
        fresh = drafter(kit, "caption", caption_cache=cache)
        assert fresh.captioner is d.captioner  # the kit's model: its counting wrapper is still in place
        made.clear()
        fresh.begin([replace(same, request_id="x"), replace(same, request_id="y")])
        assert made == [1] and fresh.context("x") == fresh.context("y") == d.context(a.request_id)
    with pytest.raises(ValueError, match="caption_cache"):
        drafter(kit, "caption", caption_cache=-1)
    with pytest.raises(ValueError, match="unknown options"):
        drafter(kit, "massv", caption_cache=4)


def test_captions_are_made_once_and_booked_as_caption_time(kit, monkeypatch):
    target = load_target(kit["target"])
    d = drafter(kit, "caption")
    made = []
    real = d.captioner.caption
    # monkeypatch: the captioner is the module's shared model, so the counter must not outlive this test
    monkeypatch.setattr(d.captioner, "caption", lambda f, n=None, **kw: made.append(f.shape[0]) or real(f, n, **kw))
    reqs = requests(kit, 3, SamplingParams(max_tokens=8), suites=["multi_image", "vqa", "text"])
    res = SpecEngine(target, d, gamma=3, eos_token_ids=[-1]).generate(reqs)
    n_img = [0 if r.pixel_values is None else r.pixel_values.shape[0] for r in reqs]
    assert made == [sum(n_img)]  # one batched captioning for the whole begin call
    for r, n in zip(reqs, n_img):
        t = res[r.request_id].metrics.time
        assert (t.get("caption", 0.0) > 0) == (n > 0) and t["draft"] > 0
    # the caption member's context: each image replaced by its caption
    d2 = drafter(kit, "caption")
    feats = target.encode_images(reqs[0].pixel_values, "pre_projector").features
    d2.begin(_contexts(kit, reqs[:1], 0.0, lambda r: feats))
    caps = kit["noisy"].caption(feats)
    prompt = reqs[0].input_ids.tolist()
    image = kit["target"].config.image_token_id
    want, k = [], 0
    for t in prompt:
        if t == image:
            if k % 144 == 0:
                want += caps[k // 144]
            k += 1
        else:
            want.append(t)
    assert d2.context(reqs[0].request_id)[:-1] == want
    assert d2.pop_begin_times()[reqs[0].request_id]["caption"] > 0 and d2.pop_begin_times() == {}


def test_pooled_context_holds_grid_tokens_per_image(kit):
    target = load_target(kit["target"])
    image = kit["target"].config.image_token_id
    reqs = requests(kit, 1, SamplingParams(), suites=["multi_image"])
    f = target.encode_images(reqs[0].pixel_values, "pre_projector").features  # [N_img, 144, D]
    for grid, per in ((6, 36), (3, 9), (1, 1), ([2, 3], 6)):
        d = drafter(kit, "pooled", grid=grid)
        d.begin(_contexts(kit, reqs, 0.0, lambda r: f))
        ctx = d.context("r0")
        assert ctx.count(image) == per * f.shape[0]
        assert len(ctx) - ctx.count(image) == len(reqs[0].input_ids) - 144 * f.shape[0] + 1  # + first token
    one = pool_features(f, (1, 1))
    torch.testing.assert_close(one[:, 0], f.mean(1))  # 1 x 1: the mean of the image's tokens
    four = pool_features(f, (6, 6)).reshape(f.shape[0], 6, 6, -1)
    grid = f.reshape(f.shape[0], 12, 12, -1)
    torch.testing.assert_close(four[:, 1, 2], grid[:, 2:4, 4:6].mean((1, 2)))  # 2 x 2 windows


def test_bad_config_and_missing_features_are_refused(kit):
    for kind, opts, match in [
        ("ensemble", {"members": ["multimodal", "sketch"]}, "member kind"),
        ("ensemble", {"members": []}, "non-empty"),
        ("ensemble", {"members": ["text", "text"]}, "twice"),
        ("ensemble", {"members": [{"kind": "text", "colour": 1}]}, "unknown keys"),
        ("ensemble", {"members": [{"kind": "text", "grid": 2}]}, "only a pooled"),
        ("ensemble", {"weights": [1, 1]}, "4 members"),
        ("ensemble", {"weights": [1, 1, 0, 1]}, "weights"),
        ("ensemble", {"members": [{"kind": "text", "weight": -1}]}, "weight"),
        ("pooled", {"grid": 0}, "grid"),
        ("massv", {"members": ["text"]}, "unknown options"),
        ("massv", {"vocab_size": 10}, "vocabulary"),
        ("ensemble", {"caption_max_tokens": 0}, "caption_max_tokens"),
        ("massv", {"structure": "graph"}, "structure"),
        ("ensemble", {"adapt": -1}, "adapt must"),
        ("ensemble", {"adapt": True}, "adapt must"),
        ("ensemble", {"adapt_floor": 1.5}, "adapt_floor"),
    ]:
        with pytest.raises(ValueError, match=match):
            drafter(kit, kind, **opts)
    lm = copy.deepcopy(kit["noisy"].lm)
    with pytest.raises(ValueError, match="projector"):
        create({"kind": "massv", "model": lm, "image_token_id": 3})
    with pytest.raises(ValueError, match="captioner"):
        create({"kind": "caption", "model": lm, "image_token_id": 3})
    text_only = create({"kind": "caption", "model": lm, "captioner": kit["noisy"]})  # text LM + massv captioner
    assert text_only.spec.needs == {"pre_projector"} and text_only.image_token_id == 3
    d = drafter(kit, "massv")
    req = requests(kit, 1, SamplingParams(), suites=["vqa"])[0]
    with pytest.raises(ValueError, match=r"extra\['pre_projector'\]"):
        d.begin([DraftContext("x", req.input_ids, 7)])
    with pytest.raises(ValueError, match="pre_projector"):
        d.begin([DraftContext("x", req.input_ids, 7, extra={"pre_projector": torch.zeros(1, 100, 64)})])
    assert not d._rows and not d._groups_of  # nothing half-made
    with pytest.raises(ValueError, match="unknown request id"):
        d.propose(["nope"], 3)


def test_a_seed_reproduces_the_drafts_whatever_the_batch(kit):
    target = load_target(kit["target"])
    reqs = requests(kit, 3, SamplingParams(), suites=["vqa", "text", "chart"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features
             for r in reqs if r.pixel_values is not None}

    def drafts(ids):
        d = drafter(kit, structure="tree")
        d.begin(_contexts(kit, [r for r in reqs if r.request_id in ids], 1.0, lambda r: feats[r.request_id]))
        return d.propose(ids, gamma=3).tokens[ids.index("r0")].tolist()

    assert drafts(["r0"]) == drafts(["r1", "r0", "r2"])


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("structure", ["chain", "tree"])
def test_sampled_tokens_follow_the_target(kit, structure):
    """The shared distribution check (exact joint of the first 3 tokens), drafts drawn from the ensemble's mixture
    q, on an image prompt. The multimodal member is the target itself (``copy``) and the others differ from it; the
    fault of sending one member's q instead of the mixture is kept as a test that must fail the same check
    (tests/runtime/test_end_to_end_distribution.py)."""
    base = requests(kit, 1, SamplingParams(), suites=["vqa"])[0]
    target = load_target(kit["target"])
    d = create({"kind": "ensemble", "model": kit["copy"], "structure": structure, "branching": [2, 1], "seed": 3,
                "weights": [1, 1, 2, 1], "join": "at_once"}, target=target)
    assert_follows_the_target(kit["target"], d, base, target=target, max_tokens=4 if structure == "chain" else 6)

def test_captions_through_the_lean_forward_equal_the_stock_forward(kit, monkeypatch):
    """``MassvModel.caption`` decodes through ``lean_llama`` with an in-place cache; the stock HF forward (lean
    refused) makes the same greedy captions, token for token, with captions long enough to differ."""
    from specula.drafters import lean_llama

    target = load_target(kit["target"])
    reqs = requests(kit, 2, SamplingParams(max_tokens=8), suites=["multi_image"])
    feats = target.encode_images(reqs[0].pixel_values, "pre_projector").features  # [N_img, T, D]
    model = kit["noisy"]
    lean = model.caption(feats, 24)
    monkeypatch.setattr(lean_llama, "supported", lambda config: False)
    stock = model.caption(feats, 24)
    assert lean == stock and len(feats) >= 2 and max(len(c) for c in lean) >= 8
    assert len({tuple(c) for c in lean}) > 1 or len(set(lean[0])) > 1  # not one repeated token


def test_the_lean_ensemble_drafts_what_the_stock_forward_drafts(kit):
    """Member rows prefilled from input embeddings (images projected) and drafted through ``lean_llama``: the same
    tokens and q as a drafter forced onto the stock HF forward, block after block, and the lean one never calls the
    HF module (its prefill included)."""
    target = load_target(kit["target"])
    members = ["multimodal", "text", {"kind": "pooled", "grid": 3}]
    lean, stock = (drafter(kit, members=members, lean=flag) for flag in (True, False))
    assert lean._lean and not stock._lean
    reqs = requests(kit, 2, SamplingParams(max_tokens=8), suites=["caption", "vqa"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features for r in reqs}
    calls = []
    hook = kit["noisy"].lm.model.register_forward_pre_hook(lambda *a, **k: calls.append(1), with_kwargs=True)
    try:
        ids = [r.request_id for r in reqs]
        for d, temperature in ((lean, 1.0), (stock, 1.0)):
            calls.clear()
            d.begin(_contexts(kit, reqs, temperature, lambda r: feats[r.request_id]))
            assert (len(calls) == 0) == (d is lean)
        for _ in range(3):
            calls.clear()
            a = lean.propose(ids, gamma=3)
            assert not calls
            b = stock.propose(ids, gamma=3)
            assert torch.equal(a.tokens, b.tokens)
            torch.testing.assert_close(a.q, b.q, rtol=0, atol=1e-5)
            verdicts = [Verdict(r, (0,), (int(a.tokens[i, 0]),), 11) for i, r in enumerate(ids)]
            for d in (lean, stock):
                d.observe(verdicts)
    finally:
        hook.remove()


def test_member_rows_prefilled_by_length_draft_what_one_padded_prefill_drafts(kit, monkeypatch):
    """Rows of very different lengths (the text member's prompt without its 144 image tokens, the pooled member's
    9) are prefilled in separate forwards, joined to the cache in their own order: the drafts and q are those of one
    padded forward over all rows, and the padded tokens stay within the bound."""
    from specula.drafters import ensemble

    target = load_target(kit["target"])
    members = ["multimodal", "text", {"kind": "pooled", "grid": 3}]
    reqs = requests(kit, 2, SamplingParams(max_tokens=8), suites=["caption", "text"])
    feats = {r.request_id: target.encode_images(r.pixel_values, "pre_projector").features
             for r in reqs if r.pixel_values is not None}
    ids = [r.request_id for r in reqs]
    padded = []
    grouped, one = drafter(kit, members=members), drafter(kit, members=members)
    real = grouped._prefill_group
    grouped._prefill_group = lambda rows: padded.append((len(rows), max(len(t) for _, t, _ in rows),
                                                         sum(len(t) for _, t, _ in rows))) or real(rows)
    grouped.begin(_contexts(kit, reqs, 1.0, lambda r: feats[r.request_id]))
    monkeypatch.setattr(ensemble, "length_groups", lambda lengths: [list(range(len(lengths)))] if lengths else [])
    one.begin(_contexts(kit, reqs, 1.0, lambda r: feats[r.request_id]))
    assert len(padded) > 1 and sum(b * m for b, m, _ in padded) <= 1.25 * sum(n for _, _, n in padded)
    for _ in range(3):
        a, b = grouped.propose(ids, gamma=3), one.propose(ids, gamma=3)
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.q, b.q, rtol=0, atol=1e-5)
        verdicts = [Verdict(r, (0,), (int(a.tokens[i, 0]),), 11) for i, r in enumerate(ids)]
        for d in (grouped, one):
            d.observe(verdicts)


def test_a_member_far_behind_leaves_the_request_and_greedy_output_stays_plain(kit):
    """With the target itself as the multimodal member (``copy``), the members that do not see the image fall far
    behind on a caption within a few blocks: their rows leave the request (released from the drafter's cache) and
    the ensemble goes on with the rest; greedy output equals plain decoding. ``prune_below: 0`` keeps every member."""
    reqs = requests(kit, 2, SamplingParams(max_tokens=24), suites=["caption", "chart"])
    ref = plain(kit, "target", reqs, 2)
    members = ["multimodal", "text", {"kind": "pooled", "grid": 1}]
    for prune in (1e-3, 0):
        target = load_target(kit["target"])
        d = drafter(kit, lm="copy", members=members, prune_below=prune)
        seen: dict[str, list[int]] = {}
        observe = d.observe

        def watched(verdicts, observe=observe, d=d, seen=seen):
            observe(verdicts)
            for v in verdicts:
                seen.setdefault(v.request_id, []).append(len(d.live_members(v.request_id)))

        d.observe = watched
        assert_equals_plain(SpecEngine(target, d, gamma=4, eos_token_ids=eos(kit)), reqs, ref, 2)
        if prune:
            assert any(n[-1] < 3 for n in seen.values()), seen  # members left mid-request
            assert all(n == sorted(n, reverse=True) for n in seen.values())  # and never came back
        else:
            assert all(set(n) == {3} for n in seen.values()), seen
        assert not d._rows and not d._groups_of  # every row released


def test_after_pruning_q_is_the_mixture_of_the_members_left(kit):
    """Once a member is pruned, each node's q is the mixture of the remaining members' distributions (over their own
    contexts + the node's ancestors) with the adapted weights renormalised over them, and its cache row is gone."""
    target = load_target(kit["target"])
    m = kit["noisy"]
    image = kit["target"].config.image_token_id
    weights = [3.0, 1.0, 2.0]
    d = drafter(kit, members=["multimodal", "text", {"kind": "pooled", "grid": 3}], weights=weights)
    reqs = requests(kit, 1, SamplingParams(), suites=["chart"])
    f = target.encode_images(reqs[0].pixel_values, "pre_projector").features
    d.begin(_contexts(kit, reqs, 0.8, lambda r: f))
    rows = d._kv.batch_size
    d._loglik_of["r0"] = [-3.0, -30.0, -4.0]  # the text member far behind (as if after a few blocks)
    d._prune(["r0"])
    assert d.live_members("r0") == ["multimodal", "pooled9"] and d._kv.batch_size == rows - 1
    vis = {"multimodal": f.reshape(-1, f.shape[-1]), "pooled9": pool_features(f, (3, 3)).reshape(-1, f.shape[-1])}
    want_w = _expected_weights([3.0, 2.0], [-3.0, -4.0])
    prop = d.propose(["r0"], gamma=3)
    toks, _, paths = node_paths(prop, 0)
    for i, path in enumerate(paths):
        qs = [_member_logp(m, d.context("r0", j) + [toks[k] for k in path], vis[name], image, 0.8)
              for j, name in enumerate(d.live_members("r0"))]
        torch.testing.assert_close(prop.q[0, i], mix_distributions(qs, want_w), atol=2e-5, rtol=1e-4)
    assert [x for x in d.member_weights("r0")] == pytest.approx(want_w)
