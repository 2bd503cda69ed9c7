import json, time, sys
from pathlib import Path
import requests
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, configs
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
proc = load_processor(resolve("target"))
suite = sys.argv[1] if len(sys.argv) > 1 else "caption"
prompts = world_prompts(proc, [suite], 6)
with ServedApp(configs({"grpc": {"enabled": False}})["plain"], num_cpus=None, log=Path("/tmp/serve-m.log")) as app:
    r = ServedRunner(app.url, 64, 1)
    for p in prompts: r([p])
    base = app.url.rsplit("/v1", 1)[0]
    def phases():
        txt = requests.get(base + "/metrics").text
        return {l.split()[0]: float(l.split()[1]) for l in txt.splitlines() if not l.startswith("#") and l.strip()}
    a = phases(); rows = []
    for _ in range(3):
        for p in prompts: rows += r([p])
    b = phases()
    n = len(rows)
    for k in b:
        if ("_sum" in k or "time_seconds_total" in k) and b[k] - a.get(k, 0) > 0:
            print(k, "per request ms", round(1000 * (b[k] - a.get(k, 0)) / n, 3))
    out = [(x["wall_s"], sum(x["metrics"]["time_s"].values())) for x in rows]
    print("requests", n, "mean wall ms", round(1000 * sum(a for a, b in out) / n, 1), "outside ms", round(1000 * sum(a - b for a, b in out) / n, 2))
    r.close()
