"""A/B: the default with the text-only route vs flash alone, served and in process, round robin, each alone."""
import tempfile, sys, os, json
from pathlib import Path
from collections import defaultdict
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
suites = sys.argv[1].split(","); n = int(sys.argv[2])
prompts = S.world_prompts(processor, suites, n)
variants = {"served/plain": {"drafter": {"gamma": 0}}, "served/flash": {"drafter": {"kind": "flash"}}, "served/route": {}}
apps = {}
try:
    for name, c in variants.items():
        apps[name] = S.ServedApp({"grpc": {"enabled": False}, **c}, num_cpus=None, log=Path(tempfile.gettempdir()) / f"ab-{name.replace('/', '-')}.log")
        apps[name].freeze(True)
    d = cfg.drafter
    base = S.in_process_runners(target, processor, {"kind": "flash"}, d.gamma, 64, d.adaptive, d.begin_after)
    route = S.in_process_runners(target, processor, {"kind": "flash"}, d.gamma, 64, d.adaptive, d.begin_after,
                                 alternatives={"msd": {"kind": "msd"}}, text_only="msd", default_name="flash")
    runners = {"in_process/plain": base["plain"], "in_process/flash": base["default"], "in_process/route": route["default"]}
    for name, a in apps.items():
        a.freeze(False); runners[name] = S.ServedRunner(a.url, 64, 1); a.freeze(True)
    sets = S.round_robin(runners, prompts, 1, apps)
finally:
    for a in apps.values(): a.close()
tps = {k: sum(r["tokens"] for r in v["rows"]) / v["wall_s"] for k, v in sets.items()}
ref = {r["prompt_id"]: r["text"] for r in sets["in_process/plain"]["rows"]}
for k, v in tps.items():
    rt = k.split("/")[0]
    exact = all(ref[r["prompt_id"]] == r["text"] for r in sets[k]["rows"])
    print(f"{k:20s} {v:7.1f} tok/s  x in-proc plain {v/tps['in_process/plain']:.3f}  x same-runtime plain {v/tps[rt + '/plain']:.3f} exact {exact}")
per = defaultdict(dict)
for k, v in sets.items():
    acc = defaultdict(lambda: [0, 0.0])
    for r in v["rows"]:
        acc[r["suite"]][0] += r["tokens"]; acc[r["suite"]][1] += r["wall_s"]
    for s, (t, w) in acc.items(): per[s][k] = t / w
print("suite " + " ".join(f"{k:>18s}" for k in tps))
for s in suites:
    print(f"{s:12s}" + " ".join(f"{per[s][k] / per[s][k.split('/')[0] + '/plain']:18.3f}" for k in tps))
drafters = defaultdict(lambda: defaultdict(int))
for k in ("served/route", "served/flash"):
    for r in sets[k]["rows"]:
        drafters[k][(r["suite"], (r["metrics"] or {}).get("drafter"))] += 1
print({k: dict(v) for k, v in drafters.items()})
