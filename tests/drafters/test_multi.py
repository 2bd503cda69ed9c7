"""MultiDrafter: several named drafters behind one, each request drafting with the one it chose.

The merge of their rows into one Proposal (padding, chains as trees, one-hot q for deterministic rows) must not
change a single verifier decision, so: merged rows are checked field by field; one-hot q is shown to verify
exactly like q=None (chains and trees, same uniforms); a batch mixing sampled chain, deterministic chain and
sampled tree rows emits the target's law (first token and the first two tokens, TV < 0.01 at 150k rows per group),
and the same check catches rows given another law than the one they were drawn from. (Claiming one-hot q is never
the danger: it treats a draft as given, which the rejection rule allows for any draft; a wrong sampled q is.)
Through the engine (tiny lively target, world prompts): a batch whose requests chose different drafters equals
plain greedy decoding token for token, each request drafted by its own drafter, and sampled output follows plain
sampling (chi-square).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from drafter_kit import assert_follows_the_target, eos, lively_target, plain, requests
from transformers import LlamaForCausalLM

from specula.drafters import DraftContext, Drafter, Proposal, Verdict, create
from specula.drafters.multi_drafter import MultiDrafter, merge_proposals
from specula.drafters.protocol import DrafterSpec, supports_lookahead
from specula.runtime.engine.loop import GenerationRequest, SpecEngine
from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import SamplingParams, sample, sample_without_replacement
from specula.runtime.core.tree_rejection import verify_tree
from specula.targets import load_target
from specula.targets.processor import load_processor
from specula.zoo.store import TOKENIZER_DIR

# ----------------------------------------------------------------------------------------------- the merge


def _one_hot(tokens: list[int], width: int, vocab: int) -> torch.Tensor:
    out = torch.zeros(width, vocab)
    for i, t in enumerate(tokens):
        out[i, t] = 1.0
    return out


def test_merge_gives_deterministic_rows_one_hot_q_next_to_sampled_rows():
    V = 6
    det = Proposal(("a", "c"), torch.tensor([[1, 2, 3], [4, 0, 0]]), (3, 1))  # q None, row c padded
    q = torch.softmax(torch.randn(1, 2, V, generator=torch.Generator().manual_seed(0)), -1)
    sampled = Proposal(("b",), torch.tensor([[5, 1]]), (2,), None, q)
    m = merge_proposals(("a", "b", "c"), [([0, 2], det), ([1], sampled)])
    assert m.request_ids == ("a", "b", "c") and m.counts == (3, 2, 1) and m.parents is None
    assert m.tokens.tolist() == [[1, 2, 3], [5, 1, 0], [4, 0, 0]]
    assert torch.equal(m.q[0], _one_hot([1, 2, 3], 3, V))
    assert torch.equal(m.q[2], _one_hot([4], 3, V))  # zeros past the row's count
    assert torch.equal(m.q[1, :2], q[0]) and not m.q[1, 2].any()


def test_merge_expresses_chains_as_trees_next_to_a_tree():
    chain = Proposal(("a", "c"), torch.tensor([[7, 8, 9], [6, 0, 0]]), (3, 1))
    tree = Proposal(("b",), torch.tensor([[3, 4, 5, 6, 2]]), (5,), torch.tensor([[-1, -1, 0, 0, 1]]))
    m = merge_proposals(("a", "b", "c"), [([0, 2], chain), ([1], tree)])
    assert m.counts == (3, 5, 1) and m.q is None
    assert m.parents.tolist() == [[-1, 0, 1, -1, -1], [-1, -1, 0, 0, 1], [-1, -1, -1, -1, -1]]
    assert m.tokens.tolist() == [[7, 8, 9, 0, 0], [3, 4, 5, 6, 2], [6, 0, 0, 0, 0]]


def test_merge_of_one_drafter_for_every_row_is_its_proposal():
    p = Proposal(("a", "b"), torch.tensor([[1, 2], [3, 4]]), (2, 1))
    m = merge_proposals(("a", "b"), [([0, 1], p)])
    assert m.tokens is p.tokens and m.q is None and m.parents is None and m.counts == (2, 1)
    empty = merge_proposals(("a",), [])  # no part: nothing to propose
    assert empty.counts == (0,) and empty.tokens.shape == (1, 1)


def test_merge_refuses_drafters_with_different_vocabularies():
    a = Proposal(("a",), torch.tensor([[1]]), (1,), None, torch.full((1, 1, 4), 0.25))
    b = Proposal(("b",), torch.tensor([[1]]), (1,), None, torch.full((1, 1, 5), 0.2))
    with pytest.raises(ValueError, match="vocabulary"):
        merge_proposals(("a", "b"), [([0], a), ([1], b)])


def _random_rows(B: int, N: int, V: int, g: torch.Generator):
    tokens = torch.randint(0, V, (B, N), generator=g)
    counts = torch.randint(0, N + 1, (B,), generator=g).tolist()
    p = torch.softmax(torch.randn(B, N + 1, V, generator=g) * 2, -1)
    greedy = (torch.rand(B, generator=g) < 0.3).tolist()
    one_hot = torch.nn.functional.one_hot(tokens, V).float()
    return tokens, counts, p, greedy, one_hot


def _seeded(verify, *args, **kw):
    """``verify`` with torch's default generator seeded 7: two calls draw the same uniforms."""
    torch.manual_seed(7)
    return verify(*args, **kw)


