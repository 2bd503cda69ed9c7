"""Chain verification: lossless rejection sampling of a block of draft tokens, vectorized over a batch.

Notation (docs/design.md): ``p`` target distribution (after ``logits_to_probs``), ``q`` the distribution each draft
token was actually sampled from, ``gamma`` drafts per block.

- accepted tokens: drafts x_j kept, each with probability ``min(1, p_j(x_j) / q_j(x_j))``, stopping at the
  first rejection;
- recovered token: at the first rejected position n, a sample from ``norm(max(0, p_n - q_n))``;
- bonus token: when all drafts of a row are accepted, a sample from ``p`` at the position after the last one.

Every emitted token is then distributed exactly as the target would have sampled it (Leviathan et al. 2023,
Chen et al. 2023). At temperature 0 the rule reduces to "accept while draft == argmax p, then emit argmax p".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .sampling import Generators, draw_uniforms, inverse_cdf


@dataclass(frozen=True)
class ChainVerdict:
    """What one verification of a chain block decided, per row."""

    accepted: torch.Tensor  # [B] int64, drafts accepted, 0 <= accepted <= num_draft
    next_token: torch.Tensor  # [B] int64, recovered token (after a rejection) or bonus token (all accepted)
    output_tokens: torch.Tensor  # [B, gamma + 1] int64, accepted drafts then next_token, padded with -1

    @property
    def num_emitted(self) -> torch.Tensor:
        """Tokens this block adds to each row: accepted + 1 (tau counts exactly these)."""
        return self.accepted + 1  # [B] int64


def host_list(x: torch.Tensor | Sequence | bool | int | None, batch: int, default, name: str) -> list:
    """A per-row flag or count as a host list of length ``batch`` (one sync at most, for a tensor)."""
    if x is None:
        return [default] * batch
    if isinstance(x, (bool, int)):
        return [x] * batch
    values = x.tolist() if isinstance(x, torch.Tensor) else list(x)
    if len(values) != batch:
        raise ValueError(f"{name} has {len(values)} entries for {batch} rows")
    return values


def verify_chain(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    *,
    num_draft: torch.Tensor | Sequence[int] | None = None,
    generators: Generators = None,
    greedy: bool | torch.Tensor | Sequence[bool] = False,
) -> ChainVerdict:
    """Verify a block of ``gamma`` chained drafts per row against the target.

    Args:
        draft_tokens: [B, gamma] int64, x_0 .. x_{gamma-1}; entries past a row's ``num_draft`` are ignored.
        q: [B, gamma, V] float, the distribution each draft was sampled from (given the prefix and the earlier
            drafts). None means a deterministic drafter: q_j is one-hot on x_j (also fine for greedy rows,
            which never read q).
        p: [B, gamma + 1, V] float, target probabilities: ``p[:, j]`` follows the prefix plus x_0 .. x_{j-1};
            ``p[b, num_draft[b]]`` is row b's bonus position (``p[:, gamma]`` for a full row).
        num_draft: [B] drafts per row (0 <= n <= gamma; 0 = plain decoding step); default gamma for all.
        generators: one ``torch.Generator`` per row (row b draws ``num_draft[b] + 1`` uniforms from it, none
            when greedy), or None for torch's default generator.
        greedy: True/False for all rows, or a [B] mask of temperature-0 rows.

    Row b uses uniform u_j to decide x_j (accept iff ``u_j * q_j(x_j) < p_j(x_j)``, i.e. u_j < p/q) and the
    separate uniform u_{num_draft} to sample the recovered or bonus token by inverse CDF.

    A draft with q_j(x_j) = 0 cannot have been sampled from q_j; it is rejected (acceptance probability 0 under
    the rule read literally). When the residual max(0, p_n - q_n) is all zero (only when p_n == q_n, where a
    rejection has probability 0) the recovered token is sampled from p_n.

    Worked example, V = 3, gamma = 2, draft [0, 2], q = [[.5, .3, .2], [.1, .1, .8]],
    p = [[.4, .4, .2], [.2, .2, .6], [.3, .3, .4]], uniforms u = [.5, .9, .7]:
    x_0 = 0: p/q = .4/.5 = .8 > .5, accepted. x_1 = 2: p/q = .6/.8 = .75 <= .9, rejected.
    Residual max(0, p_1 - q_1) = [.1, .1, 0] -> [.5, .5, 0]; u_2 = .7 picks token 1.
    Verdict: accepted 1, next_token 1, output_tokens [0, 1, -1]. Had both been accepted, the bonus token would
    come from p_2 = [.3, .3, .4].
    """
    if draft_tokens.ndim != 2 or draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"verify_chain: draft_tokens must be int [B, gamma], got {draft_tokens.dtype} "
                         f"{tuple(draft_tokens.shape)}")
    batch, gamma = draft_tokens.shape
    if p.ndim != 3 or p.shape[:2] != (batch, gamma + 1) or not p.is_floating_point():
        raise ValueError(f"verify_chain: p must be float [B, gamma + 1, V] = [{batch}, {gamma + 1}, V], got "
                         f"{p.dtype} {tuple(p.shape)}")
    vocab = p.shape[-1]
    if q is not None and (q.shape != (batch, gamma, vocab) or not q.is_floating_point()):
        raise ValueError(f"verify_chain: q must be float [B, gamma, V] = [{batch}, {gamma}, {vocab}], got "
                         f"{q.dtype} {tuple(q.shape)}")
    device = p.device  # drafts may come from a drafter on another device: verified where p lives
    draft_tokens = draft_tokens.to(device)
    q = q.to(device) if q is not None else None
    counts = host_list(num_draft, batch, gamma, "num_draft")
    if any(not 0 <= n <= gamma for n in counts):
        raise ValueError(f"verify_chain: num_draft must be in [0, {gamma}], got {counts}")
    greedy_rows = [bool(g) for g in host_list(greedy, batch, False, "greedy")]

    rows = torch.arange(batch, device=device)  # [B]
    n_draft = torch.tensor(counts, dtype=torch.long, device=device)  # [B]
    is_greedy = torch.tensor(greedy_rows, dtype=torch.bool, device=device)  # [B]
    valid = torch.arange(gamma, device=device)[None, :] < n_draft[:, None]  # [B, gamma] bool
    x = torch.where(valid, draft_tokens.long(), 0)  # [B, gamma], padding made a safe index

    ok = torch.zeros(batch, gamma, dtype=torch.bool, device=device)  # [B, gamma] draft accepted
    u = None
    if not all(greedy_rows):
        u = draw_uniforms(generators, [0 if g else n + 1 for n, g in zip(counts, greedy_rows)], gamma + 1,
                          device)  # [B, gamma + 1] fp64
        p_x = p[:, :gamma].gather(-1, x[..., None]).squeeze(-1).double()  # [B, gamma]
        q_x = torch.ones_like(p_x) if q is None else q.gather(-1, x[..., None]).squeeze(-1).double()
        ok = (q_x > 0) & (u[:, :gamma] * q_x < p_x)
    argmax = None
    if any(greedy_rows):
        argmax = p.argmax(-1)  # [B, gamma + 1]
        ok = torch.where(is_greedy[:, None], x == argmax[:, :gamma], ok)
    ok &= valid
    accepted = ok.long().cumprod(-1).sum(-1)  # [B] accepted prefix length

    next_token = torch.zeros(batch, dtype=torch.long, device=device)  # [B]
    if u is not None:
        p_n = p[rows, accepted].float()  # [B, V] target at the first rejection or the bonus position
        rejected = accepted < n_draft  # [B] bool
        if gamma > 0:
            at = accepted.clamp_max(gamma - 1)  # [B]
            if q is None:
                q_n = torch.nn.functional.one_hot(x[rows, at], vocab).float()  # [B, V]
            else:
                q_n = q[rows, at].float()  # [B, V]
            residual = (p_n - q_n * rejected[:, None]).clamp_min(0)  # bonus rows keep p_n
            mass = residual.sum(-1, keepdim=True)  # [B, 1]
            p_n = torch.where(rejected[:, None] & (mass > 0), residual / mass.clamp_min(1e-30), p_n)
        next_token = inverse_cdf(p_n, u.gather(1, n_draft[:, None]).squeeze(1))
    if argmax is not None:
        next_token = torch.where(is_greedy, argmax[rows, accepted], next_token)

    out = torch.full((batch, gamma + 1), -1, dtype=torch.long, device=device)  # [B, gamma + 1]
    out[:, :gamma] = torch.where(torch.arange(gamma, device=device)[None, :] < accepted[:, None], x, -1)
    out[rows, accepted] = next_token
    return ChainVerdict(accepted=accepted, next_token=next_token, output_tokens=out)
