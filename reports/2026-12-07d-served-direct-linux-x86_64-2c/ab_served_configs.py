"""Served apps of several configs (JSON: name -> config overrides) against in-process plain, round robin, each
alone: `python ab_served_configs.py caption 6 '{"a": {...}, "b": {...}}'`."""
import tempfile
import time, sys, os, json
from pathlib import Path
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
suites = sys.argv[1].split(","); n = int(sys.argv[2])
prompts = S.world_prompts(processor, suites, n)
variants = json.loads(sys.argv[3])  # name -> config
apps = {}
try:
    for name, c in variants.items():
        apps[name] = S.ServedApp({"grpc": {"enabled": False}, **c}, num_cpus=None, log=Path(tempfile.gettempdir()) / f"iv-{name}.log")
        apps[name].freeze(True)
    runners = {"in_process/plain": S.in_process_runners(target, processor, {}, 0, 64)["plain"]}
    for name, a in apps.items():
        a.freeze(False); runners[name] = S.ServedRunner(a.url, 64, 1); a.freeze(True)
    sets = S.round_robin(runners, prompts, 1, apps)
finally:
    for a in apps.values(): a.close()
tps = {k: sum(r["tokens"] for r in v["rows"]) / v["wall_s"] for k, v in sets.items()}
base = tps["in_process/plain"]
for k, v in tps.items(): print(f"{k:22s} {v:7.1f} tok/s  x in-proc plain {v/base:.3f}")
