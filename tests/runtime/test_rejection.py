"""Chain verification: decisions, padding, seeding, edge cases (statistics live in test_losslessness.py)."""

from __future__ import annotations

import pytest
import torch

import specula.runtime.core.chain_rejection as rejection
from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import sample


def one_hot(ids: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def random_block(batch: int, gamma: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen) * 2, -1)  # [B, gamma, V]
    p = torch.softmax(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, -1)  # [B, gamma + 1, V]
    draft = sample(q, gen)  # [B, gamma]
    return draft, q, p


def seeded(batch: int, base: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + b) for b in range(batch)]


def test_perfect_match_accepts_all_and_adds_bonus():
    p = one_hot([[3, 1, 4, 2]], 6)  # argmax chain 3, 1, 4 and bonus 2
    v = verify_chain(torch.tensor([[3, 1, 4]]), None, p, greedy=True)
    assert v.accepted.tolist() == [3] and v.next_token.tolist() == [2]
    assert v.output_tokens.tolist() == [[3, 1, 4, 2]] and v.num_emitted.tolist() == [4]
    # Sampled: when q == p every draft is accepted whatever the seed.
    draft, q, p = random_block(32, 4, 9, seed=1)
    p = torch.cat([q, p[:, -1:]], 1)
    v = verify_chain(draft, q, p, generators=seeded(32))
    assert v.accepted.tolist() == [4] * 32
    assert torch.equal(v.output_tokens[:, :4], draft)


def test_early_mismatch_greedy():
    p = one_hot([[3, 1, 4, 2]], 6)
    v = verify_chain(torch.tensor([[3, 5, 4]]), None, p, greedy=True)
    assert v.accepted.tolist() == [1] and v.next_token.tolist() == [1]
    assert v.output_tokens.tolist() == [[3, 1, -1, -1]]
    v = verify_chain(torch.tensor([[0, 1, 4]]), None, p, greedy=True)
    assert v.output_tokens.tolist() == [[3, -1, -1, -1]]


def test_rows_with_different_num_draft():
    p = torch.stack([one_hot([3, 1, 4, 2], 6)] * 3)  # [3, 4, 6]
    draft = torch.tensor([[3, 1, 4], [3, -1, -1], [-1, -1, -1]])  # padded with -1
    v = verify_chain(draft, None, p, num_draft=[3, 1, 0], greedy=True)
    assert v.accepted.tolist() == [3, 1, 0]
    assert v.next_token.tolist() == [2, 1, 3]  # each row's bonus comes from p[:, num_draft]
    assert v.output_tokens.tolist() == [[3, 1, 4, 2], [3, 1, -1, -1], [3, -1, -1, -1]]
    # A padded position is never accepted, even when it happens to hold the argmax.
    v = verify_chain(torch.tensor([[3, 1, 4]]), None, p[:1], num_draft=torch.tensor([2]), greedy=True)
    assert v.output_tokens.tolist() == [[3, 1, 4, -1]]
    with pytest.raises(ValueError, match="num_draft"):
        verify_chain(draft, None, p, num_draft=[4, 1, 0], greedy=True)


def test_worked_example_from_the_docstring(monkeypatch):
    q = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    p = torch.tensor([[[0.4, 0.4, 0.2], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]])
    fixed = torch.tensor([[0.5, 0.9, 0.7]], dtype=torch.float64)
    monkeypatch.setattr(rejection, "draw_uniforms", lambda *a, **k: fixed)
    v = verify_chain(torch.tensor([[0, 2]]), q, p)
    assert (v.accepted.item(), v.next_token.item(), v.output_tokens.tolist()) == (1, 1, [[0, 1, -1]])


def test_same_seed_same_output_and_different_seeds_differ():
    draft, q, p = random_block(64, 5, 11, seed=2)
    a = verify_chain(draft, q, p, generators=seeded(64))
    b = verify_chain(draft, q, p, generators=seeded(64))
    c = verify_chain(draft, q, p, generators=seeded(64, base=1000))
    assert torch.equal(a.output_tokens, b.output_tokens)
    assert not torch.equal(a.output_tokens, c.output_tokens)


