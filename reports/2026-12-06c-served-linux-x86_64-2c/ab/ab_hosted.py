"""A/B: verifier in the ingress vs its own TargetVerifier (both default one-machine otherwise), served plain and default,
beside in-process plain; round robin, each runtime alone (others frozen)."""
import json, sys, time
from pathlib import Path
import torch
from specula.runtime.bench import served
torch.set_num_threads(2)
suites = sys.argv[1].split(","); n = int(sys.argv[2]); streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
target, processor = served._load("target")
prompts = served.world_prompts(processor, suites, n, seed=0)
out = Path("/tmp/exp/ab"); out.mkdir(exist_ok=True)
variants = {
    "hosted/default": {"grpc": {"enabled": False}, **extra},
    "hosted/plain": {"grpc": {"enabled": False}, "drafter": {"gamma": 0}},
    "separate/default": {"grpc": {"enabled": False}, "deployments": {"target_verifier": {"in_ingress": False}}, **extra},
    "separate/plain": {"grpc": {"enabled": False}, "drafter": {"gamma": 0}, "deployments": {"target_verifier": {"in_ingress": False}}},
}
if extra:
    variants["hosted/default"] = {"grpc": {"enabled": False}, **extra}
apps = {}
try:
    for name, c in variants.items():
        apps[name] = served.ServedApp(c, num_cpus=2, log=out / f"{name.replace('/', '-')}.log")
        apps[name].freeze(True)
    for a in apps.values():
        a.freeze(False)
    runners = {"in_process/plain": served.in_process_runners(target, processor, {"kind": "flash"}, 0, 64)["plain"]}
    runners.update({k: served.ServedRunner(a.url, 64, streams) for k, a in apps.items()})
    sets = served.round_robin(runners, prompts, streams, apps)
finally:
    for a in apps.values():
        a.close()
ip = None
for name, s in sets.items():
    toks = sum(r["tokens"] for r in s["rows"]); rate = toks / s["wall_s"]
    ip = ip or rate
    per = {}
    for r in s["rows"]:
        per.setdefault(r["suite"], [0, 0.0]); per[r["suite"]][0] += r["tokens"]; per[r["suite"]][1] += r["wall_s"]
    print(f"{name:18s} {rate:7.1f} tok/s {rate/ip:.3f}x in-proc plain |", " ".join(f"{k}:{v[0]/v[1]:.1f}" for k, v in per.items()), flush=True)
