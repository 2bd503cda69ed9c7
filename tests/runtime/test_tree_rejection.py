"""Tree verification: greedy paths, agreement with chain verification, seeding, padding, errors."""

from __future__ import annotations

import pytest
import torch

from specula.runtime.core.chain_rejection import verify_chain
from specula.runtime.core.sampling import sample
from specula.runtime.core.tree_rejection import verify_tree


def one_hot(ids, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def seeded(batch: int, base: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + b) for b in range(batch)]


def test_greedy_follows_the_matching_child_and_emits_argmax_at_the_end():
    # slots: prefix, n0, n1, n2, n3; argmax p per slot: 7, -, 3, -, 8
    parents = torch.tensor([[-1, -1, 0, 1]])
    tokens = torch.tensor([[5, 7, 9, 3]])
    p = one_hot([[7, 0, 3, 0, 8]], 10)
    v = verify_tree(parents, tokens, None, p, greedy=True)
    assert v.paths() == [(1, 3)] and v.next_token.tolist() == [8]
    assert v.output_tokens.tolist() == [[7, 3, 8, -1, -1]]


def test_greedy_root_mismatch_emits_argmax_of_the_prefix():
    v = verify_tree(torch.tensor([[-1, -1]]), torch.tensor([[1, 2]]), None, one_hot([[4, 0, 0]], 5), greedy=True)
    assert v.paths() == [()] and v.accepted.tolist() == [0] and v.output_tokens.tolist() == [[4, -1, -1]]


def test_greedy_takes_the_longest_path_among_equal_token_siblings():
    # n0 and n1 both carry the argmax 2; only n1's child n3 continues the argmax chain (n2 under n0 does not).
    parents = torch.tensor([[-1, -1, 0, 1, 3]])
    tokens = torch.tensor([[2, 2, 5, 6, 1]])
    p = one_hot([[2, 4, 6, 0, 1, 3]], 8)  # slots prefix, n0..n4
    v = verify_tree(parents, tokens, None, p, greedy=True)
    assert v.paths() == [(1, 3, 4)] and v.next_token.tolist() == [3]


def chain_block(batch, gamma, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.softmax(torch.randn(batch, gamma, vocab, generator=gen) * 2, -1)
    p = torch.softmax(torch.randn(batch, gamma + 1, vocab, generator=gen) * 2, -1)
    return sample(q, gen), q, p


@pytest.mark.parametrize("siblings", ["without_replacement", "independent"])
def test_tree_on_a_chain_matches_verify_chain(siblings):
    batch, gamma = 64, 5
    draft, q, p = chain_block(batch, gamma, 9, seed=7)
    counts = torch.randint(0, gamma + 1, (batch,), generator=torch.Generator().manual_seed(1))
    greedy = torch.arange(batch) % 4 == 0
    parents = (torch.arange(gamma) - 1).expand(batch, gamma)
    for qq in (q, None):
        chain = verify_chain(draft, qq, p, num_draft=counts, generators=seeded(batch), greedy=greedy)
        tree = verify_tree(parents, draft, qq, p, counts=counts, generators=seeded(batch), greedy=greedy,
                           siblings=siblings)
        assert torch.equal(tree.accepted, chain.accepted)
        assert torch.equal(tree.output_tokens, chain.output_tokens)
        assert all(path == tuple(range(n)) for path, n in zip(tree.paths(), chain.accepted.tolist()))


def random_trees(batch, num, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(1, num)])
                           for _ in range(batch)])  # [B, N]
    q = torch.softmax(torch.randn(batch, num, vocab, generator=gen), -1)
    p = torch.softmax(torch.randn(batch, num + 1, vocab, generator=gen) * 2, -1)
    tokens = sample(q, gen)
    return parents, tokens, q, p


