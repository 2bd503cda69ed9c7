"""Tree verification equals chain verification on every root-to-leaf path, and committing a tree path leaves
the same cache as decoding that path one token at a time."""

from __future__ import annotations

import torch

from specula.targets import Accept, DraftBlock

ATOL = 1e-4

# Two trees (7 and 5 nodes, padded to 7): parents precede children, -1 hangs off the pending token.
PARENTS = torch.tensor([[-1, -1, 0, 0, 1, 2, 5], [-1, 0, 0, 1, 3, -1, -1]])
COUNTS = (7, 5)


def _paths(parents: list[int], count: int) -> list[tuple[int, ...]]:
    """Every root-to-leaf path of one row, as node indices."""
    children = {i: [] for i in range(-1, count)}
    for i in range(count):
        children[parents[i]].append(i)
    out = []

    def walk(node, path):
        if not children[node]:
            out.append(tuple(path))
        for c in children[node]:
            walk(c, path + [c])

    walk(-1, [])
    return out


def test_tree_logits_equal_chain_logits_on_every_path(kit):
    target = kit.target(feature_layers=(1,))
    prompts = [kit.request("t0", [3, 4], [0], seed=11), kit.request("t1", [5, 2], [1], seed=12)]
    target.prefill(prompts)
    target.commit([Accept("t0", (), 7), Accept("t1", (), 8)])
    tokens = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(5))
    tree = target.verify(DraftBlock(("t0", "t1"), tokens, PARENTS, COUNTS))
    assert tree.logits.shape[:2] == (2, 8)

    # All paths of both trees as chains, in one batch of fresh requests with the same prompts and first token.
    chains, expect = [], []
    for row, prompt in enumerate(prompts):
        for path in _paths(PARENTS[row].tolist(), COUNTS[row]):
            chains.append((prompt, path))
            expect.append((row, path))
    ids = [f"c{j}" for j in range(len(chains))]
    reqs = [type(p)(rid, p.input_ids, p.pixel_values, p.image_grid_thw) for rid, (p, _) in zip(ids, chains)]
    target.commit([Accept("t0", (), 1), Accept("t1", (), 1)])  # close the tree block (keeps only pending)
    target.prefill(reqs)
    target.commit([Accept(rid, (), 7 if row == 0 else 8) for rid, (row, _) in zip(ids, expect)])
    width = max(len(p) for _, p in expect)
    chain_tokens = torch.zeros(len(ids), width, dtype=torch.long)
    for j, (row, path) in enumerate(expect):
        chain_tokens[j, : len(path)] = tokens[row, list(path)]
    chain = target.verify(DraftBlock.chain(ids, chain_tokens, counts=[len(p) for _, p in expect]))
    for j, (row, path) in enumerate(expect):
        slots = [0] + [1 + i for i in path]
        n = len(slots)
        torch.testing.assert_close(tree.logits[row, slots], chain.logits[j, :n], atol=ATOL, rtol=0)
        torch.testing.assert_close(tree.features.hidden[row, slots], chain.features.hidden[j, :n], atol=ATOL, rtol=0)
        tree_k, chain_k = tree.features.last_k[row, :, slots], chain.features.last_k[j, :, :n]
        torch.testing.assert_close(tree_k, chain_k, atol=ATOL, rtol=0)


def test_commit_tree_path_matches_recompute(kit):
    target = kit.target()
    prompts = [kit.request("t0", [3, 4], [0], seed=11), kit.request("t1", [5, 2], [1], seed=12)]
    target.prefill(prompts)
    target.commit([Accept("t0", (), 7), Accept("t1", (), 8)])
    tokens = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(6))
    target.verify(DraftBlock(("t0", "t1"), tokens, PARENTS, COUNTS))
    # Deep, non-prefix paths: node slots are not contiguous, so commit must gather them into place.
    target.commit([Accept("t0", (1, 4), 30), Accept("t1", (0, 1, 3, 4), 31)])
    assert target.sequence("t0")[-4:] == [7, *tokens[0, [1, 4]].tolist(), 30]
    assert target.sequence("t1")[-6:] == [8, *tokens[1, [0, 1, 3, 4]].tolist(), 31]
    drafts = torch.randint(3, 90, (2, 3), generator=torch.Generator().manual_seed(7))
    res = target.verify(DraftBlock.chain(("t0", "t1"), drafts))
    for row, prompt in enumerate(prompts):
        ref = kit.recompute(prompt, target.sequence(prompt.request_id) + drafts[row].tolist())
        torch.testing.assert_close(res.logits[row], ref.logits[0, -4:], atol=ATOL, rtol=0)
