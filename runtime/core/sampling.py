"""Sampling parameters, the logits -> p transform, and seeded sampling. Pure functions over [..., V] tensors.

``logits_to_probs`` is the one place where a request's sampling parameters turn target logits into the
distribution ``p`` (docs/design.md, "Notation"). Plain decoding samples from it and speculative verification compares
drafts against it, so both use this function and "p" means the same thing in both.

Randomness always comes from a per-request ``torch.Generator`` (``SamplingParams.make_generator``): a request's
random numbers do not depend on what else shares its batch. Its output is then reproduced by its seed up to
floating point: forward passes over different batch shapes differ in the last bits (~1e-5 in logits on CPU), and
a uniform that lands within that of a CDF boundary picks the neighbouring token (measured: ~1 in 600 seeded
streams of 20-30 tokens differ; both outputs follow the target law exactly). Sampling is by inverse CDF on float64 uniforms,
so every consumer (plain decoding, rejection, tree verification) draws the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

Generators = torch.Generator | Sequence[torch.Generator | None] | None


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The defaults are greedy decoding.

    Filters apply in this order on the temperature-scaled logits, each on what the previous one kept:
    top-k, top-p, min-p; then the survivors are renormalized (see ``logits_to_probs``).
    """

    temperature: float = 0.0  # 0 = greedy (argmax); > 0 divides the logits
    top_k: int = 0  # keep the k largest logits (ties at the k-th value are kept); 0 = off
    top_p: float = 1.0  # nucleus: smallest set of tokens with mass >= top_p, in (0, 1]; 1 = off
    min_p: float = 0.0  # drop tokens with p < min_p * max(p), in [0, 1); 0 = off
    seed: int | None = None  # seeds the request's generator; None = nondeterministic
    max_tokens: int = 256  # new tokens at most, >= 1
    stop: tuple[str, ...] = ()  # strings that end generation (matched by the caller on decoded text)

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"SamplingParams.{name} must be a finite number, got {v!r}")
            return float(v)

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"SamplingParams.{name} must be an integer, got {v!r}")
            return v

        t = number("temperature")
        if t < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {t}")
        if integer("top_k") < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 = off), got {self.top_k}")
        tp = number("top_p")
        if not 0.0 < tp <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {tp}")
        mp = number("min_p")
        if not 0.0 <= mp < 1.0:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1) (0 = off), got {mp}")
        if self.seed is not None and not 0 <= integer("seed") < 2**64:
            raise ValueError(f"SamplingParams.seed must be None or an integer in [0, 2**64), got {self.seed}")
        if integer("max_tokens") < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (tuple, list)):
            raise ValueError(f"SamplingParams.stop must be a list or tuple of strings, got {stop!r}")
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {stop!r}")
        object.__setattr__(self, "temperature", t)
        object.__setattr__(self, "top_p", tp)
        object.__setattr__(self, "min_p", mp)
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: p is one-hot on the argmax, verification is "accept while draft == argmax p"."""
        return self.temperature == 0.0

    def make_generator(self, device: str | torch.device = "cpu") -> torch.Generator:
        """A fresh generator for this request: seeded with ``seed``, or from OS entropy when it is None."""
        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def _per_row(params: SamplingParams | Sequence[SamplingParams], logits: torch.Tensor):
    """Parameter columns shaped to broadcast against ``logits`` [..., V]: [B, 1, ..., 1] or [1, ..., 1]."""
    if isinstance(params, SamplingParams):
        rows = [params]
        shape = (1,) * logits.ndim
    else:
        rows = list(params)
        if logits.ndim < 2 or len(rows) != logits.shape[0]:
            raise ValueError(
                f"logits_to_probs: {len(rows)} SamplingParams for logits of shape {tuple(logits.shape)}; "
                "give one per leading row, or a single SamplingParams"
            )
        shape = (len(rows),) + (1,) * (logits.ndim - 1)

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=logits.device).view(shape)

    return rows, col


def logits_to_probs(logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor:
    """Target logits -> the sampling distribution ``p``. [..., V] -> [..., V] fp32, rows sum to 1.

    ``params`` is one ``SamplingParams`` for every row, or one per leading row (``len == logits.shape[0]``,
    e.g. logits [B, gamma + 1, V] of a verify block).

    Steps, in fp32: divide by temperature; keep the top_k largest logits (ties with the k-th kept); keep the
    nucleus, the smallest prefix of tokens sorted by probability whose mass reaches top_p (the argmax is always
    kept; ties broken by token id); drop tokens with p < min_p * max p; softmax over the survivors.
    Temperature 0 gives a one-hot on ``argmax(logits)`` (first index among ties) and ignores the filters.

    Example: logits [2, 1, 0, -1] at temperature 1 give p ~ [.64, .24, .09, .03]; top_k=2 keeps tokens 0, 1
    -> [.73, .27, 0, 0]; top_p=0.7 alone keeps tokens 0, 1 (0.64 < 0.7 <= 0.88) -> the same;
    min_p=0.2 alone drops tokens with p < 0.2 * .64 = .13 -> again [.73, .27, 0, 0].
    """
    if logits.ndim < 1 or not logits.is_floating_point():
        raise ValueError(f"logits_to_probs: logits must be a float tensor [..., V], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    rows, col = _per_row(params, logits)
    x = logits.float()  # [..., V] fp32
    vocab = x.shape[-1]
    greedy_rows = [r.is_greedy for r in rows]
    if all(greedy_rows):
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()

    temp = col([r.temperature if r.temperature > 0 else 1.0 for r in rows], torch.float32)
    x = x / temp
    use_k = any(0 < r.top_k < vocab for r in rows)
    use_p = any(r.top_p < 1.0 for r in rows)
    if use_k or use_p:
        sx, order = x.sort(dim=-1, descending=True, stable=True)  # [..., V] sorted logits, their token ids
        if use_k:
            k = col([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], torch.long)
            kth = sx.gather(-1, (k - 1).expand(*x.shape[:-1], 1))  # [..., 1] k-th largest logit
            x = x.masked_fill(x < kth, float("-inf"))
            sx = sx.masked_fill(sx < kth, float("-inf"))
        if use_p:
            top_p = col([r.top_p for r in rows], torch.float32)
            ps = torch.softmax(sx, -1)  # [..., V] probabilities in sorted order
            mass_before = ps.cumsum(-1) - ps  # mass of the strictly more likely tokens
            drop_sorted = (mass_before >= top_p) & (top_p < 1.0)  # position 0 has mass_before 0: argmax kept
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
    if any(r.min_p > 0 for r in rows):
        min_p = col([r.min_p for r in rows], torch.float32)
        pr = torch.softmax(x, -1)
        x = x.masked_fill(pr < min_p * pr.amax(-1, keepdim=True), float("-inf"))
    probs = torch.softmax(x, -1)  # [..., V] fp32
    if any(greedy_rows):
        one_hot = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
        probs = torch.where(col(greedy_rows, torch.bool), one_hot, probs)
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids for uniforms ``u`` [...] in [0, 1) under (unnormalized) ``probs`` [..., V] -> [...] int64.

    Picks the first token whose cumulative mass exceeds ``u * total``, so a zero-probability token is never
    chosen. A row with no mass at all gives -1.
    """
    cdf = probs.double().cumsum(-1)  # [..., V] fp64
    total = cdf[..., -1:]  # [..., 1]
    below = torch.nextafter(total, torch.zeros_like(total))  # largest value < total keeps t inside the support
    t = torch.minimum(u.to(cdf)[..., None] * total, below)  # [..., 1]
    ids = torch.searchsorted(cdf, t, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)
    return torch.where(total.squeeze(-1) > 0, ids, -1)


