"""How much of the target's prefill is the matrix multiplies it must do: the language model's linear layers (the
LM head aside: the prefill applies it to the last position only), their FLOPs over the prompt's tokens, and the
time the same multiplies take alone (inputs of the prefill's shapes through the kernel the target's linears use:
oneDNN on packed weights where the target packed them, ``targets/packed_linear.py``, else ``F.linear``).

A prefill close to "its matmuls alone" is compute-bound: no scheduling or engine change makes it cheaper, only
fewer FLOPs would (a smaller or quantized target: not lossless). ``bench target`` reports it beside the prefill,
which is what bounds every speedup of speculation when answers are short (``ceilings.py``).
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from specula.runtime.bench.device_clock import ms_since, now
from specula.targets.packed_linear import pack_linears


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


def linears_alone_ms(shapes: Counter, tokens: int, device, dtype, repeats: int = 5, packed: bool = False) -> float:
    """The median time of every layer's multiply on a [tokens, in] input, summed over the layers (ms); ``packed``:
    through oneDNN on a packed weight, as a packed target's linears run."""
    device = torch.device(device)
    total = 0.0
    g = torch.Generator().manual_seed(0)
    for (i, o), n in shapes.items():
        x = torch.randn(tokens, i, generator=g).to(device=device, dtype=dtype)  # [T, in]
        layer = torch.nn.Linear(i, o, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(o, i, generator=g))  # [out, in]
        layer = layer.to(device=device, dtype=dtype)
        if packed:
            pack_linears(layer)
        times = []
        for r in range(repeats + 1):
            t = now(device)
            with torch.no_grad():
                layer(x)
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
    packed = getattr(target, "linears_packed", 0) > 0
    alone = linears_alone_ms(shapes, tokens, target.device, dtype, repeats, packed)
    return {"tokens": tokens, "linear_layers": sum(shapes.values()), "linear_gflop": flops / 1e9,
            "kernel": "oneDNN, packed weights" if packed else "F.linear",
            "linears_alone_ms": alone, "linears_alone_gflops": flops / alone / 1e6 if alone > 0 else None,
            "prefill_gflops": flops / prefill_ms / 1e6 if prefill_ms else None,
            "share_of_prefill": alone / prefill_ms if prefill_ms else None}


def describe(m: dict | None) -> str | None:
    """One sentence for a report, or None when nothing was measured."""
    if not m or m.get("share_of_prefill") is None:
        return None
    return (f"The language model's prefill over {m['tokens']} prompt tokens multiplies {m['linear_gflop']:.2f} GFLOP "
            f"in its {m['linear_layers']} linear layers ({m['prefill_gflops']:.0f} GFLOP/s over the whole prefill); "
            f"the same multiplies alone ({m.get('kernel', 'F.linear')}) take {m['linears_alone_ms']:.2f} ms "
            f"({m['linears_alone_gflops']:.0f} GFLOP/s): {100 * m['share_of_prefill']:.0f}% of the prefill.")
