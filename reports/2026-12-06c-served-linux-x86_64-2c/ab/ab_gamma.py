"""Served A/B of draft budgets (adaptive, hosted default) vs served plain, beside in-process plain; 1 and 8 streams."""
import json, sys
from pathlib import Path
import torch
from specula.runtime.bench import served
torch.set_num_threads(2)
suites = sys.argv[1].split(","); n = int(sys.argv[2]); gammas = [int(g) for g in sys.argv[3].split(",")]
streams_list = [int(s) for s in sys.argv[4].split(",")]
target, processor = served._load("target")
prompts = served.world_prompts(processor, suites, n, seed=int(sys.argv[5]) if len(sys.argv) > 5 else 0)
out = Path("/tmp/exp/abg"); out.mkdir(exist_ok=True)
variants = {"served/plain": {"grpc": {"enabled": False}, "drafter": {"gamma": 0}}}
for g in gammas:
    variants[f"served/g{g}"] = {"grpc": {"enabled": False}, "drafter": {"gamma": g}}
apps = {}
try:
    for name, c in variants.items():
        apps[name] = served.ServedApp(c, num_cpus=2, log=out / f"{name.replace('/', '-')}.log")
        apps[name].freeze(True)
    for a in apps.values():
        a.freeze(False)
    for streams in streams_list:
        runners = {"in_process/plain": served.in_process_runners(target, processor, {"kind": "flash"}, 0, 64)["plain"]}
        runners.update({k: served.ServedRunner(a.url, 64, streams) for k, a in apps.items()})
        sets = served.round_robin(runners, prompts, streams, apps)
        ip = sp = None
        for name, s in sets.items():
            toks = sum(r["tokens"] for r in s["rows"]); rate = toks / s["wall_s"]
            ip = ip or rate
            if name == "served/plain": sp = rate
            per = {}
            for r in s["rows"]:
                per.setdefault(r["suite"], [0, 0.0]); per[r["suite"]][0] += r["tokens"]; per[r["suite"]][1] += r["wall_s"] / streams
            print(f"{streams} {name:18s} {rate:7.1f} tok/s {rate/ip:.3f}x in-proc plain {rate/sp if sp else 0:.3f}x served plain |",
                  " ".join(f"{k}:{v[0]/v[1]:.1f}" for k, v in per.items()), flush=True)
finally:
    for a in apps.values():
        a.close()
