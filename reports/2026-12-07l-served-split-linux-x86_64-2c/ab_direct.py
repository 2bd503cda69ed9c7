import sys, time, os, statistics
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, configs
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
proc = load_processor(resolve("target"))
suites = sys.argv[2].split(",") if len(sys.argv) > 2 else ["caption"]
prompts = world_prompts(proc, suites, 6)
cfg = configs({"grpc": {"enabled": False}})[sys.argv[1]]
apps = {}
for mode in ("0", "1"):
    os.environ["SPECULA_AB_DIRECT"] = mode
    apps[mode] = ServedApp(cfg, num_cpus=None, log=Path(f"/tmp/serve-ab{mode}.log"))
try:
    runners = {m: ServedRunner(a.url, 64, 1) for m, a in apps.items()}
    res = {m: [] for m in apps}; pre = {m: [] for m in apps}
    for rnd in range(4):
        for m in (("0", "1") if rnd % 2 == 0 else ("1", "0")):
            for o, a in apps.items(): a.freeze(o != m)
            tok = wall = 0
            for p in prompts:
                x = runners[m]([p])[0]; tok += x["tokens"]; wall += x["wall_s"]
                if rnd: pre[m].append(x["metrics"]["time_s"]["prefill"] * 1e3)
            if rnd: res[m].append(round(tok / wall, 1))
    for a in apps.values(): a.freeze(False)
    for m in apps: print("direct" if m == "1" else "hop   ", res[m], "prefill median ms", round(statistics.median(pre[m]), 2))
finally:
    for a in apps.values(): a.close()
