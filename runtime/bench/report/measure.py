"""The timing loop every engine section of the report uses, and its summary.

``round_robin`` runs each prompt through every engine, one after another, the engine order rotating from prompt to
prompt, so drift on a shared machine (and which engine runs right after another) hits every configuration alike.
``summarize`` turns the raw runs into what the report prints, per group of prompts (a suite, "k=3" images, ...)
and for unions of groups ("all", "visual"):

    seconds, tokens, tokens_per_s    wall time of ``engine.generate`` and tokens emitted
    speedup_vs_plain                 the reference engine's seconds / this engine's seconds, same prompts
    tau, alpha                       vLLM's conventions (runtime/engine/metrics.py): tau counts the bonus token
    time_split_s                     draft (its prefill of each prompt included) / verify / other (vision,
                                     prefill, caption, sample, commit) seconds
    draft_ms_per_block               drafting cost per verification: the drafting of blocks, without the
                                     drafter's prefill of each prompt (``draft_begin_ms_per_request``)
    exact                            greedy only: outputs equal to the reference engine's, token for token
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from specula.runtime.engine.loop import GenerationRequest
from specula.runtime.engine.metrics import aggregate
from specula.runtime.core.sampling import SamplingParams


@dataclass(frozen=True)
class Prompt:
    group: str  # suite name, "k=3" (images per prompt), ...
    pid: str  # unique per prompt
    input_ids: torch.Tensor  # [L] int64, image tokens expanded
    pixel_values: torch.Tensor | None = None  # LLaVA [N_img, 3, S, S]; Qwen2.5-VL flattened patches
    image_grid_thw: torch.Tensor | None = None  # [N_img, 3] Qwen2.5-VL only

    def request(self, request_id: str, params: SamplingParams) -> GenerationRequest:
        return GenerationRequest(request_id, self.input_ids, self.pixel_values, params, self.image_grid_thw)


@dataclass
class Runs:
    """Raw measurements: name -> group -> value, and every output by (name, pid)."""

    params: SamplingParams
    seconds: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    tokens: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    metrics: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    outputs: dict = field(default_factory=lambda: defaultdict(dict))
    groups: dict = field(default_factory=dict)  # pid -> group


def prompt_params(params: SamplingParams, i: int) -> SamplingParams:
    """Prompt ``i``'s parameters: its own seed (base + i), the same for every engine."""
    return dataclasses.replace(params, seed=(params.seed or 0) + i)


def round_robin(engines: dict, prompts: Sequence[Prompt], params: SamplingParams, desc: str = "",
                warmup: bool = True) -> Runs:
    runs = Runs(params)
    names = list(engines)
    with torch.no_grad():
        if warmup and prompts:  # first calls allocate and pick kernels; not timed
            p = prompts[0]
            for name in names:
                engines[name].generate([p.request(f"warm-{desc}-{name}", dataclasses.replace(params, max_tokens=2))])
        for i, p in enumerate(tqdm(prompts, desc=desc or "bench", unit="prompt", mininterval=2.0, leave=False)):
            runs.groups[p.pid] = p.group
            pp = prompt_params(params, i)
            order = names[i % len(names):] + names[: i % len(names)]
            for name in order:
                t0 = time.perf_counter()
                res = engines[name].generate([p.request(f"{desc}-{p.pid}-{name}", pp)])
                dt = time.perf_counter() - t0
                r = next(iter(res.values()))
                runs.seconds[name][p.group] += dt
                runs.tokens[name][p.group] += len(r.tokens)
                runs.metrics[name][p.group].append(r.metrics)
                runs.outputs[name][p.pid] = list(r.tokens)
    return runs


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def stats(runs: Runs, name: str, groups: Sequence[str], reference: str = "plain") -> dict:
    """One configuration over the union of ``groups`` (see the module docstring for the keys)."""
    secs = sum(runs.seconds[name][g] for g in groups)
    toks = sum(runs.tokens[name][g] for g in groups)
    ref = sum(runs.seconds[reference][g] for g in groups) if reference in runs.seconds else 0.0
    m = aggregate([x for g in groups for x in runs.metrics[name][g]])
    t = dict(m.time)
    other = sum(v for k, v in t.items() if k not in ("draft", "draft_begin", "verify"))
    n_requests = sum(len(runs.metrics[name][g]) for g in groups)
    out = {
        "seconds": _r(secs, 4), "tokens": toks, "tokens_per_s": _r(toks / secs, 2) if secs else None,
        "speedup_vs_plain": _r(ref / secs) if secs and ref else None,
        "tau": _r(m.tau) if m.blocks else None, "alpha": [_r(a) for a in m.alpha[:8]],
        "blocks": m.blocks, "draft_tokens": m.draft_tokens, "accepted_tokens": m.accepted_tokens,
        "time_split_s": {"draft": _r(t.get("draft", 0.0) + t.get("draft_begin", 0.0), 4),
                         "verify": _r(t.get("verify", 0.0), 4), "other": _r(other, 4)},
        "draft_ms_per_block": _r(1e3 * t.get("draft", 0.0) / m.blocks, 4) if m.blocks else None,
        "draft_begin_ms_per_request": _r(1e3 * t.get("draft_begin", 0.0) / n_requests, 4) if n_requests else None,
    }
    if runs.params.is_greedy and name != reference and reference in runs.outputs:
        pids = [p for p, g in runs.groups.items() if g in set(groups)]
        same = sum(runs.outputs[name].get(p) == runs.outputs[reference].get(p) for p in pids)
        out["exact"] = same == len(pids)
        out["exact_prompts"] = f"{same}/{len(pids)}"
    return out


def summarize(runs: Runs, groups: Sequence[str], unions: dict[str, Sequence[str]] | None = None,
              reference: str = "plain") -> dict:
    """``{name: {"groups": {group: stats}, <union>: stats, ...}}`` for every engine measured."""
    unions = {"all": list(groups), **(unions or {})}
    out = {}
    for name in runs.seconds:
        row = {"groups": {g: stats(runs, name, [g], reference) for g in groups}}
        for u, gs in unions.items():
            gs = [g for g in gs if g in groups]
            row[u] = stats(runs, name, gs, reference) if gs else None
        out[name] = row
    return out
