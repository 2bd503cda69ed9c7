"""Target micro-benchmark: parameter counts, vision encode, prefill, T_decode and T_verify(gamma) / T_decode.

Everything is measured in one run, on one target, with the decode and verify timings interleaved round-robin
(decode, gamma=1, ..., gamma=8, decode, ...) so drift on a shared machine hits every ratio alike. A timed step is
``verify`` + ``commit`` with nothing accepted (the cache grows by one token per step, as in plain decoding), so
``T_verify(gamma) / T_decode`` is the cost of checking gamma drafts relative to emitting one token. Thread counts
are left as the caller set them.

    from specula.targets import load_target
    from specula.runtime.bench.target_timing import bench_target, render_markdown
    print(render_markdown(bench_target(load_target("/models/llava-1.5-7b-hf", device="cuda:0", dtype="float16"))))
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence

import torch

from specula.runtime.bench.device_clock import ms_since, now
from specula.runtime.bench.prefill_matmuls import describe, prefill_matmuls
from specula.targets.types import Accept, DraftBlock, PrefillRequest


def default_prompts(target, *, batch_size: int = 1, text_tokens: int = 64, seed: int = 0) -> list[PrefillRequest]:
    """``batch_size`` synthetic prompts: text, one random image, text (ids avoid the image/video tokens)."""
    g = torch.Generator().manual_seed(seed)
    info = target.info
    special = {info.image_token_id, getattr(target.model.config, "video_token_id", -1)}
    reqs = []
    for b in range(batch_size):
        pixels, grid = target.dummy_image(g)
        visual_tokens = target._image_tokens(pixels, grid, "bench")[0]
        text = torch.randint(3, info.vocab_size, (text_tokens,), generator=g)
        text = torch.where(torch.isin(text, torch.tensor(sorted(special))), 3, text)
        half = text_tokens // 2
        ids = torch.cat([text[:half], torch.full((visual_tokens,), info.image_token_id), text[half:]])
        reqs.append(PrefillRequest(f"bench-{b}", ids, pixels, grid))
    return reqs


def bench_target(
    target,
    prompts_fn: Callable[[], Sequence[PrefillRequest]] | None = None,
    gammas: Iterable[int] = range(1, 9),
    repeats: int = 20,
    warmup: int = 2,
    prefill_repeats: int = 5,
) -> dict:
    """Measure ``target`` (an HFTarget) and return a JSON-friendly dict; see ``render_markdown``.

    ``prompts_fn`` returns the batch to prefill and decode (default: one synthetic image prompt); its request ids
    are replaced by fresh ones for every prefill.
    """
    gammas = [int(g) for g in gammas]
    if any(g < 1 for g in gammas):
        raise ValueError(f"gammas must be >= 1, got {gammas}")
    prompts = list(prompts_fn() if prompts_fn is not None else default_prompts(target))
    if not prompts:
        raise ValueError("prompts_fn returned no prompts")
    device = target.device
    counter = iter(range(1 << 30))

    def fresh(tag: str) -> list[PrefillRequest]:
        return [dataclasses.replace(p, request_id=f"{tag}-{next(counter)}") for p in prompts]

    # Vision encode (all the batch's images at once) and prefill with pixels / with precomputed features.
    with_pixels = [p for p in prompts if p.pixel_values is not None]
    encode_ms: list[float] = []
    prefill_ms: list[float] = []
    prefill_lm_ms: list[float] = []
    for i in range(warmup + prefill_repeats):
        keep = i >= warmup
        visual = []
        if with_pixels:
            for p in with_pixels:
                t = now(device)
                visual.append(target.encode_images(p.pixel_values, "projected", image_grid_thw=p.image_grid_thw))
                if keep:
                    encode_ms.append(ms_since(t, device))
        reqs = fresh("prefill")
        t = now(device)
        target.prefill(reqs)
        if keep:
            prefill_ms.append(ms_since(t, device))
        target.release([r.request_id for r in reqs])
        if with_pixels:
            it = iter(visual)
            lm_reqs = [
                dataclasses.replace(r, pixel_values=None, visual=next(it)) if r.pixel_values is not None else r
                for r in fresh("prefill-lm")
            ]
            t = now(device)
            target.prefill(lm_reqs)
            if keep:
                prefill_lm_ms.append(ms_since(t, device))
            target.release([r.request_id for r in lm_reqs])

    # Decode and verify, interleaved.
    reqs = fresh("decode")
    ids = [r.request_id for r in reqs]
    out = target.prefill(reqs)
    target.commit([Accept(r, (), t) for r, t in zip(ids, out.logits.argmax(-1).tolist())])
    g = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {k: [] for k in [0, *gammas]}
    for i in range(warmup + repeats):
        for gamma in times:
            drafts = torch.randint(3, target.info.vocab_size, (len(ids), gamma), generator=g)
            t = now(device)
            res = target.verify(DraftBlock.chain(ids, drafts))
            nxt = res.logits[:, 0].argmax(-1).tolist()
            target.commit([Accept(r, (), tok) for r, tok in zip(ids, nxt)])
            if i >= warmup:
                times[gamma].append(ms_since(t, device))
    cache_len = target.kv.seq_len
    target.release(ids)

    decode = statistics.median(times[0])
    info = target.info
    tokens = sum(int(p.input_ids.shape[0]) for p in prompts)
    lm_ms = _median(prefill_lm_ms) if with_pixels else _median(prefill_ms)
    return {
        "model_type": info.model_type,
        "device": info.device,
        "dtype": info.dtype,
        "torch_threads": torch.get_num_threads(),
        "linears_packed": getattr(target, "linears_packed", 0),
        "batch_size": len(prompts),
        "prompt_tokens": [int(p.input_ids.shape[0]) for p in prompts],
        "cache_len_end": cache_len,
        "repeats": repeats,
        "params": _param_counts(target),
        "encode_ms": _median(encode_ms),
        "prefill_ms": _median(prefill_ms),
        "prefill_lm_ms": _median(prefill_lm_ms),
        "decode_ms": decode,
        "prefill_matmuls": prefill_matmuls(target, tokens, lm_ms, prefill_repeats),
        "verify": [
            {"gamma": k, "ms": statistics.median(v), "ratio": statistics.median(v) / decode}
            for k, v in times.items()
            if k > 0
        ],
    }


def render_markdown(result: dict) -> str:
    """A short report: setup line, parameter table, timing table."""
    p = result["params"]
    lines = [
        f"**Target** `{result['model_type']}` on `{result['device']}` ({result['dtype']}, "
        f"{result['torch_threads']} torch threads, {result.get('linears_packed', 0)} linear layers packed for "
        f"oneDNN), batch {result['batch_size']}, prompt tokens {result['prompt_tokens']}, {result['repeats']} "
        "repeats (medians).",
        "",
        "| part | parameters |",
        "| --- | ---: |",
        *(f"| {k} | {p[k]:,} |" for k in ("vision_tower", "projector", "language_model", "total")),
        "",
        "| step | ms | / T_decode |",
        "| --- | ---: | ---: |",
        f"| vision encode (per prompt's images) | {_fmt(result['encode_ms'])} | |",
        f"| prefill, pixels | {_fmt(result['prefill_ms'])} | |",
        f"| prefill, precomputed visual | {_fmt(result['prefill_lm_ms'])} | |",
        f"| decode (T_decode) | {_fmt(result['decode_ms'])} | 1.00 |",
        *(f"| verify gamma={v['gamma']} | {_fmt(v['ms'])} | {v['ratio']:.2f} |" for v in result["verify"]),
    ]
    if text := describe(result.get("prefill_matmuls")):
        lines += ["", text]
    return "\n".join(lines) + "\n"


def _param_counts(target) -> dict[str, int]:
    seen: set[int] = set()
    counts = {}
    for name, params in target.parameter_groups().items():
        fresh = [q for q in params if id(q) not in seen]
        seen.update(id(q) for q in fresh)
        counts[name] = sum(q.numel() for q in fresh)
    counts["total"] = sum(q.numel() for q in target.model.parameters())
    return counts


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
