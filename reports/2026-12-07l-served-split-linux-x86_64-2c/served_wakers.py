import sys, time, os, torch
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, configs
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
proc = load_processor(resolve("target"))
prompts = world_prompts(proc, ["caption"], 6)
cfg = configs({"grpc": {"enabled": False}})["plain"]
def allthreads():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:60]
            for t in os.listdir(f"/proc/{p}/task"):
                st = Path(f"/proc/{p}/task/{t}/status").read_text().splitlines()
                g = lambda k: int([l for l in st if l.startswith(k)][0].split()[1])
                name = [l for l in st if l.startswith("Name")][0].split(None, 1)[1]
                s = Path(f"/proc/{p}/task/{t}/stat").read_text(); f = s.rsplit(")", 1)[1].split()
                out[(p, t)] = (cmd, name, g("voluntary_ctxt"), g("nonvoluntary_ctxt"), int(f[11]) + int(f[12]))
        except (OSError, IndexError):
            pass
    return out
with ServedApp(cfg, num_cpus=None, log=Path("/tmp/serve-w.log")) as app:
    r = ServedRunner(app.url, 64, 1)
    for p in prompts: r([p])
    a = allthreads(); t0 = time.perf_counter(); tok = 0
    for _ in range(2):
        for p in prompts: tok += r([p])[0]["tokens"]
    w = time.perf_counter() - t0; b = allthreads()
    print("tok/s", round(tok / w, 1), "wall", round(w, 2))
    rows = []
    for k, (cmd, name, v, nv, c) in b.items():
        o = a.get(k, (cmd, name, 0, 0, 0))
        rows.append((v - o[2], nv - o[3], c - o[4], k, name, cmd))
    rows.sort(key=lambda x: -(x[0] + x[1]))
    print("total vol", sum(x[0] for x in rows), "nonvol", sum(x[1] for x in rows))
    for v, nv, c, k, name, cmd in rows[:30]:
        print(f"vol {v:6d} nonvol {nv:5d} cpu {c:4d}t {k[0]:>7}/{k[1]:<7} {name:18s} {cmd}")
    r.close()