def draw_uniforms(generators: Generators, counts: Sequence[int], width: int,
                  device: str | torch.device) -> torch.Tensor:
    """Float64 uniforms [B, width]: row b holds ``counts[b]`` fresh draws from ``generators[b]``, then zeros.

    Each row consumes exactly ``counts[b]`` draws from its own generator, so its stream does not depend on the
    other rows of the batch. ``generators=None`` draws every cell from torch's default generator instead.
    """
    batch = len(counts)
    if generators is None:
        return torch.rand(batch, width, dtype=torch.float64, device=device)
    if isinstance(generators, torch.Generator) or len(generators) != batch:
        raise ValueError(f"expected a list of {batch} generators (one per row), got {generators!r}")
    host = torch.zeros(batch, width, dtype=torch.float64)  # [B, width], rows of CPU generators
    on_device = []  # rows of accelerator generators, drawn where they live (no host round trip)
    for b, (g, n) in enumerate(zip(generators, counts)):
        if not n:
            continue
        if g is None or g.device.type == "cpu":
            host[b, :n] = torch.rand(n, generator=g, dtype=torch.float64)
        else:
            on_device.append((b, torch.rand(n, generator=g, dtype=torch.float64, device=g.device)))
    out = host.to(device)
    for b, r in on_device:
        out[b, : r.numel()] = r.to(device)
    return out


