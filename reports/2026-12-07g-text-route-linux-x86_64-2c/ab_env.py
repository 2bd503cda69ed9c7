"""Served apps (name -> [config overrides, env]) against in-process plain, round robin, each alone."""
import tempfile, time, sys, os, json
from pathlib import Path
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
suites = sys.argv[1].split(","); n = int(sys.argv[2])
prompts = S.world_prompts(processor, suites, n)
variants = json.loads(sys.argv[3])
apps = {}
try:
    for name, (c, env) in variants.items():
        old = dict(os.environ); os.environ.update(env)
        try:
            apps[name] = S.ServedApp({"grpc": {"enabled": False}, **c}, num_cpus=None, log=Path(tempfile.gettempdir()) / f"iv-{name}.log")
        finally:
            os.environ.clear(); os.environ.update(old)
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
