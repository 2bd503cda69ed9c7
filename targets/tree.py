"""Draft-block geometry: checks, ancestor masks and depths for a chain or a tree of draft nodes.

Everything here runs on host tensors (the block structure is small); the caller moves results to the device.

Verify slot layout per row: slot 0 is the pending token (the root), slot 1 + i is draft node i. A slot attends to
itself and its ancestors, and its position id is the pending token's position plus its depth.
"""

from __future__ import annotations

import torch


def chain_parents(batch: int, num_nodes: int) -> torch.Tensor:
    """Parents of a chain: node i hangs off node i - 1 (node 0 off the pending token)."""
    return (torch.arange(num_nodes, dtype=torch.long) - 1).expand(batch, num_nodes).clone()  # [B, N] int64


def check_parents(parents: torch.Tensor, counts: torch.Tensor) -> None:
    """ValueError unless, within each row's count, -1 <= parent[i] < i (a parent precedes its child)."""
    num_nodes = parents.shape[1]
    node = torch.arange(num_nodes)  # [N]
    live = node[None, :] < counts[:, None]  # [B, N] bool
    bad = live & ((parents < -1) | (parents >= node[None, :]))  # [B, N] bool
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"draft block row {b}: node {i} has parent {int(parents[b, i])}; a parent must precede its child "
            f"(-1 <= parent < {i}, -1 = attached to the pending token)"
        )


def block_structure(parents: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask and depth of every verify slot.

    Example, a tree ``parents = [[-1, -1, 0]]`` (counts [3]) gives slots root, n0, n1, n2 with depths
    ``[0, 1, 1, 2]``; slot 3 (n2) sees slots 0, 1 and 3.

    Padded slots (past a row's count) see only themselves and get depth 0.
    """
    batch, num_nodes = parents.shape
    n = num_nodes + 1
    rows = torch.arange(batch)  # [B]
    live = torch.arange(num_nodes)[None, :] < counts[:, None]  # [B, N] bool
    parent_slot = torch.where(live, parents + 1, 0)  # [B, N] int64, slot of each node's parent
    allowed = torch.eye(n, dtype=torch.bool).expand(batch, n, n).clone()  # [B, n, n] bool, query x key
    depth = torch.zeros(batch, n, dtype=torch.long)  # [B, n] int64
    for i in range(num_nodes):  # parents precede children, so one pass in order suffices
        s = i + 1
        p = parent_slot[:, i]  # [B]
        inherit = allowed[rows, p] & live[:, i : i + 1]  # [B, n] bool
        allowed[:, s] |= inherit
        depth[:, s] = torch.where(live[:, i], depth[rows, p] + 1, 0)
    return allowed, depth


def chain_structure(counts: torch.Tensor, num_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_structure(chain_parents(B, N), counts)`` in closed form (no loop over nodes).

    Slot s <= counts[b] of a chain sees slots 0..s and has depth s; padded slots see only themselves, depth 0.
    """
    n = num_nodes + 1
    slot = torch.arange(n)  # [n]
    live = slot[None, :] <= counts[:, None]  # [B, n] bool (slot 0, the pending token, is always live)
    tril = slot[:, None] >= slot[None, :]  # [n, n] bool, query x key
    allowed = torch.where(live[:, :, None], tril, torch.eye(n, dtype=torch.bool))  # [B, n, n] bool
    depth = torch.where(live, slot, 0)  # [B, n] int64
    return allowed, depth


def check_path(parents: torch.Tensor | None, count: int, path: tuple[int, ...], request_id: str) -> None:
    """ValueError unless ``path`` walks from the root down one branch of this row's tree.

    ``parents`` is the row's [N] parent vector (None: a chain of ``count`` nodes); ``path[0]`` must hang off the
    pending token and each next node must be a child of the previous one.
    """
    if parents is None:
        if len(path) <= count and path == tuple(range(len(path))):
            return  # a chain's only root-to-leaf walks are its prefixes
        parents = chain_parents(1, count)[0]  # [N] int64: the general check names the problem
    prev = -1
    for k, node in enumerate(path):
        if not 0 <= node < count:
            raise ValueError(f"accept for {request_id!r}: path node {node} is outside the block's {count} nodes")
        if int(parents[node]) != prev:
            raise ValueError(
                f"accept for {request_id!r}: path {list(path)} is not root-to-leaf; node {node} (step {k}) has "
                f"parent {int(parents[node])}, expected {prev}"
            )
        prev = node
