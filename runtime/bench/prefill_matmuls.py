"""How much of the target's prefill is the matrix multiplies it must do: the language model's linear layers (the
LM head aside: the prefill applies it to the last position only), their FLOPs over the prompt's tokens, and the
time the same multiplies take alone (``F.linear`` on inputs of the prefill's shapes, this machine's library).

A prefill close to "its matmuls alone" is compute-bound: no scheduling or engine change makes it cheaper, only
fewer FLOPs would (a smaller or quantized target: not lossless). ``bench target`` reports it beside the prefill,
which is what bounds every speedup of speculation when answers are short (``ceilings.py``).
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch
import torch.nn.functional as F

from specula.runtime.bench.device_clock import ms_since, now


def linear_shapes(target) -> Counter:
    """(in_features, out_features) -> how many of the language model's linear layers have it (no LM head)."""
    lm = {id(p) for p in target.parameter_groups()["language_model"]}
    head = target.model.get_output_embeddings()
    shapes: Counter = Counter()
    for m in target.model.modules():
        if isinstance(m, torch.nn.Linear) and m is not head and id(m.weight) in lm:
            shapes[(m.in_features, m.out_features)] += 1
    return shapes


def linear_flops(shapes: Counter, tokens: int) -> float:
    """Multiply-adds counted as two FLOPs: 2 * tokens * in * out per layer."""
    return float(sum(2 * tokens * i * o * n for (i, o), n in shapes.items()))


def linears_alone_ms(shapes: Counter, tokens: int, device, dtype, repeats: int = 5) -> float:
    """The median time of every layer's multiply on a [tokens, in] input, summed over the layers (ms)."""
    device = torch.device(device)
    total = 0.0
    g = torch.Generator().manual_seed(0)
    for (i, o), n in shapes.items():
        x = torch.randn(tokens, i, generator=g).to(device=device, dtype=dtype)  # [T, in]
        w = torch.randn(o, i, generator=g).to(device=device, dtype=dtype)  # [out, in]
        times = []
        for r in range(repeats + 1):
            t = now(device)
            F.linear(x, w)
            ms = ms_since(t, device)
            if r:  # the first is a warm-up
                times.append(ms)
        total += statistics.median(times) * n
    return total


def prefill_matmuls(target, tokens: int, prefill_ms: float | None, repeats: int = 5) -> dict:
    """The prefill's linear FLOPs over ``tokens`` prompt tokens, its achieved rate in ``prefill_ms`` (the LM
    prefill, visual features precomputed), and the same multiplies alone: time, rate and share of the prefill."""
    shapes = linear_shapes(target)
    flops = linear_flops(shapes, tokens)
    dtype = next(target.model.parameters()).dtype
    alone = linears_alone_ms(shapes, tokens, target.device, dtype, repeats)
    return {"tokens": tokens, "linear_layers": sum(shapes.values()), "linear_gflop": flops / 1e9,
            "linears_alone_ms": alone, "linears_alone_gflops": flops / alone / 1e6 if alone > 0 else None,
            "prefill_gflops": flops / prefill_ms / 1e6 if prefill_ms else None,
            "share_of_prefill": alone / prefill_ms if prefill_ms else None}


def describe(m: dict | None) -> str | None:
    """One sentence for a report, or None when nothing was measured."""
    if not m or m.get("share_of_prefill") is None:
        return None
    return (f"The language model's prefill over {m['tokens']} prompt tokens multiplies {m['linear_gflop']:.2f} GFLOP "
            f"in its {m['linear_layers']} linear layers ({m['prefill_gflops']:.0f} GFLOP/s over the whole prefill); "
            f"the same multiplies alone take {m['linears_alone_ms']:.2f} ms ({m['linears_alone_gflops']:.0f} "
            f"GFLOP/s): {100 * m['share_of_prefill']:.0f}% of the prefill.")
