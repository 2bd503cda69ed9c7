# python short.py SUITES N REPEATS, e.g. short.py vqa,chart,ocr 6 6
"""Short answers: in-process plain vs default (flash@4 adaptive, begin_after 2), each prompt alternately R times;
median wall per prompt; and the per-phase times."""
import statistics, sys, time
from collections import defaultdict
import torch
from specula.runtime.bench import served
torch.set_num_threads(2)
suites, n, R = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
target, processor = served._load("target")
prompts = served.world_prompts(processor, suites, n, seed=0)
run = served.in_process_runners(target, processor, {"kind": "flash"}, 4, 64, adaptive=True, begin_after=2)
for k in run:
    run[k](prompts[:2])
walls = defaultdict(lambda: defaultdict(list))
phases = defaultdict(lambda: defaultdict(float))
for rep in range(R):
    for p in prompts:
        for k in (("plain", "default") if rep % 2 == 0 else ("default", "plain")):
            t = time.perf_counter(); rows = run[k]([p]); w = time.perf_counter() - t
            walls[k][p.prompt_id].append(w)
            for ph, v in rows[0]["metrics"]["time_s"].items():
                phases[k][ph] += v
ratios = [statistics.median(walls["plain"][pid]) / statistics.median(walls["default"][pid]) for pid in walls["plain"]]
print("median-wall ratio plain/default per prompt:", [round(r, 3) for r in ratios])
print("geomean", round(statistics.geometric_mean(ratios), 4))
tot = {k: sum(sum(v) for v in walls[k].values()) for k in walls}
print("total wall", {k: round(v, 3) for k, v in tot.items()})
for k in phases:
    print(k, {ph: round(v * 1000 / (R * len(prompts)), 2) for ph, v in phases[k].items()}, "ms/request")