def test_one_hot_q_verifies_a_chain_exactly_like_no_q():
    g = torch.Generator().manual_seed(1)
    tokens, counts, p, greedy, one_hot = _random_rows(3000, 4, 5, g)
    a, b = (_seeded(verify_chain, tokens, q, p, num_draft=counts, greedy=greedy) for q in (None, one_hot))
    assert torch.equal(a.output_tokens, b.output_tokens) and torch.equal(a.accepted, b.accepted)
    assert 0 < int(a.accepted.sum()) < sum(counts)  # acceptances and rejections both happened


@pytest.mark.parametrize("shape", ["tree", "chain_as_tree"])
def test_one_hot_q_verifies_a_tree_exactly_like_no_q(shape):
    g = torch.Generator().manual_seed(2)
    tokens, counts, p, greedy, one_hot = _random_rows(3000, 5, 5, g)
    if shape == "tree":
        parents = torch.tensor([-1, -1, 0, 0, 1]).expand(3000, -1)
        tokens[:, 1] = (tokens[:, 0] + 1) % 5  # distinct siblings, as a deterministic tree drafter proposes
        tokens[:, 3] = (tokens[:, 2] + 1) % 5
        one_hot = torch.nn.functional.one_hot(tokens, 5).float()
    else:
        parents = torch.arange(-1, 4).expand(3000, -1)
    runs = [_seeded(verify_tree, parents, tokens, q, p, counts=counts, greedy=greedy) for q in (None, one_hot)]
    assert torch.equal(runs[0].output_tokens, runs[1].output_tokens)
    assert 0 < int(runs[0].accepted.sum()) < sum(counts)
    if shape == "chain_as_tree":  # and a chain verified as a tree decides as verify_chain does
        c = _seeded(verify_chain, tokens, None, p, num_draft=counts, greedy=greedy)
        assert torch.equal(runs[0].accepted, c.accepted) and torch.equal(runs[0].next_token, c.next_token)


# ----------------------------------------------------------------------------------------------- statistics


V = 6
N_GROUP = 150_000  # rows per group; expected TV from noise <= 0.4 * 6 / sqrt(150k) ~ 0.006 for 36 pairs