def test_row_output_is_independent_of_batch_composition():
    draft, q, p = random_block(8, 5, 11, seed=3)
    counts = [5, 2, 0, 5, 3, 1, 4, 5]
    greedy = [False, True, False, False, True, False, False, False]
    batched = verify_chain(draft, q, p, num_draft=counts, generators=seeded(8), greedy=greedy)
    for b in range(8):
        n = counts[b]  # alone, the row's block is only as wide as its own drafts
        alone = verify_chain(draft[b : b + 1, :n], q[b : b + 1, :n], p[b : b + 1, : n + 1], num_draft=[n],
                             generators=[torch.Generator().manual_seed(b)], greedy=greedy[b])
        assert alone.output_tokens[0].tolist() == batched.output_tokens[b, : n + 1].tolist()


def test_no_drafts_is_a_plain_sampling_step_from_the_same_seed():
    _, _, p = random_block(16, 0, 30, seed=4)  # [16, 1, 30]
    v = verify_chain(torch.empty(16, 0, dtype=torch.long), None, p, generators=seeded(16))
    assert torch.equal(v.next_token, sample(p[:, 0], seeded(16)))


def test_draft_impossible_under_p_is_always_rejected():
    p = torch.tensor([[[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]]]).expand(500, 2, 3)
    q = torch.tensor([[[0.9, 0.05, 0.05]]]).expand(500, 1, 3)
    v = verify_chain(torch.zeros(500, 1, dtype=torch.long), q, p, generators=seeded(500))
    assert (v.accepted == 0).all() and (v.next_token != 0).all()


def test_draft_with_zero_q_is_rejected_and_zero_residual_falls_back_to_p():
    # The drafter claims token 2 has q = 0: it cannot have sampled it, so it is rejected. Here p == q, so the
    # residual max(0, p - q) is all zero and the recovered token comes from p.
    probs = torch.tensor([0.5, 0.5, 0.0])
    p = probs.expand(400, 2, 3)
    q = probs.expand(400, 1, 3)
    v = verify_chain(torch.full((400, 1), 2), q, p, generators=seeded(400))
    assert (v.accepted == 0).all() and set(v.next_token.tolist()) == {0, 1}


def test_deterministic_drafter_without_q_accepts_with_probability_p():
    p = torch.tensor([[0.25, 0.75], [0.5, 0.5]]).expand(40_000, 2, 2)
    v = verify_chain(torch.ones(40_000, 1, dtype=torch.long), None, p)
    assert abs(v.accepted.double().mean().item() - 0.75) < 0.01
    assert (v.next_token[v.accepted == 0] == 0).all()  # the residual is p without the rejected token


def test_mixed_greedy_and_sampled_rows():
    draft, q, p = random_block(6, 3, 7, seed=5)
    mask = torch.tensor([True, False, True, False, True, False])
    mixed = verify_chain(draft, q, p, generators=seeded(6), greedy=mask)
    greedy = verify_chain(draft, q, p, greedy=True)
    sampled = verify_chain(draft, q, p, generators=seeded(6))
    want = torch.where(mask[:, None], greedy.output_tokens, sampled.output_tokens)
    assert torch.equal(mixed.output_tokens, want)


def test_bad_shapes_raise_value_error_naming_the_argument():
    draft, q, p = random_block(2, 3, 5, seed=6)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify_chain(draft.float(), q, p)
    with pytest.raises(ValueError, match="p must be"):
        verify_chain(draft, q, p[:, :3])
    with pytest.raises(ValueError, match="q must be"):
        verify_chain(draft, q[..., :4], p)
    with pytest.raises(ValueError, match="generators"):
        verify_chain(draft, q, p, generators=seeded(1))
    with pytest.raises(ValueError, match="greedy"):
        verify_chain(draft, q, p, greedy=[True])
