"""SamplingParams validation, the logits -> p transform, and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch

from specula.runtime.core.sampling import (
    SamplingParams,
    draw_uniforms,
    inverse_cdf,
    logits_to_probs,
    sample,
    sample_without_replacement,
)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
        ("top_k", -1), ("top_k", 2.5), ("top_k", True),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
        ("min_p", 1.0), ("min_p", -0.1),
        ("seed", -1), ("seed", 2**64), ("seed", "7"),
        ("max_tokens", 0), ("max_tokens", 3.0),
        ("stop", "\n"), ("stop", [""]), ("stop", [3]),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_defaults_are_greedy_and_stop_is_a_tuple():
    assert SamplingParams().is_greedy
    sp = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=3, max_tokens=8, stop=["a", "b"])
    assert not sp.is_greedy and sp.stop == ("a", "b") and isinstance(sp.temperature, float)
    with pytest.raises(AttributeError):
        sp.temperature = 1.0  # frozen


def test_temperature_zero_gives_one_hot_on_the_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.5))
    assert torch.equal(probs, torch.tensor([[0.0, 1, 0, 0], [1, 0, 0, 0]]))


def reference_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """A slow, literal reading of the rules, one row at a time, in float64."""
    v = logits.shape[-1]
    z = [float(t) / sp.temperature for t in logits]
    keep = [True] * v
    if 0 < sp.top_k < v:
        kth = sorted(z, reverse=True)[sp.top_k - 1]
        keep = [zi >= kth for zi in z]

    def softmax(mask):
        m = max(zi for zi, k in zip(z, mask) if k)
        e = [math.exp(zi - m) if k else 0.0 for zi, k in zip(z, mask)]
        s = sum(e)
        return [x / s for x in e]

    if sp.top_p < 1:
        pr = softmax(keep)
        order = sorted(range(v), key=lambda i: (-z[i], i))
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= sp.top_p or not keep[i]:
                break
            nucleus.add(i)
            mass += pr[i]
        keep = [i in nucleus for i in range(v)]
    if sp.min_p > 0:
        pr = softmax(keep)
        top = max(pr)
        keep = [k and pr_i >= sp.min_p * top for k, pr_i in zip(keep, pr)]
    return torch.tensor(softmax(keep), dtype=torch.float64)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0), dict(temperature=0.6, top_k=3), dict(temperature=1.3, top_k=50),
        dict(temperature=1.0, top_p=0.5), dict(temperature=2.0, top_p=0.93), dict(temperature=1.0, min_p=0.1),
        dict(temperature=0.8, top_k=6, top_p=0.8, min_p=0.05), dict(temperature=1.0, top_p=1e-6),
    ],
)
def test_top_k_top_p_min_p_match_a_reference_computation(kw):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(16, 12, generator=gen) * 2
    sp = SamplingParams(**kw)
    probs = logits_to_probs(logits, sp)
    assert probs.dtype == torch.float32
    for row, got in zip(logits, probs):
        want = reference_probs(row, sp)
        torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)


def test_top_k_keeps_ties_with_the_kth_logit_and_top_p_always_keeps_the_argmax():
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0])
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_per_row_params_equal_single_row_calls():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 3, 20, generator=gen)  # [B, gamma + 1, V], the verifier's shape
    params = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=1.5, min_p=0.1, top_k=8)]
    batched = logits_to_probs(logits, params)
    for b, sp in enumerate(params):
        torch.testing.assert_close(batched[b], logits_to_probs(logits[b], sp), atol=1e-7, rtol=0)
        # the plain decoder's shape [V] gives the same p as the verifier's
        torch.testing.assert_close(batched[b, 1], logits_to_probs(logits[b, 1], sp), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="one per leading row"):
        logits_to_probs(logits, params[:3])


def test_low_precision_logits_give_fp32_rows_summing_to_one():
    logits = torch.randn(5, 300).bfloat16()
    probs = logits_to_probs(logits, SamplingParams(temperature=0.9, top_p=0.95))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_same_seed_same_samples_and_different_seeds_differ():
    probs = torch.softmax(torch.randn(64, 50), -1)
    a = sample(probs, SamplingParams(seed=5).make_generator())
    b = sample(probs, SamplingParams(seed=5).make_generator())
    c = sample(probs, SamplingParams(seed=6).make_generator())
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_sample_row_is_independent_of_batch_composition():
    probs = torch.softmax(torch.randn(6, 3, 40), -1)  # [B, k, V]
    gens = [torch.Generator().manual_seed(100 + b) for b in range(6)]
    batched = sample(probs, gens)  # [B, k]
    for b in range(6):
        alone = sample(probs[b : b + 1], [torch.Generator().manual_seed(100 + b)])
        assert torch.equal(alone[0], batched[b])


def test_sample_follows_probs_and_never_picks_zero_probability_tokens():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    ids = sample(probs.expand(200_000, 6), torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=6).double() / ids.numel()
    assert freq[probs == 0].sum() == 0
    assert 0.5 * (freq - probs.double()).abs().sum() < 0.01


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    u = torch.tensor([1.0 - 1e-17, 0.3, 0.999999], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [2, -1, 1]  # unnormalized rows are fine; no mass -> -1


def test_sample_without_replacement_is_distinct_and_in_draw_order():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 200_000
    ids = sample_without_replacement(probs.expand(n, 5), 2, torch.Generator().manual_seed(1))  # [n, 2]
    assert (ids[:, 0] != ids[:, 1]).all() and (ids >= 0).all() and (ids < 4).all()
    p = probs.double()
    second = (p[:, None] * p[None, :] / (1 - p[:, None])).fill_diagonal_(0).sum(0)  # P(second draw = j)
    for col, want in ((0, p), (1, second)):
        freq = torch.bincount(ids[:, col], minlength=5).double() / n
        assert 0.5 * (freq - want).abs().sum() < 0.01
    assert (sample_without_replacement(probs, 5)[-1] == -1).item()  # only 4 tokens have mass


def test_draw_uniforms_consumes_exactly_the_counts_per_row():
    gens = [torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)]
    u = draw_uniforms(gens, [3, 0], 4, "cpu")
    assert u.dtype == torch.float64 and u[1].abs().sum() == 0 and u[0, 3] == 0
    follow = torch.rand(1, generator=gens[1], dtype=torch.float64)  # row 1's generator was not touched
    assert follow.item() == u[0, 0].item()
    with pytest.raises(ValueError, match="one per row"):
        draw_uniforms(gens[:1], [1, 1], 2, "cpu")