def _markov(g: torch.Generator, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A next-token model: first [V] after the prompt, step [V, V] after a token."""
    return torch.softmax(torch.randn(V, generator=g) * scale, -1), torch.softmax(torch.randn(V, V, generator=g) * scale,
                                                                                  -1)


def _models(g: torch.Generator):
    """A target and a drafter near it (0.6 target + 0.4 another model: accepted often, rejected often)."""
    target, other = _markov(g, 1.5), _markov(g, 1.5)
    return target, tuple(0.6 * t + 0.4 * o for t, o in zip(target, other))


def _after(model, ctx: torch.Tensor) -> torch.Tensor:
    """[n] previous tokens (-1 = the prompt) -> [n, V]."""
    first, step = model
    return torch.where((ctx < 0)[:, None], first.expand(len(ctx), V), step[ctx.clamp_min(0)])


def _mixed_block(target, drafter, ctx: torch.Tensor, gen: torch.Generator, wrong_q: bool = False):
    """One block for three groups of rows (by index mod 3), merged and verified as one batch:
    sampled chain (gamma 3, q given), deterministic chain (the drafter's argmax chain, q None), sampled tree
    (two root children without replacement, one child each). ``wrong_q``: the sampled chain rows carry another
    law (uniform) than the one their tokens were drawn from, as a merge that mixed up rows' q would."""
    n = len(ctx)
    groups = [torch.arange(k, n, 3) for k in range(3)]
    parts = []
    # sampled chain
    c, xs, qs = ctx[groups[0]], [], []
    for _ in range(3):
        q = _after(drafter, c)
        c = sample(q, gen)
        xs.append(c)
        qs.append(q)
    parts.append(Proposal(tuple(groups[0].tolist()), torch.stack(xs, 1), (3,) * len(groups[0]), None,
                          torch.full((len(groups[0]), 3, V), 1 / V) if wrong_q else torch.stack(qs, 1)))
    # deterministic chain
    c, xs = ctx[groups[1]], []
    for _ in range(2):
        c = _after(drafter, c).argmax(-1)
        xs.append(c)
    parts.append(Proposal(tuple(groups[1].tolist()), torch.stack(xs, 1), (2,) * len(groups[1])))
    # sampled tree: parents [-1, -1, 0, 1]; q[i] is node i's law given its parent (siblings without replacement)
    c = ctx[groups[2]]
    q_root = _after(drafter, c)
    roots = sample_without_replacement(q_root, 2, gen)  # [m, 2]
    q_kids = [_after(drafter, roots[:, j]) for j in range(2)]
    kids = [sample(q, gen) for q in q_kids]
    tokens = torch.stack([roots[:, 0], roots[:, 1], kids[0], kids[1]], 1)
    q = torch.stack([q_root, q_root, q_kids[0], q_kids[1]], 1)
    parts.append(Proposal(tuple(groups[2].tolist()), tokens, (4,) * len(groups[2]),
                          torch.tensor([-1, -1, 0, 1]).expand(len(groups[2]), -1), q))
    m = merge_proposals(tuple(range(n)), [(g.tolist(), p) for g, p in zip(groups, parts)])
    assert m.parents is not None and m.q is not None
    p = torch.stack([_after(target, ctx)] + [_after(target, m.tokens[:, i]) for i in range(m.tokens.shape[1])], 1)
    v = verify_tree(m.parents, m.tokens, m.q, p, counts=m.counts)  # torch's default generator (seeded by the test)
    return v.output_tokens, v.accepted, groups


def _tv(ids: torch.Tensor, law: torch.Tensor) -> float:
    freq = torch.bincount(ids, minlength=law.numel()).double() / ids.numel()
    return 0.5 * (freq - law.flatten().double()).abs().sum().item()


def test_a_mixed_batch_emits_the_target_law_for_every_group():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    target, drafter = _models(gen)
    n = 3 * N_GROUP
    out, accepted, groups = _mixed_block(target, drafter, torch.full((n,), -1), gen)
    y = out[:, :2].clone()
    short = accepted == 0  # rows that emitted one token: a second block gives their second token
    out2, _, _ = _mixed_block(target, drafter, y[short, 0], gen)
    y[short, 1] = out2[:, 0]
    pair_law = target[0][:, None] * target[1]  # [V, V] P(y0 = a, y1 = b)
    for k, rows in enumerate(groups):
        assert 0.2 < accepted[rows].float().mean() < 0.9 * (3, 2, 2)[k], k  # accepted and rejected: not vacuous
        assert _tv(y[rows, 0], target[0]) < 0.01, k
        assert _tv(y[rows, 0] * V + y[rows, 1], pair_law) < 0.01, k


def test_the_statistics_catch_a_merge_that_gives_rows_the_wrong_q():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    target, drafter = _models(gen)
    out, _, groups = _mixed_block(target, drafter, torch.full((3 * N_GROUP,), -1), gen, wrong_q=True)
    assert _tv(out[groups[0], 0], target[0]) > 0.03


# ----------------------------------------------------------------------------------------------- routing


class Recorder:
    """A small real drafter: proposes ``gamma`` copies of ``token`` (deterministic), records what it was given."""

    def __init__(self, token: int, needs=frozenset(), structure: str = "chain") -> None:
        self.spec = DrafterSpec(kind="recorder", structure=structure, needs=frozenset(needs))
        self.token, self.contexts, self.verdicts, self.live = token, {}, [], set()

    def begin(self, contexts):
        for c in contexts:
            self.contexts[c.request_id] = c
            self.live.add(c.request_id)

    def propose(self, ids, gamma):
        return Proposal(tuple(ids), torch.full((len(ids), gamma), self.token), (gamma,) * len(ids))

    def observe(self, verdicts):
        self.verdicts += list(verdicts)

    def release(self, ids):
        self.live -= set(ids)


def _ctx(rid: str, drafter: str | None) -> DraftContext:
    return DraftContext(rid, torch.tensor([1, 2, 3]), 4, hidden=torch.zeros(3, 8), drafter=drafter,
                        extra={"last_k": torch.zeros(2, 3, 4), "last_v": torch.zeros(2, 3, 4)})


def test_requests_are_routed_to_the_drafter_they_chose():
    a, b = Recorder(7), Recorder(9, needs={"hidden"})
    multi = MultiDrafter({"a": a, "b": b}, default="a")
    assert isinstance(multi, Drafter) and multi.names == ("a", "b")
    assert multi.spec.needs == {"hidden"} and multi.spec.structure == "chain"
    multi.begin([_ctx("r1", "b"), _ctx("r2", None), _ctx("r3", "a")])
    assert set(a.contexts) == {"r2", "r3"} and set(b.contexts) == {"r1"}
    assert [multi.name_for(r) for r in ("r1", "r2", "r3")] == ["b", "a", "a"]
    # each drafter sees only the features it asked for, as the engine would give it alone
    assert a.contexts["r2"].hidden is None and "last_k" not in a.contexts["r2"].extra
    assert b.contexts["r1"].hidden is not None and "last_k" not in b.contexts["r1"].extra
    prop = multi.propose(["r1", "r2", "r3"], 3)
    assert prop.request_ids == ("r1", "r2", "r3") and prop.tokens.tolist() == [[9] * 3, [7] * 3, [7] * 3]
    multi.observe([Verdict(r, (0,), (t,), 5, hidden=torch.zeros(2, 8)) for r, t in (("r1", 9), ("r2", 7))])
    assert [v.request_id for v in b.verdicts] == ["r1"] and b.verdicts[0].hidden is not None
    assert [v.request_id for v in a.verdicts] == ["r2"] and a.verdicts[0].hidden is None
    multi.release(["r1", "r2", "never-begun"])
    assert b.live == set() and a.live == {"r3"} and multi.name_for("r1") is None


def test_an_unknown_choice_is_refused_before_any_drafter_begins():
    a, b = Recorder(7), Recorder(9)
    multi = MultiDrafter({"a": a, "b": b}, default="b")
    with pytest.raises(ValueError, match=r"'c' is not served here; choose one of \['b', 'a'\]"):
        multi.begin([_ctx("r1", "a"), _ctx("r2", "c")])
    assert not a.contexts and not b.contexts
    with pytest.raises(ValueError, match="default drafter 'z'"):
        MultiDrafter({"a": a}, default="z")
    with pytest.raises(ValueError, match="drafter name 'none'"):
        MultiDrafter({"none": a}, default="none")


def test_spec_is_the_union_and_lookahead_needs_every_drafter():
    ngram = create({"kind": "ngram", "max_n": 3})
    tree = create({"kind": "random", "vocab_size": 10, "structure": "tree"})
    assert supports_lookahead(MultiDrafter({"n": ngram, "m": create({"kind": "ngram"})}, default="n"))
    mixed = MultiDrafter({"n": ngram, "t": tree}, default="n")
    assert mixed.spec.structure == "tree" and not supports_lookahead(mixed)
    assert supports_lookahead(mixed.drafters["n"]) and mixed.drafter_for("unknown") is ngram


def test_branch_routes_to_drafters_that_rank_rejections_and_others_get_none():
    """Predraft through a MultiDrafter: a text_lm request opens a rejection outcome, an ngram request gets None."""
    from transformers import LlamaConfig

    from specula.drafters.protocol import supports_predraft

    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)).eval()
    text = create({"kind": "text_lm", "model": lm, "image_token_id": 63})
    multi = MultiDrafter({"t": text, "n": create({"kind": "ngram"})}, default="t")
    assert supports_lookahead(multi) and not supports_predraft(multi) and supports_predraft(multi.drafter_for("x"))
    prompt = torch.tensor([4, 5, 6, 4, 5, 6, 4])
    multi.begin([DraftContext("a", prompt, 5, drafter="t"), DraftContext("b", prompt, 5, drafter="n")])
    p = multi.propose(["a", "b"], 3)
    assert p.counts[0] == 3
    opened = multi.branch([("b", 2), ("a", 2)])
    assert opened[0] is None and opened[1] is not None
    k, t = opened[1]
    assert 0 <= k <= 2 and t != p.tokens[0, k]
    multi.release(["a", "b"])


