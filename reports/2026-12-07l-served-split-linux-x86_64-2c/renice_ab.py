import sys, time, os
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, configs
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
proc = load_processor(resolve("target"))
name = sys.argv[1] if len(sys.argv) > 1 else "plain"
scope = sys.argv[2] if len(sys.argv) > 2 else "all"
prompts = world_prompts(proc, ["caption"], 6)
cfg = configs({"grpc": {"enabled": False}})[name]
CLK = 100
def tasks(pids):
    out = {}
    for p in pids:
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                s = Path(f"/proc/{p}/task/{t}/stat").read_text(); f = s.rsplit(")", 1)[1].split()
                out[(p, int(t))] = int(f[11]) + int(f[12])
        except OSError: pass
    return out
with ServedApp(cfg, num_cpus=None, log=Path("/tmp/serve-r.log")) as app:
    r = ServedRunner(app.url, 64, 1)
    for p in prompts: r([p])
    pids = app.processes()
    rep = [p for p in pids if "Ingress" in Path(f"/proc/{p}/cmdline").read_text()][0]
    t = tasks([rep]); hot = sorted(t, key=lambda k: -t[k])[:2]
    print("hot threads", hot)
    def setnice(v):
        n = 0
        for (p, tid) in tasks(pids):
            if (p, tid) in hot: continue
            if scope == "others" and p == rep: continue
            if scope == "replica" and p != rep: continue
            try: os.setpriority(os.PRIO_PROCESS, tid, v); n += 1
            except OSError: pass
        return n
    def measure():
        tok = 0; t0 = time.perf_counter()
        for _ in range(2):
            for p in prompts: tok += r([p])[0]["tokens"]
        return tok / (time.perf_counter() - t0)
    res = {0: [], 19: []}
    for rnd in range(3):
        for v in (0, 19):
            setnice(v); res[v].append(round(measure(), 1))
    print(name, scope, "nice0", res[0], "nice19", res[19])
    setnice(0)
    r.close()