def _uniforms_like(shape: torch.Size, generator: Generators, device: torch.device) -> torch.Tensor:
    if generator is None or isinstance(generator, torch.Generator):
        dev = generator.device if generator is not None else device
        return torch.rand(shape, generator=generator, dtype=torch.float64, device=dev).to(device)
    if len(shape) == 0 or len(generator) != shape[0]:
        raise ValueError(f"expected {shape[0] if len(shape) else 0} generators (one per leading row), "
                         f"got {len(generator)}")
    rest = int(math.prod(shape[1:]))
    u = draw_uniforms(generator, [rest] * shape[0], rest, device)  # [B, rest]
    return u.view(shape)


def sample(probs: torch.Tensor, generator: Generators = None) -> torch.Tensor:
    """Sample token ids from ``probs`` [..., V] -> [...] int64 by inverse CDF.

    ``generator`` is one ``torch.Generator`` for the whole tensor, or a list with one per leading row (each
    row then draws ``prod(shape[1:-1])`` uniforms from its own generator), or None for torch's default.
    One-hot rows (temperature 0) always give their hot index.
    """
    u = _uniforms_like(probs.shape[:-1], generator, probs.device)  # [...] fp64
    return inverse_cdf(probs, u)


def sample_next(logits: torch.Tensor, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row from ``logits`` [B, V] -> [B] int64: ``sample(logits_to_probs(logits, params), generators)``
    with a fast path for greedy rows.

    A temperature-0 row's p is one-hot on ``logits.argmax(-1)``, and inverse-CDF sampling of a one-hot always gives
    its hot index, so greedy rows take the argmax directly: no probabilities, no uniform drawn (their generator is
    not advanced; a greedy row's draws never decide its tokens). The other rows are sampled exactly as the general
    path samples them, each from its own generator, so every row gets the same token either way.
    """
    params, generators = list(params), list(generators)
    if logits.ndim != 2 or not logits.is_floating_point():
        raise ValueError(f"sample_next: logits must be a float tensor [B, V], got {logits.dtype} {tuple(logits.shape)}")
    if len(params) != logits.shape[0] or len(generators) != logits.shape[0]:
        raise ValueError(f"sample_next: {len(params)} SamplingParams and {len(generators)} generators for "
                         f"{logits.shape[0]} rows")
    greedy = [p.is_greedy for p in params]
    if not any(greedy):
        return sample(logits_to_probs(logits, params), generators)
    ids = logits.argmax(-1)  # [B] int64
    if all(greedy):
        return ids
    rows = [b for b, g in enumerate(greedy) if not g]
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)  # [B_s]
    drawn = sample(logits_to_probs(logits[idx], [params[b] for b in rows]), [generators[b] for b in rows])  # [B_s]
    return ids.index_put((idx,), drawn)


def sample_without_replacement(probs: torch.Tensor, k: int, generator: Generators = None) -> torch.Tensor:
    """``k`` distinct ids per row, drawn one after another from ``probs`` [..., V] -> [..., k] int64.

    Draw j is from ``probs`` with the earlier draws removed and renormalized, and the ids come back in draw
    order: exactly the sibling law ``verify_tree(..., siblings="without_replacement")`` assumes, so a drafter
    that builds children with this (and keeps their order) is verified losslessly. A draw with no mass left
    (fewer than k tokens with p > 0) gives -1.
    """
    out = []
    pr = probs
    for _ in range(k):
        ids = sample(pr, generator)  # [...]
        out.append(ids)
        pr = pr.scatter(-1, ids.clamp_min(0).unsqueeze(-1), 0.0)
    return torch.stack(out, -1) if out else torch.empty(*probs.shape[:-1], 0, dtype=torch.long,
                                                        device=probs.device)