# ----------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def kit():
    processor = load_processor(TOKENIZER_DIR)
    g = torch.Generator().manual_seed(0)
    model = lively_target(processor, generator=g)
    lm = LlamaForCausalLM(model.config.text_config)  # the target's LM plus noise: accepted often, not always
    lm.model.load_state_dict(model.model.language_model.state_dict())
    lm.tie_weights()
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.015)
    return {"target": model, "processor": processor, "lm": lm.eval()}


def _multi(kit, target) -> MultiDrafter:
    info = target.info
    ban = [info.image_token_id]
    return MultiDrafter({
        "ngram": create({"kind": "ngram", "max_n": 3, "image_token_id": info.image_token_id}),
        "lm": create({"kind": "text_lm", "model": kit["lm"], "seed": 3}, target=target),  # sampled q, chains
        "chain": create({"kind": "random", "vocab_size": info.vocab_size, "peaked": 3.0, "banned": ban, "seed": 1}),
        "tree": create({"kind": "random", "vocab_size": info.vocab_size, "structure": "tree", "branching": 2,
                        "depth": 3, "peaked": 3.0, "banned": ban, "seed": 2}),
    }, default="ngram")


CHOICES = [None, "lm", "tree", "ngram", "chain"]  # request i chooses CHOICES[i % 5]; None = the default, ngram


