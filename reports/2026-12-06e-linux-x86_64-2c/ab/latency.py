# python latency.py VARIANTS_JSON REQUESTS SUITE (VARIANTS: {name: {env var: value}}), from the checkout with .venv
"""Median latency of a one-token answer: in process vs served apps (env variants); round robin, each alone."""
import json, os, statistics, sys, time
from pathlib import Path
import torch
from specula.runtime.bench import served

torch.set_num_threads(2)
variants = json.loads(sys.argv[1]); R = int(sys.argv[2]); suite = sys.argv[3] if len(sys.argv) > 3 else "text"
target, processor = served._load("target")
prompts = served.world_prompts(processor, [suite], 4, seed=0)
logs = Path("/tmp/served_ab"); logs.mkdir(exist_ok=True)
apps = {}
try:
    for name, env in variants.items():
        saved = dict(os.environ); os.environ.update(env)
        try:
            apps[name] = served.ServedApp({"grpc": {"enabled": False}, "drafter": {"gamma": 0}}, num_cpus=2, log=logs / f"{name}.log")
        finally:
            os.environ.clear(); os.environ.update(saved)
        apps[name].freeze(True)
    for a in apps.values():
        a.freeze(False)
    inproc = served.in_process_runners(target, processor, {"kind": "flash"}, 0, 1)["plain"]
    clients = {k: served.ServedRunner(a.url, 1, 1) for k, a in apps.items()}
    lat = {k: [] for k in ["in_process", *apps]}
    for i in range(R):
        p = prompts[i % len(prompts)]
        for name in lat:
            for k, a in apps.items():
                a.freeze(k != name)
            t = time.perf_counter()
            (inproc if name == "in_process" else clients[name])([p])
            lat[name].append(time.perf_counter() - t)
            for a in apps.values():
                a.freeze(False)
    for k, v in lat.items():
        v = v[2:]
        print(f"{k:12s} median {statistics.median(v)*1e3:6.1f} ms  p25 {sorted(v)[len(v)//4]*1e3:6.1f}  p75 {sorted(v)[3*len(v)//4]*1e3:6.1f}", flush=True)
finally:
    for a in apps.values():
        a.close()
