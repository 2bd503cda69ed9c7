"""Tree verification: multi-candidate recursive rejection sampling over a tree of drafts, batched over rows.

A row's tree: node i carries token ``tokens[i]`` and hangs off ``parents[i]`` (-1 = off the last committed
token; a parent precedes its children). ``p[0]`` is the target after the committed prefix and ``p[i + 1]`` the
target after node i's path. Children of a node are tried in index order.

Sampled rows (SpecInfer's multi-candidate rejection sampling; without replacement as in Jeon et al. 2024,
"Recursive Speculative Decoding"): at the current node start with p_res = p at that node; for each child c
in order, with q_c the law c's token was drawn from *given the earlier siblings* (see ``siblings`` below):
    accept c with probability min(1, p_res(x_c) / q_c(x_c)) -> descend into c and restart there;
    else p_res <- norm(max(0, p_res - q_c)) and try the next child.
If no child is accepted (or there are none), the next token is sampled from p_res.

Why it is lossless. One step is ordinary speculative sampling with target p_res and draft q_c:
    P(emit y) = min(p_res, q_c)(y) + (1 - sum min(p_res, q_c)) * norm(max(0, p_res - q_c))(y) = p_res(y),
provided that after a rejection the token is distributed as the next residual. The next residual depends only
on (p_res, q_c), not on x_c, and the next child's token has law q_{c+1} given everything before, so by
induction from the last child (whose fallback is an exact sample from p_res) the first emitted token follows
p at the node. A rejected x_c gets residual mass max(0, p_res - q_c)(x_c) = 0 (rejection needs
p_res(x_c) < q_c(x_c)), so a token is never emitted through two siblings. Given an accepted child, its
subtree was drafted given its own path and independently of the verifier's uniforms, so the same argument
applies one level down: every emitted token follows the target's conditional, exactly as in plain decoding.

The requirement on the drafter is therefore: the law of each child given its parent's path and its earlier
siblings is what the verifier uses as q_c. Two conventions, chosen by ``siblings``:
- "without_replacement" (default): ``q[i]`` is the distribution node i was drawn from given its parent (all
  siblings drawn from it), siblings drawn one after another without replacement and kept in draw order
  (``sampling.sample_without_replacement``; do not re-sort them). The verifier uses
  q_c = q[c] with the earlier siblings' tokens removed, renormalized. No duplicate siblings, so no draft
  is wasted; this is the default because it accepts more than i.i.d. siblings.
- "independent": ``q[i]`` is used as given: siblings drawn i.i.d. with replacement from one q (duplicates
  allowed, a duplicate of a rejected token is always rejected), or each sibling from its own q independently
  of the others (e.g. one per ensemble member).
``q=None`` means a deterministic drafter (e.g. top-k children): q_c is one-hot on x_c, valid under either
convention as long as siblings are distinct; a child's acceptance probability is then p_res(x_c).

Greedy rows: follow the child whose token equals argmax p at the current node, choosing among equal-token
siblings the one with the longest such continuation; the next token is argmax p at the end of that path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .chain_rejection import host_list
from .sampling import Generators, draw_uniforms, inverse_cdf

SIBLING_MODES = ("without_replacement", "independent")


@dataclass(frozen=True)
class TreeVerdict:
    """What one verification of a tree block decided, per row."""

    path: torch.Tensor  # [B, N] int64, accepted node indices root -> leaf, padded with -1
    accepted: torch.Tensor  # [B] int64, length of the accepted path (accepted draft tokens)
    next_token: torch.Tensor  # [B] int64, recovered token (all children rejected) or bonus token (at a leaf)
    output_tokens: torch.Tensor  # [B, N + 1] int64, tokens of the path then next_token, padded with -1

    def paths(self) -> list[tuple[int, ...]]:
        """The accepted paths as host tuples (one sync), the form ``Target.commit`` takes."""
        return [tuple(row[:n]) for row, n in zip(self.path.tolist(), self.accepted.tolist())]


def _structure(parents: torch.Tensor, valid: torch.Tensor):
    """Parent slots, first child per slot and next sibling per node; N (= none) where absent.

    Slot 0 is the committed prefix, slot i + 1 node i. Returns parent_slot [B, N] (-1 for padding),
    first_child [B, N + 1] and next_sibling [B, N], all int64.
    """
    batch, num = parents.shape
    rows = torch.arange(batch, device=parents.device)  # [B]
    parent_slot = torch.where(valid, parents + 1, -1)  # [B, N]
    bucket = torch.where(valid, parents + 1, num + 1)  # [B, N], padding goes to a spare slot N + 1
    seen = torch.full((batch, num + 2), num, dtype=torch.long, device=parents.device)  # [B, N + 2]
    next_sibling = torch.full((batch, num), num, dtype=torch.long, device=parents.device)  # [B, N]
    for i in reversed(range(num)):  # right to left: seen[s] is the lowest-index child of s so far
        next_sibling[:, i] = seen[rows, bucket[:, i]]
        seen[rows, bucket[:, i]] = i
    return parent_slot, seen[:, : num + 1], next_sibling


def _greedy_paths(parent_slot, tokens, valid, argmax):
    """Longest path of nodes whose token equals argmax p at their parent. Returns path [B, N], length [B]."""
    batch, num = tokens.shape
    device = tokens.device
    rows = torch.arange(batch, device=device)
    match = valid & (tokens == argmax.gather(1, parent_slot.clamp_min(0)))  # [B, N]
    best = torch.zeros(batch, num, dtype=torch.long, device=device)  # [B, N] matching depth below and at i
    for i in reversed(range(num)):  # children come after their parent
        below = torch.where(parent_slot == i + 1, best, 0).amax(-1)  # [B] deepest matching child
        best[:, i] = match[:, i] * (1 + below)
    # Unique keys: deeper first, then lower index.
    key = best * (num + 1) + (num - torch.arange(num, device=device))  # [B, N]
    path = torch.full((batch, num), -1, dtype=torch.long, device=device)
    length = torch.zeros(batch, dtype=torch.long, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)  # [B] current slot
    for step in range(num):
        cand = torch.where((parent_slot == cur[:, None]) & (best > 0), key, -1)  # [B, N]
        val, pick = cand.max(-1)  # [B]
        go = val >= 0
        path[:, step] = torch.where(go, pick, -1)
        length += go.long()
        cur = torch.where(go, pick + 1, cur)
    return path, length, argmax[rows, cur]


def verify_tree(
    parents: torch.Tensor,
    tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    *,
    counts: torch.Tensor | Sequence[int] | None = None,
    generators: Generators = None,
    greedy: bool | torch.Tensor | Sequence[bool] = False,
    siblings: str = "without_replacement",
) -> TreeVerdict:
    """Verify one draft tree per row (see the module docstring for the rule and why it is lossless).

    Args:
        parents: [B, N] int64, parent node of each node, -1 = child of the committed prefix; parent < node.
        tokens: [B, N] int64, the draft token of each node.
        q: [B, N, V] float, the distribution node i was drawn from given its parent (convention set by
            ``siblings``), or None for a deterministic drafter (one-hot q).
        p: [B, N + 1, V] float, target probabilities: p[:, 0] after the committed prefix, p[:, i + 1] after
            node i's path.
        counts: [B] live nodes per row (nodes past it are padding); default N.
        generators: one ``torch.Generator`` per row (row b draws ``counts[b] + 1`` uniforms: u_i decides node
            i, u_{counts[b]} samples the next token; none when greedy), or None for torch's default.
        greedy: True/False for all rows, or a [B] mask of temperature-0 rows.
        siblings: "without_replacement" or "independent", how siblings were drawn (module docstring).

    On a chain (parents [-1, 0, 1, ...]) this makes the same decisions, from the same uniforms, as
    ``verify_chain``.

    Example (one row, greedy): parents [-1, -1, 0, 1], tokens [5, 7, 9, 3], argmax p = [7, 0, 3, 0, 8] over
    slots [prefix, n0, n1, n2, n3]: node 1 (token 7) matches at the prefix, its child node 3 (token 3) matches
    argmax p[2], so path (1, 3), next_token 8 = argmax p[4], output_tokens [7, 3, 8, -1, -1].
    """
    if parents.ndim != 2 or tokens.shape != parents.shape:
        raise ValueError(f"verify_tree: parents and tokens must both be [B, N], got {tuple(parents.shape)} and "
                         f"{tuple(tokens.shape)}")
    batch, num = parents.shape
    if p.ndim != 3 or p.shape[:2] != (batch, num + 1) or not p.is_floating_point():
        raise ValueError(f"verify_tree: p must be float [B, N + 1, V] = [{batch}, {num + 1}, V], got {p.dtype} "
                         f"{tuple(p.shape)}")
    vocab = p.shape[-1]
    if q is not None and (q.shape != (batch, num, vocab) or not q.is_floating_point()):
        raise ValueError(f"verify_tree: q must be float [B, N, V] = [{batch}, {num}, {vocab}], got {q.dtype} "
                         f"{tuple(q.shape)}")
    if siblings not in SIBLING_MODES:
        raise ValueError(f"verify_tree: siblings must be one of {SIBLING_MODES}, got {siblings!r}")
    device = p.device
    live = host_list(counts, batch, num, "counts")
    if any(not 0 <= n <= num for n in live):
        raise ValueError(f"verify_tree: counts must be in [0, {num}], got {live}")
    greedy_rows = [bool(g) for g in host_list(greedy, batch, False, "greedy")]

    parents = parents.to(device=device, dtype=torch.long)
    tokens = tokens.to(device=device, dtype=torch.long)
    q = q.to(device) if q is not None else None  # a drafter on another device drew it
    n_live = torch.tensor(live, dtype=torch.long, device=device)  # [B]
    node = torch.arange(num, device=device)  # [N]
    valid = node[None, :] < n_live[:, None]  # [B, N] bool
    bad = valid & ((parents < -1) | (parents >= node[None, :]))
    if bool(bad.any()):
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"verify_tree: row {b} node {i} has parent {int(parents[b, i])}; need -1 <= parent < {i}")
    tokens = torch.where(valid, tokens, 0)  # padding made a safe index
    parent_slot, first_child, next_sibling = _structure(parents, valid)
    rows = torch.arange(batch, device=device)  # [B]

    path = torch.full((batch, num), -1, dtype=torch.long, device=device)  # [B, N]
    length = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    next_token = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    if not all(greedy_rows):
        u = draw_uniforms(generators, [0 if g else n + 1 for n, g in zip(live, greedy_rows)], num + 1,
                          device)  # [B, N + 1] fp64
        without = siblings == "without_replacement"
        p_res = p[:, 0].float()  # [B, V] residual target at the current node
        tried = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # [B, V] rejected siblings' tokens
        cand = first_child[:, :1]  # [B, 1] child being tried; N = none left
        taken = torch.full((batch, num), num, dtype=torch.long, device=device)  # [B, N] node accepted per step
        for step in range(num):  # every step tries one node per row, and a node is tried at most once
            has = cand < num  # [B, 1]
            c = cand.clamp_max(num - 1)  # [B, 1]
            x = tokens.gather(1, c)  # [B, 1]
            if q is None:
                q_c = torch.nn.functional.one_hot(x.squeeze(1), vocab).float()  # [B, V]
            else:
                q_c = q.gather(1, c[:, :, None].expand(-1, 1, vocab)).squeeze(1).float()  # [B, V]
            if without:  # x's law given the earlier siblings: q without their tokens, renormalized
                kept = q_c.masked_fill(tried, 0.0)
                kept = kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)  # all-zero stays zero: x is rejected
                q_c = torch.where(tried.any(-1, keepdim=True), kept, q_c)
            q_x = q_c.gather(1, x)  # [B, 1]
            acc = has & (q_x > 0) & (u.gather(1, c) * q_x < p_res.gather(1, x))  # [B, 1], u < p_res / q
            rej = has & ~acc
            taken[:, step : step + 1] = torch.where(acc, c, num)
            residual = (p_res - q_c).clamp_min(0)  # [B, V]
            mass = residual.sum(-1, keepdim=True)  # [B, 1]
            residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_res)
            p_next = p.gather(1, (c + 1)[:, :, None].expand(-1, 1, vocab)).squeeze(1).float()  # [B, V]
            p_res = torch.where(acc, p_next, torch.where(rej, residual, p_res))
            if without:
                tried = tried.scatter(1, x, rej | tried.gather(1, x)) & ~acc
            cand = torch.where(acc, first_child.gather(1, c + 1), torch.where(rej, next_sibling.gather(1, c), cand))
        # Accepted nodes of a row lie on one path and a child's index exceeds its parent's: sorting orders them.
        taken = taken.sort(-1).values
        path = torch.where(taken < num, taken, -1)
        length = (taken < num).sum(-1)
        next_token = inverse_cdf(p_res, u.gather(1, n_live[:, None]).squeeze(1))
    if any(greedy_rows):
        is_greedy = torch.tensor(greedy_rows, dtype=torch.bool, device=device)  # [B]
        g_path, g_len, g_next = _greedy_paths(parent_slot, tokens, valid, p.argmax(-1))
        path = torch.where(is_greedy[:, None], g_path, path)
        length = torch.where(is_greedy, g_len, length)
        next_token = torch.where(is_greedy, g_next, next_token)

    out = torch.full((batch, num + 1), -1, dtype=torch.long, device=device)  # [B, N + 1]
    out[:, :num] = torch.where(path >= 0, tokens.gather(1, path.clamp_min(0)), -1)
    out[rows, length] = next_token
    return TreeVerdict(path=path, accepted=length, next_token=next_token, output_tokens=out)