class _Watch:
    """Passes calls to a MultiDrafter; records the proposal rows each sub-drafter answered (by its node count)."""

    def __init__(self, multi: MultiDrafter) -> None:
        self.multi, self.spec, self.trees = multi, multi.spec, set()

    def begin(self, contexts):
        self.multi.begin(contexts)

    def propose(self, ids, gamma):
        prop = self.multi.propose(ids, gamma)
        self.trees |= {r for r, c in zip(ids, prop.counts) if c > gamma}  # only the tree drafter exceeds gamma
        return prop

    def observe(self, verdicts):
        self.multi.observe(verdicts)

    def release(self, ids):
        self.multi.release(ids)


def test_a_batch_choosing_different_drafters_equals_plain_greedy_decoding(kit):
    suites = ["vqa", "text", "caption", "reasoning", "multi_image"]  # the text LM ("lm") gets the text prompts
    reqs = [replace(r, drafter=CHOICES[i % 5])
            for i, r in enumerate(requests(kit, 10, SamplingParams(max_tokens=14), suites=suites))]
    ref = plain(kit, "target", reqs, batch=5)
    target = load_target(kit["target"])
    watch = _Watch(_multi(kit, target))
    eng = SpecEngine(target, watch, gamma=4, eos_token_ids=eos(kit))
    got = {}
    for i in (0, 5):  # each batch: one request per choice, verified as trees (the tree drafter is in it)
        got.update(eng.generate(reqs[i:i + 5]))
    for r in reqs:
        assert got[r.request_id].tokens == ref[r.request_id].tokens, (r.request_id, r.drafter)

    def total(field, *choices):
        return sum(getattr(got[r.request_id].metrics, field) for r in reqs if r.drafter in choices)

    assert all(total("draft_tokens", c) > 0 for c in ("chain", "tree", "lm"))  # every choice really drafted
    assert watch.trees and watch.trees <= {r.request_id for r in reqs if r.drafter == "tree"}
    assert total("accepted_tokens", "lm") >= 5  # accepted chains among tree rows (verified as trees)
    assert total("draft_tokens", None, "ngram") > 0  # the default drafted for the requests that chose nothing
    assert not target.live_ids and not watch.multi._route  # noqa: SLF001 - every row released everywhere


@pytest.mark.statistical
def test_a_mixed_sampled_batch_follows_plain_sampling(kit):
    """The shared distribution check over a batch whose requests choose every drafter in turn (sampled-q chains,
    one-hot ngram, trees, the default): the rows of one verifier batch, each verified under its own drafter."""
    base = requests(kit, 1, SamplingParams(), start=2)[0]  # text only: ngram finds its matches in the prompt
    target = load_target(kit["target"])
    assert_follows_the_target(kit["target"], _multi(kit, target), base, target=target, gamma=3, max_tokens=6,
                              choices=CHOICES)