"""Draft time per block against T_decode, per drafter, in one process (the A/B behind this report's README).

    python reports/2026-12-06d-draft-cost-linux-x86_64-2c/ab/draft_ab.py massv text_lm ensemble flash

For each caption prompt (4) and round (R, default 3): plain decoding, then each drafter at gamma 4, greedy, 64 tokens.
Per request: (median) drafter ``propose`` time / the target's ``decode_step`` time in the plain run just before it,
and ``begin`` (the drafter's prefill, captions included) / that T_decode. Run it on two checkouts (git checkout REV
-- drafters/) to compare; the ratio is taken inside one process, so a machine that runs slower for a while moves
both sides.
"""

import collections
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("T", "1")))
from specula.runtime.bench.spec import encoded_prompts, load, make_drafter  # noqa: E402
from specula.runtime.core.sampling import SamplingParams  # noqa: E402
from specula.runtime.engine.loop import SpecEngine  # noqa: E402

path, processor, target, _ = load("target", "cpu", hf=False)
kinds = sys.argv[1:] or ["massv"]
prompts = encoded_prompts(processor, ["caption"], 4, 0)
params = SamplingParams(temperature=0.0, seed=0, max_tokens=64)
stats = collections.defaultdict(lambda: [0, 0.0])


def timed(obj, name, key):
    f = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        stats[key][0] += 1
        stats[key][1] += time.perf_counter() - t
        return r

    setattr(obj, name, wrapper)


plain = SpecEngine(target, None)
timed(target, "decode_step", "T")
engines = {}
for kind in kinds:
    d = make_drafter({"kind": kind}, target, processor.tokenizer)
    timed(d, "propose", kind)
    timed(d, "begin", kind + ".begin")
    engines[kind] = SpecEngine(target, d, gamma=4)
ratios = collections.defaultdict(list)
for rnd in range(int(os.environ.get("R", "3"))):
    for _, pid, p in prompts:
        for kind, eng in engines.items():
            stats.clear()
            plain.generate([p.request(f"{pid}-p{rnd}", params)])
            eng.generate([p.request(f"{pid}-{kind}{rnd}", params)])
            t_decode = stats["T"][1] / stats["T"][0]
            ratios[kind].append(stats[kind][1] / stats[kind][0] / t_decode)
            ratios[kind + ".begin"].append(stats[kind + ".begin"][1] / t_decode)
for k, v in ratios.items():
    print(f"{k:16s} median {statistics.median(v):.3f} T_decode  (min {min(v):.3f} max {max(v):.3f}, n={len(v)})")
