"""Served A/B for this report: each named config served by its own `specula serve` (local Ray, 2 CPUs), driven over
HTTP with the openai client beside in-process plain decoding, round robin, each runtime alone (the others frozen).

    python served_ab.py VARIANTS SUITES N STREAMS [SEED]
      VARIANTS: JSON {name: config overrides}, e.g. '{"plain": {"drafter": {"gamma": 0}}, "g8": {"drafter": {"gamma": 8}}}'
      SUITES: comma-separated world suites; N: prompts per suite; STREAMS: comma-separated concurrencies

Prints tokens/s per runner, x in-process plain, x the variant named "plain" (if any) and tokens/s per suite."""
import json
import sys
from pathlib import Path

import torch

from specula.runtime.bench import served

torch.set_num_threads(2)
variants, suites, n = json.loads(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
streams_list = [int(s) for s in sys.argv[4].split(",")]
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 0
target, processor = served._load("target")
prompts = served.world_prompts(processor, suites, n, seed=seed)
logs = Path("/tmp/served_ab")
logs.mkdir(exist_ok=True)
apps = {}
try:
    for name, overrides in variants.items():
        apps[f"served/{name}"] = served.ServedApp({"grpc": {"enabled": False}, **overrides}, num_cpus=2,
                                                  log=logs / f"{name}.log")
        apps[f"served/{name}"].freeze(True)  # quiet while the next one starts
    for a in apps.values():
        a.freeze(False)
    for streams in streams_list:
        runners = {"in_process/plain": served.in_process_runners(target, processor, {"kind": "flash"}, 0, 64)["plain"]}
        runners.update({k: served.ServedRunner(a.url, 64, streams) for k, a in apps.items()})
        sets = served.round_robin(runners, prompts, streams, apps)
        rates = {k: sum(r["tokens"] for r in s["rows"]) / s["wall_s"] for k, s in sets.items()}
        for name, s in sets.items():
            per = {}
            for r in s["rows"]:
                per.setdefault(r["suite"], [0, 0.0])
                per[r["suite"]][0] += r["tokens"]
                per[r["suite"]][1] += r["wall_s"] / streams
            vs_plain = rates[name] / rates["served/plain"] if "served/plain" in rates else float("nan")
            print(f"{streams} {name:20s} {rates[name]:7.1f} tok/s {rates[name] / rates['in_process/plain']:.3f}x "
                  f"in-process plain {vs_plain:.3f}x served plain |",
                  " ".join(f"{k}:{v[0] / v[1]:.1f}" for k, v in per.items()), flush=True)
finally:
    for a in apps.values():
        a.close()
