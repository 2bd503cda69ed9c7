"""Statistical losslessness: what verification emits is distributed exactly as the target would sample it.

Small vocabularies, hundreds of thousands of rows verified in one vectorized call, fixed seeds (so the tests
are deterministic), total variation (TV) against the exact target law < 0.01. The expected TV from sampling
noise alone is about 0.4 * sum(sqrt(p)) / sqrt(n): <= 0.003 for 10 tokens at n = 200k, <= 0.005 for 64 pairs at
n = 400k and for 36 pairs at n = 250k. The "power" tests show the same check catches a verifier fed the wrong q.

The target and the drafter are Markov chains (the next-token law depends on the last token), so p for a
draft position really depends on the drafted tokens before it, as in a language model.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from specula.runtime.core.mixture import mix_distributions
from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import sample, sample_without_replacement
from specula.runtime.core.tree_rejection import verify_tree

N_FIRST = 200_000  # rows for first-token checks
N_JOINT = 400_000  # rows for two-token (joint) checks of chains
N_TREE = 250_000  # rows for two-token checks of trees (6 tokens: 36 pairs)


def tv(ids: torch.Tensor, probs: torch.Tensor) -> float:
    freq = torch.bincount(ids.flatten(), minlength=probs.numel()).double() / ids.numel()
    return 0.5 * (freq - probs.flatten().double()).abs().sum().item()


def random_dist(shape, gen, scale=1.5, zero_frac=0.0, keep_min=3) -> torch.Tensor:
    """Random distributions [..., V]; with zero_frac, that share of entries is zeroed (keeping keep_min)."""
    logits = torch.randn(shape, generator=gen) * scale
    if zero_frac:
        drop = torch.rand(shape, generator=gen) < zero_frac
        top = logits.topk(keep_min, -1).indices
        drop.scatter_(-1, top, False)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, -1)


@dataclass(frozen=True)
class Markov:
    """A next-token model: first[V] after the prompt, step[V, V] after a token (row = previous token)."""

    first: torch.Tensor  # [V] or [M, V] (one per ensemble member)
    step: torch.Tensor  # [V, V] or [M, V, V]

    def after(self, ctx: torch.Tensor) -> torch.Tensor:
        """[B] previous tokens (-1 = just the prompt) -> [B, V] (or [B, M, V] for members)."""
        first = self.first.expand(ctx.shape[0], *self.first.shape)
        step = self.step[..., ctx.clamp_min(0), :]
        step = step.movedim(-2, 0) if self.step.ndim == 3 else step
        keep = (ctx < 0).view(-1, *([1] * (first.ndim - 1)))
        return torch.where(keep, first, step)

    def pair_law(self) -> torch.Tensor:
        return self.first[:, None] * self.step  # [V, V] P(y0 = a, y1 = b)


def markov(vocab, gen, members=0, **kw) -> Markov:
    lead = (members,) if members else ()
    return Markov(random_dist((*lead, vocab), gen, **kw), random_dist((*lead, vocab, vocab), gen, **kw))


CASES = {
    # name: (target kw, drafter kw); the drafter is drawn independently of the target
    "random": (dict(scale=1.5), dict(scale=1.5)),
    "peaky_far": (dict(scale=3.0), dict(scale=4.0)),
    "zeros_both_ways": (dict(scale=1.5, zero_frac=0.4), dict(scale=1.5, zero_frac=0.4)),
}


# ----------------------------------------------------------------------------------------------- chain


def chain_block(target: Markov, drafter: Markov | None, ctx: torch.Tensor, gamma: int, gen, fixed_q=None):
    """Draft gamma tokens after ctx [B] from the drafter (sampled) and verify them against the target."""
    xs, qs, ps = [], [], [target.after(ctx)]
    prev = ctx
    for _ in range(gamma):
        q = drafter.after(prev)  # [B, V]
        x = sample(q, gen)
        xs.append(x)
        qs.append(q)
        ps.append(target.after(x))
        prev = x
    q = torch.stack(qs, 1) if fixed_q is None else fixed_q
    return verify_chain(torch.stack(xs, 1), q, torch.stack(ps, 1))


def two_tokens(block, target: Markov, n: int) -> torch.Tensor:
    """First two emitted tokens per row; rows whose first block emitted one token run a second block."""
    start = torch.full((n,), -1)
    out, accepted = block(start)
    y = out[:, :2].clone()
    short = accepted == 0
    out2, _ = block(y[short, 0])
    y[short, 1] = out2[:, 0]
    return y


@pytest.mark.parametrize("case", CASES)
def test_chain_first_token_follows_p(case):
    gen = torch.Generator().manual_seed(1)
    target, drafter = markov(10, gen, **CASES[case][0]), markov(10, gen, **CASES[case][1])
    torch.manual_seed(0)
    v = chain_block(target, drafter, torch.full((N_FIRST,), -1), 3, gen)
    assert v.accepted.float().mean() > 0.05  # the drafts do get accepted, so the check is not vacuous
    assert tv(v.output_tokens[:, 0], target.first) < 0.01


def test_chain_first_token_follows_p_when_q_equals_p_and_for_a_deterministic_drafter():
    gen = torch.Generator().manual_seed(2)
    target = markov(10, gen)
    torch.manual_seed(0)
    v = chain_block(target, target, torch.full((N_FIRST,), -1), 3, gen)
    assert v.accepted.float().mean() > 2.9 and tv(v.output_tokens[:, 0], target.first) < 0.01
    # A deterministic drafter (q = None, one-hot): always proposes token 7, then 7 again.
    ctx = torch.full((N_FIRST,), -1)
    p = torch.stack([target.after(ctx), target.after(ctx.clamp_min(7)), target.after(ctx.clamp_min(7))], 1)
    v = verify_chain(torch.full((N_FIRST, 2), 7), None, p)
    assert tv(v.output_tokens[:, 0], target.first) < 0.01


@pytest.mark.parametrize("case", CASES)
def test_chain_joint_of_first_two_tokens_follows_p_chain_rule(case):
    gen = torch.Generator().manual_seed(3)
    target, drafter = markov(8, gen, **CASES[case][0]), markov(8, gen, **CASES[case][1])
    torch.manual_seed(0)

    def block(ctx):
        v = chain_block(target, drafter, ctx, 3, gen)
        return v.output_tokens, v.accepted

    y = two_tokens(block, target, N_JOINT)
    assert tv(y[:, 0] * 8 + y[:, 1], target.pair_law()) < 0.01


def test_chain_statistics_detect_a_verifier_given_the_wrong_q():
    gen = torch.Generator().manual_seed(4)
    target, drafter, other = markov(10, gen), markov(10, gen), markov(10, gen)
    ctx = torch.full((N_FIRST,), -1)
    wrong_q = torch.stack([other.after(ctx)] * 3, 1)
    v = chain_block(target, drafter, ctx, 3, gen, fixed_q=wrong_q)
    assert tv(v.output_tokens[:, 0], target.first) > 0.03


# --------------------------------------------------------------------------------------------- mixture


@pytest.mark.parametrize("weights", [(0.5, 0.5), (3.0, 1.0)])
def test_mixture_drafting_is_lossless_when_q_is_the_mixture(weights):
    gen = torch.Generator().manual_seed(5)
    target = markov(10, gen)
    members = markov(10, gen, members=2, scale=2.5)  # e.g. multimodal and text-only contexts of IbED
    mixture = Markov(mix_distributions(members.first, weights), mix_distributions(members.step, weights))
    torch.manual_seed(0)
    ctx = torch.full((N_FIRST,), -1)
    v = chain_block(target, mixture, ctx, 3, gen)
    assert tv(v.output_tokens[:, 0], target.first) < 0.01
    # Telling the verifier one member's q instead (the draft still came from the mixture) is biased.
    member_q = torch.stack([members.first[0].expand(N_FIRST, 10)] * 3, 1)
    v = chain_block(target, mixture, ctx, 3, gen, fixed_q=member_q)
    assert tv(v.output_tokens[:, 0], target.first) > 0.03


def test_mix_distributions_validates_weights():
    qs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    torch.testing.assert_close(mix_distributions(qs, [3, 1]), torch.tensor([0.875, 0.125]))
    torch.testing.assert_close(mix_distributions(list(qs), torch.tensor([1.0, 0.0])), qs[0])
    for bad in ([1.0, -1.0], [0.0, 0.0], [1.0, float("nan")], [1.0]):
        with pytest.raises(ValueError, match="weights"):
            mix_distributions(qs, bad)
    with pytest.raises(ValueError, match="qs"):
        mix_distributions(torch.ones(3), [1, 1, 1])


# ------------------------------------------------------------------------------------------------ tree

K1, K2 = 3, 2  # root children, children per root child
PARENTS = torch.tensor([-1] * K1 + [i for i in range(K1) for _ in range(K2)])  # [N] = [9]
MODES = {
    # mode: (how siblings are drawn, verify_tree's siblings argument)
    "without_replacement": ("wor", "without_replacement"),
    "iid": ("iid", "independent"),
    "members": ("members", "independent"),  # sibling k drawn from ensemble member k, independently
    "deterministic_top_k": ("topk", "without_replacement"),  # q = None
    "wor_verified_as_independent": ("wor", "independent"),  # wrong convention: must be caught
}


def draw_children(drafter: Markov, ctx: torch.Tensor, k: int, how: str, gen):
    """k children after ctx [B]: tokens [B, k] and the q each was drawn from [B, k, V] (None if deterministic)."""
    if how == "members":
        q = drafter.after(ctx)[:, :k]  # [B, k, V], member j drafts sibling j
        return sample(q, gen), q
    q = drafter.after(ctx)  # [B, V]
    q = q[:, 0] if q.ndim == 3 else q
    if how == "topk":
        return q.topk(k, -1).indices, None
    tokens = sample_without_replacement(q, k, gen) if how == "wor" else sample(q[:, None].expand(-1, k, -1), gen)
    return tokens, q[:, None].expand(-1, k, -1)


def tree_block(target: Markov, drafter: Markov, ctx: torch.Tensor, mode: str, gen):
    how, siblings = MODES[mode]
    t1, q1 = draw_children(drafter, ctx, K1, how, gen)  # [B, K1]
    level2 = [draw_children(drafter, t1[:, i], K2, how, gen) for i in range(K1)]
    tokens = torch.cat([t1] + [t for t, _ in level2], 1)  # [B, N]
    q = None if q1 is None else torch.cat([q1] + [qq for _, qq in level2], 1)  # [B, N, V]
    p = torch.stack([target.after(ctx)] + [target.after(tokens[:, i]) for i in range(tokens.shape[1])], 1)
    v = verify_tree(PARENTS.expand(ctx.shape[0], -1), tokens, q, p, siblings=siblings)
    return v.output_tokens, v.accepted


@pytest.mark.parametrize("case", ["random", "zeros_both_ways"])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "wor_verified_as_independent"])
def test_tree_joint_of_first_two_tokens_follows_p_chain_rule(mode, case):
    gen = torch.Generator().manual_seed(6)
    target = markov(6, gen, **CASES[case][0])
    drafter = markov(6, gen, members=K1 if mode == "members" else 0, **CASES[case][1])
    torch.manual_seed(0)
    first_block = []

    def block(ctx):
        out, accepted = tree_block(target, drafter, ctx, mode, gen)
        first_block.append(accepted)
        return out, accepted

    y = two_tokens(block, target, N_TREE)
    assert first_block[0].float().mean() > 0.3  # trees get accepted, often two levels deep
    assert (first_block[0] == 2).float().mean() > 0.02
    assert tv(y[:, 0], target.first) < 0.01
    assert tv(y[:, 0] * 6 + y[:, 1], target.pair_law()) < 0.01


def test_tree_statistics_detect_siblings_verified_under_the_wrong_convention():
    gen = torch.Generator().manual_seed(7)
    target, drafter = markov(8, gen, scale=0.5), markov(8, gen, scale=3.0)
    torch.manual_seed(0)
    out, _ = tree_block(target, drafter, torch.full((N_FIRST,), -1), "wor_verified_as_independent", gen)
    assert tv(out[:, 0], target.first) > 0.03