def test_accepted_paths_walk_root_to_leaf_and_padding_is_ignored():
    batch, num = 200, 12
    parents, tokens, q, p = random_trees(batch, num, 4, seed=8)  # tiny vocab: long accepted paths happen
    counts = torch.randint(0, num + 1, (batch,), generator=torch.Generator().manual_seed(2))
    v = verify_tree(parents, tokens, q, p, counts=counts, generators=seeded(batch), siblings="independent")
    assert v.accepted.max() >= 2
    for b, path in enumerate(v.paths()):
        prev = -1
        for k, node in enumerate(path):
            assert node < counts[b] and parents[b, node] == prev and v.output_tokens[b, k] == tokens[b, node]
            prev = node
        assert v.output_tokens[b, len(path)] == v.next_token[b] and (v.output_tokens[b, len(path) + 1 :] == -1).all()
    # Garbage in padded nodes changes nothing.
    junk_parents = torch.where(torch.arange(num) < counts[:, None], parents, 99)
    junk_tokens = torch.where(torch.arange(num) < counts[:, None], tokens, -5)
    w = verify_tree(junk_parents, junk_tokens, q, p, counts=counts, generators=seeded(batch), siblings="independent")
    assert torch.equal(w.output_tokens, v.output_tokens)


def test_same_seed_same_output_and_rows_independent_of_batch_composition():
    batch, num = 10, 8
    parents, tokens, q, p = random_trees(batch, num, 6, seed=9)
    a = verify_tree(parents, tokens, q, p, generators=seeded(batch), siblings="independent")
    b = verify_tree(parents, tokens, q, p, generators=seeded(batch), siblings="independent")
    c = verify_tree(parents, tokens, q, p, generators=seeded(batch, base=50), siblings="independent")
    assert torch.equal(a.output_tokens, b.output_tokens) and not torch.equal(a.output_tokens, c.output_tokens)
    for r in range(batch):
        alone = verify_tree(parents[r : r + 1], tokens[r : r + 1], q[r : r + 1], p[r : r + 1],
                            generators=[torch.Generator().manual_seed(r)], siblings="independent")
        assert torch.equal(alone.output_tokens[0], a.output_tokens[r])


def test_all_candidates_rejected_emits_from_the_residual():
    # Three deterministic candidates for one slot where p puts all mass on token 3: all three are rejected,
    # and the next token is 3.
    p = torch.zeros(300, 4, 5)
    p[:, :, 3] = 1.0
    tokens = torch.tensor([[0, 1, 2]]).expand(300, 3)
    parents = torch.full((300, 3), -1)
    v = verify_tree(parents, tokens, None, p, generators=seeded(300))
    assert (v.accepted == 0).all() and (v.next_token == 3).all()


def test_empty_tree_is_a_plain_decoding_step():
    p = torch.softmax(torch.randn(5, 1, 7), -1)
    empty = torch.empty(5, 0, dtype=torch.long)
    v = verify_tree(empty, empty, None, p, generators=seeded(5))
    assert torch.equal(v.next_token, sample(p[:, 0], seeded(5)))
    g = verify_tree(empty, empty, None, p, greedy=True)
    assert torch.equal(g.next_token, p[:, 0].argmax(-1))


def test_invalid_trees_raise_value_error():
    parents, tokens, q, p = random_trees(2, 4, 5, seed=10)
    with pytest.raises(ValueError, match="parent"):
        verify_tree(torch.tensor([[-1, 1, 0, 0], [-1, 0, 0, 0]]), tokens, q, p)
    with pytest.raises(ValueError, match="p must be"):
        verify_tree(parents, tokens, q, p[:, :4])
    with pytest.raises(ValueError, match="q must be"):
        verify_tree(parents, tokens, q[:, :3], p)
    with pytest.raises(ValueError, match="siblings"):
        verify_tree(parents, tokens, q, p, siblings="sorted")
    with pytest.raises(ValueError, match="counts"):
        verify_tree(parents, tokens, q, p, counts=[5, 1])
